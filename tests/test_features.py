"""Model features through fxpooch, step for step against an eager deep copy.

Each feature is a small model whose activations are whole MiB in fp32 ((1024, 512) = 2 MiB).
It is compiled at the in-core limit, a middle one and the smallest feasible one (found through
``InfeasibleMemoryLimit.min_feasible_bytes``) and trained two SGD steps next to an eager deep
copy: outputs, every parameter gradient (``None`` included), the full ``state_dict`` after
each optimizer step and the final value of the inputs must match.

They match exactly (``torch.equal``), not just closely: on CPU the rewritten graphs run the
same aten kernels on the same values as eager, swaps are plain copies, recomputations re-run
deterministic kernels and random ops (dropout) are never recomputed. That holds under bf16
autocast too, so nothing here uses a tolerance.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import fxpooch
from fxpooch.capture import GraphPair
from measure import Limits, find_limits

W = 512  # a (1024, 512) fp32 activation is 2 MiB
B = 1024
PCIE3 = "v100-pcie3"
NVLINK2 = "v100-nvlink2"  # fast link: the floor swaps instead of recomputing


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# ----------------------------------------------------------------------------- models
class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(W, W) for _ in range(4))
        self.drop1, self.drop2 = nn.Dropout(0.5), nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop1(torch.relu(self.a(x)))
        h = self.drop2(torch.tanh(self.b(h)))
        h = F.dropout(torch.sigmoid(self.c(h)), 0.2, self.training)
        return self.d(h)


class ConvBN(nn.Module):
    """Three conv-BN-ReLU blocks on (4, 16, 64, 64) = 1 MiB activations, then a linear head."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(16, 16, 3, padding=1, bias=False) for _ in range(3))
        self.bns = nn.ModuleList(nn.BatchNorm2d(16) for _ in range(3))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        return self.head(x.mean((2, 3)))


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(W, W) for _ in range(4))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.a(x))
        y = self.b(h)
        y += h  # x += y on a value the backward does not need
        y.mul_(2)
        z = self.c(y)
        z.add_(1.0)
        return self.d(torch.tanh(self.relu(z)))


class Views(nn.Module):
    """Saved tensors that are views: a transpose fed to a matmul, a ``view`` and a transposed view."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        h = torch.tanh(self.a(x))  # (1024, 512)
        g = h.t() @ h  # saves h and h.t() (one storage, two layouts)
        k = torch.sigmoid(h.view(2, B // 2, W)).transpose(1, 2)  # saves a non-contiguous view
        m = (k @ g).reshape(B, W)
        return self.b(m * h)


class BufferCounter(nn.Module):
    """Updates registered buffers in place in forward: a step counter and an EMA of a hidden layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(W, W) for _ in range(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(W))

    def forward(self, x):
        h = torch.relu(self.a(x))
        self.steps += 1
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.c(torch.tanh(self.b(h))) * (1 + self.ema)


class BufferReassigned(BufferCounter):
    """The same, written as attribute reassignment (``self.ema = ...``), the other common spelling."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        self.steps = self.steps + 1
        self.ema = 0.9 * self.ema + 0.1 * h.mean(0).detach()
        return self.c(torch.tanh(self.b(h))) * (1 + self.ema)


class MutatesInput(nn.Module):
    """``x.add_(1)`` on an input that does not require grad; the caller sees the new value."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(W, W) for _ in range(3))

    def forward(self, x):
        x.add_(1)
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


class AutocastMLP(nn.Module):
    """Under bf16 autocast: bf16 activations and weight casts (``_to_copy``) that the plan may swap or
    recompute. The same bf16 kernels run as in eager, so even here the results are bit-identical."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(W, W) for _ in range(4))
        self.ln = nn.LayerNorm(W)

    def forward(self, x):
        h = F.gelu(self.a(x))
        h = self.ln(self.b(h))  # LayerNorm runs in fp32 under autocast
        return self.d(torch.tanh(self.c(h)))


class TiedLM(nn.Module):
    """Embedding and output projection share one Parameter."""

    VOCAB, DIM = 1024, 256

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, self.DIM)
        self.mid1, self.mid2 = nn.Linear(self.DIM, self.DIM), nn.Linear(self.DIM, self.DIM)
        self.out = nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mid1(self.emb(ids)))
        return self.out(torch.relu(self.mid2(h)))


class NonTensorArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(W, W) for _ in range(3))

    def forward(self, x, *, scale: float = 1.0, residual: bool = False):
        h = torch.relu(self.a(x)) * scale
        y = self.c(torch.tanh(self.b(h)))
        return y + x if residual else y


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(W, W) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.b(torch.relu(self.a(x))))
        return self.c(h), torch.sigmoid(self.d(h))


class LogitsAndIndex(nn.Module):
    """Returns logits and their argmax: an integer output that does not require grad."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(W, W) for _ in range(3))

    def forward(self, x):
        logits = self.c(torch.tanh(self.b(torch.relu(self.a(x)))))
        return logits, logits.argmax(-1)


def _frozen() -> nn.Module:
    """Frozen layers get no .grad. (Their activations can be swapped but not recomputed: capture
    saves only the primals that get a gradient, so a frozen weight is an "unsaved input".)"""
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.ReLU(),
                          nn.Linear(W, W))
    model[0].requires_grad_(False)  # a frozen first layer
    model[6].bias.requires_grad_(False)  # and one frozen bias
    return model


# ----------------------------------------------------------------------------- features
def _float_loss(out: Any) -> torch.Tensor:
    """Mean square of every floating output that requires grad (all of them enter the loss)."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert leaves, "the model returned nothing to backpropagate"
    return sum(t.float().pow(2).mean() for t in leaves)


@dataclass(frozen=True)
class Feature:
    make_model: Callable[[], nn.Module]
    make_input: Callable[[], Any]  # a tensor, a tuple of positional args or a dict of keyword args
    hardware: str = PCIE3
    planner: str = "pooch"
    eval: bool = False
    autocast: bool = False
    #: None: fxpooch matches eager; else the reason of a known fxpooch bug (the test is xfail)
    bug: str | None = None

    def build(self, seed: int = 0) -> tuple[nn.Module, Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, example = self.make_model(), self.make_input()
        model.train(not self.eval)
        return model, example

    def context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()


FEATURES: dict[str, Feature] = {
    "dropout": Feature(Dropouts, lambda: _randn(B, W), hardware=NVLINK2),
    "batchnorm_train": Feature(ConvBN, lambda: _randn(4, 16, 64, 64)),
    "batchnorm_eval": Feature(ConvBN, lambda: _randn(4, 16, 64, 64), eval=True),
    "inplace": Feature(InPlace, lambda: _randn(B, W)),
    "views": Feature(Views, lambda: _randn(B, W)),
    "buffer_inplace": Feature(BufferCounter, lambda: _randn(B, W)),
    "buffer_reassigned": Feature(BufferReassigned, lambda: _randn(B, W)),
    "mutated_input": Feature(MutatesInput, lambda: _randn(B, W)),
    "autocast_bf16": Feature(AutocastMLP, lambda: _randn(B // 2, W), autocast=True),  # bf16 (512, 512) = 0.5 MiB
    "tied_weights": Feature(TiedLM, lambda: torch.randint(0, TiedLM.VOCAB, (8, 128))),
    "non_tensor_args": Feature(NonTensorArgs, lambda: {"x": _randn(B, W), "scale": 0.5, "residual": True}),
    "two_outputs": Feature(TwoOutputs, lambda: _randn(B, W)),
    "output_without_grad": Feature(LogitsAndIndex, lambda: _randn(B, W)),
    "frozen_params": Feature(_frozen, lambda: _randn(B, W)),
}


# ----------------------------------------------------------------------------- helpers
def _clone(example: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, example)


def _call(module: nn.Module, example: Any) -> Any:
    if isinstance(example, dict):
        return module(**example)
    if isinstance(example, tuple):
        return module(*example)
    return module(example)


def _compile(feature: Feature, model: nn.Module, example: Any, limit) -> fxpooch.CompiledModule:
    with feature.context():
        return fxpooch.compile(model, example, limit, planner=feature.planner, profile="analytic",
                               hardware=feature.hardware)


def assert_same(actual: Any, expected: Any, what: str) -> None:
    """Bit-identical tensors (same dtype, shape and values); ``None`` only where eager has ``None``."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: {actual!r} vs {expected!r}"
        return
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor), what
    if actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected):
        return  # the fast path; assert_close below only to explain a difference
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def assert_same_tree(actual: Any, expected: Any, what: str) -> None:
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} vs {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            assert_same(a, e, f"{what}[{i}]")
            assert a.requires_grad == e.requires_grad, f"{what}[{i}]: requires_grad"
        else:
            assert a == e, f"{what}[{i}]"


def assert_same_state(model: nn.Module, eager: nn.Module, what: str) -> None:
    sd, ref = model.state_dict(), eager.state_dict()
    assert list(sd) == list(ref), what
    for k in ref:
        assert_same(sd[k], ref[k], f"{what}: state_dict[{k!r}]")


_limits: dict[str, Limits] = {}


def limits(name: str) -> Limits:
    if name not in _limits:
        feature = FEATURES[name]
        model, example = feature.build()
        _limits[name] = find_limits(lambda limit: _compile(feature, model, _clone(example), limit))
    return _limits[name]


def train_side_by_side(feature: Feature, limit, steps: int = 2) -> fxpooch.CompiledModule:
    """Compile at ``limit``, train ``steps`` SGD steps next to an eager deep copy, compare everything."""
    model, example = feature.build()
    eager = copy.deepcopy(model)
    cm = _compile(feature, model, _clone(example), limit)
    assert cm.plan.peak_bytes <= cm.plan.mem_limit
    assert_same_state(model, eager, "after compile")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=0.1)
    for step in range(steps):
        inputs, ref_inputs = _clone(example), _clone(example)
        with feature.context():
            torch.manual_seed(step)
            out = _call(cm, inputs)
            loss = _float_loss(out)
            torch.manual_seed(step)
            ref_out = _call(eager, ref_inputs)
            ref_loss = _float_loss(ref_out)
        loss.backward()
        ref_loss.backward()
        assert_same_tree(out, ref_out, f"step {step}: output")
        assert_same_tree(inputs, ref_inputs, f"step {step}: input after the step")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_same(p.grad, q.grad, f"step {step}: grad of {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_same_state(model, eager, f"step {step}: after opt.step()")
    return cm


def _param(name: str, *rest: Any, bug: str | None = None):
    bug = bug or FEATURES[name].bug
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(name, *rest, marks=marks, id="-".join([name, *map(str, rest)]))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name,which", [_param(n, w) for n in FEATURES for w in ("in_core", "middle", "floor")])
def test_feature_matches_eager(name: str, which: str):
    feature = FEATURES[name]
    limit = getattr(limits(name), which)
    cm = train_side_by_side(feature, limit)
    counts = cm.plan.counts()
    if which == "in_core":
        assert counts["swap"] == counts["recompute"] == 0, counts
    if which == "floor":
        # every feature model is deep enough that its floor frees something
        assert counts["swap"] + counts["recompute"] > 0, counts
        if feature.hardware == NVLINK2:
            assert counts["swap"] > 0, counts  # the fast link makes swapping the cheaper way


def test_feature_specifics():
    """What each feature's model must show for the comparisons above to mean something."""
    cm = train_side_by_side(FEATURES["tied_weights"], limits("tied_weights").floor, steps=1)
    tied = cm.model  # still one Parameter after a planned step and an optimizer step
    assert tied.out.weight is tied.emb.weight and {"emb.weight", "out.weight"} <= set(tied.state_dict())

    model, x = FEATURES["output_without_grad"].build()
    cm = _compile(FEATURES["output_without_grad"], model, x, limits("output_without_grad").floor)
    logits, index = cm(x)
    assert logits.requires_grad and not index.requires_grad and index.dtype == torch.int64

    model, x = FEATURES["autocast_bf16"].build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cm = fxpooch.compile(model, x, limits("autocast_bf16").floor, profile="analytic", hardware=PCIE3)
        out = cm(x)
    assert out.dtype == torch.bfloat16
    assert any(dtype == "bfloat16" for _, dtype in cm.plan.activation_meta)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())

    model, x = FEATURES["frozen_params"].build()
    cm = _compile(FEATURES["frozen_params"], model, x, limits("frozen_params").floor)
    cm(x).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None and model[6].bias.grad is None
    assert model[2].weight.grad is not None


@pytest.mark.parametrize("name", [
    _param(n) for n in FEATURES])
def test_compile_leaves_state_alone(name: str):
    """compile() runs the model once to trace it; the model, its inputs and the RNG must not show it."""
    feature = FEATURES[name]
    model, example = feature.build()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = list(model.buffers())
    before = _clone(example)
    rng = torch.get_rng_state()
    _compile(feature, model, example, "1TiB")
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(model.state_dict()) == list(state)
    for k, v in model.state_dict().items():
        assert_same(v, state[k], f"state_dict[{k!r}]")
    assert all(a is b for a, b in zip(model.buffers(), buffers, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert_same_tree(example, before, "example input")


def test_mutated_input_with_a_new_shape_matches_eager():
    """A new input shape plans again; that capture must not apply the forward's ``x.add_(1)`` a second time."""
    feature = FEATURES["mutated_input"]
    model, x = feature.build()
    eager = copy.deepcopy(model)
    cm = _compile(feature, model, x.clone(), "1TiB")
    x2 = torch.randn(B // 2, W)
    mine, ref = x2.clone(), x2.clone()
    out, ref_out = cm(mine), eager(ref)
    assert_same(mine, ref, "input after the step")
    assert_same(out, ref_out, "output")
    out.sum().backward()
    ref_out.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_same(p.grad, q.grad, f"grad of {name}")


def test_swapped_views_match_eager():
    """Every activation of the view model swapped: one storage saved as ``h`` and ``h.t()`` (two
    layouts, two host copies) and a non-contiguous transposed view come back intact."""
    feature = Feature(Views, lambda: _randn(B, W), hardware=NVLINK2, planner="swap-all")
    cm = train_side_by_side(feature, "1TiB")
    counts = cm.plan.counts()
    assert counts["swap"] == len(cm.plan.decisions) > 0, counts


def test_non_tensor_arguments_plan_again_per_value():
    feature = FEATURES["non_tensor_args"]
    model, example = feature.build()
    eager = copy.deepcopy(model)
    x = example["x"]
    cm = _compile(feature, model, example, limits("non_tensor_args").middle)
    plans = {}
    for scale, residual in [(0.5, True), (2.0, True), (2.0, False), (0.5, True)]:
        out, ref = cm(x, scale=scale, residual=residual), eager(x, scale=scale, residual=residual)
        plans.setdefault((scale, residual), cm.plan)
        assert cm.plan is plans[(scale, residual)]  # one plan per value, cached
        assert_same(out, ref, f"output at scale={scale}, residual={residual}")
        out.pow(2).mean().backward()
        ref.pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_same(p.grad, q.grad, f"grad of {name} at scale={scale}, residual={residual}")
        model.zero_grad()
        eager.zero_grad()
    assert len({id(p) for p in plans.values()}) == 3


def test_train_eval_toggle_on_one_compiled_module():
    """model.train()/eval() switch plans (BatchNorm and dropout change graphs); each matches eager."""
    feature = FEATURES["batchnorm_train"]
    model, x = feature.build()
    model.bns[1] = nn.Sequential(model.bns[1], nn.Dropout(0.3))
    eager = copy.deepcopy(model)
    cm = _compile(feature, model, x, limits("batchnorm_train").middle)
    seen = {}
    for mode in ("train", "eval", "train", "eval"):
        getattr(model, mode)()
        getattr(eager, mode)()
        torch.manual_seed(0)
        out = cm(x)
        torch.manual_seed(0)
        ref = eager(x)
        assert seen.setdefault(mode, cm.plan) is cm.plan
        out.pow(2).mean().backward()
        ref.pow(2).mean().backward()
        assert_same(out, ref, f"{mode}: output")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_same(p.grad, q.grad, f"{mode}: grad of {name}")
        assert_same_state(model, eager, mode)
        model.zero_grad()
        eager.zero_grad()
    assert seen["train"] is not seen["eval"]


@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_evaluation_without_grad(grad_off: str):
    """The usual validation loop: model.eval() and a forward under no_grad / inference_mode."""
    feature = FEATURES["batchnorm_train"]
    model, x = feature.build()
    eager = copy.deepcopy(model)
    cm = _compile(feature, model, x, limits("batchnorm_train").middle)
    model.eval()
    eager.eval()
    with getattr(torch, grad_off)():
        out = cm(x)
        ref = eager(x)
    assert_same(out, ref, "output")
    assert not out.requires_grad
    assert_same_state(model, eager, "after evaluation")


def test_submodule_eval_switch_runs_a_plan():
    """Freezing BatchNorm statistics (model.bns[0].eval()) is a train/eval switch: it must get a plan."""
    feature = FEATURES["batchnorm_train"]
    model, x = feature.build()
    eager = copy.deepcopy(model)
    cm = _compile(feature, model, x, limits("batchnorm_train").floor)
    ran: list[GraphPair] = []
    call_forward = GraphPair.call_forward

    def recording(self, args):
        ran.append(self)
        return call_forward(self, args)

    model.bns[0].eval()
    eager.bns[0].eval()
    with mock.patch.object(GraphPair, "call_forward", recording):
        out = cm(x)
    ref = eager(x)
    out.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    assert_same(out, ref, "output")  # correct either way: the unplanned graphs are the captured ones
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_same(p.grad, q.grad, f"grad of {name}")
    planned = {id(g) for g in cm.forward_graphs}  # what the current plan runs
    assert ran and all(id(pair.run_forward) in planned for pair in ran), "the step ran graphs no plan covers"
    assert cm.plan.peak_bytes <= cm.plan.mem_limit
