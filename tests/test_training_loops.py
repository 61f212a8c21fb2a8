"""Ordinary training loops through fxpooch, measured as a user would measure them.

Each scenario trains a model next to an eager deep copy for a few steps at two limits, 0.6x of
its in-core peak and 1.02x of its floor (the smallest limit the planner meets), and checks every
step: gradients equal to eager, and the peak that an independent counter measures around the
whole forward + backward (:class:`measure.StepCounter`, which dynamo does not fall back to eager
for) plus the resident storages (parameters, buffers, existing gradients, inputs) is at most the
limit. Capture, profiling and re-planning inside a step are measured too. Optimizer state is not
part of a step (it is resident between steps and not counted by fxpooch's plan), so the
measurement covers forward + backward only. The compiled module returns the loss (:class:`WithLoss`),
as the training-loop contract asks for a planned step: a loss computed outside it is user memory
the plan cannot see (test_a_loss_outside_the_compiled_module_costs_its_temporaries measures that).

On CUDA (where one is available) the same scenarios run on the GPU: the caching allocator's
``max_memory_allocated`` over the step, less what the eager copy and the optimizer hold, is the
measurement, and both limits keep the default allocator margin free.

TOLERANCE: the measured peak may exceed the limit by at most 2% (none of these scenarios needs
it today; it covers allocator-level differences between torch versions).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpooch
from fxpooch._torch_compat import tree_map
from fxpooch.memory import Margin
from fxpooch.planners import Problem, get_planner
from fxpooch.timing import ProfileOptions
from measure import HOST_OPS, StepCounter
from memcount import resident_bytes

TOLERANCE = 1.02
ANALYTIC = dict(profile="analytic", hardware="cpu")
WIDTH, BATCH = 256, 2048  # a (BATCH, WIDTH) fp32 activation is 2 MiB
#: the source label of a measured CPU profile: the thread clock with one intra-op thread
CPU_TIMER = "cpu-thread-time" if ProfileOptions().thread_clock() else "cpu-timer"


# -- models ------------------------------------------------------------------------------------
class Chain(nn.Module):
    """``layers`` x (Linear, ReLU); optional graph break (``"in_place"``: the second graph starts
    with an in-place op on the first one's output), custom Function, views/in-place/scatter."""

    def __init__(self, layers: int = 12, graph_break: bool | str = False, custom: bool = False, views: bool = False,
                 width: int = WIDTH):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        self.graph_break, self.custom, self.views = graph_break, custom, views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.net) // 2
        if self.graph_break == "in_place":  # the first half's last ReLU in the second graph, in place
            h = self.net[:half - 1](x)
            torch._dynamo.graph_break()
            h = F.relu(h, inplace=True)
        else:
            h = self.net[:half](x)
            if self.graph_break:
                torch._dynamo.graph_break()
        if self.custom:
            h = ScaledTanh.apply(h)
        if self.views:
            h = h.view(-1, 2, WIDTH // 2).transpose(1, 2).reshape(-1, WIDTH) * 1.5
            h = h.clone()
            h.mul_(0.5)  # in place on an intermediate
            idx = torch.arange(WIDTH, device=h.device).flip(0).expand_as(h)
            h = torch.zeros_like(h).scatter_add(1, idx, h)
        return self.net[half:](h)


class ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x) * 2
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (2 - y * y / 2)


class Siamese(nn.Module):
    """One encoder applied to two inputs in the same forward."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, a, b):
        return self.head(self.enc(a) * self.enc(b))


class ItemBranch(nn.Module):
    """Takes a branch on a Python number read with ``.item()`` (dynamo specialises on it)."""

    def __init__(self):
        super().__init__()
        self.a = Chain(8)
        self.b = Chain(8)

    def forward(self, x):
        h = self.a(x)
        if h.detach().amax().item() > 1.0:
            h = torch.tanh(h) * 2
        return self.b(h)


class CausalAttention(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 8):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        b, t, d = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(a.transpose(1, 2).reshape(b, t, d))
        return x


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def rand(*shape) -> torch.Tensor:
    return torch.randn(*shape)


# -- scenarios ---------------------------------------------------------------------------------
def _same(args, i):
    return args


def _noncontiguous_on_odd_steps(args, i):
    (x,) = args
    return (x.t().contiguous().t(),) if i % 2 else args  # same values and shape, other strides


def _scaled_on_odd_steps(args, i):
    (x,) = args
    return (x * 0.01,) if i % 2 else args  # flips ItemBranch's branch


def _autocast_on_odd_steps(i, device):
    return torch.autocast(device, dtype=torch.bfloat16) if i % 2 else contextlib.nullcontext()


def _wrap_at_step_1(model: nn.Module, i: int) -> None:
    if i == 1:
        model.net[4] = Wrapped(model.net[4])  # module wrapping after compile: dynamo guards on it


@dataclass(frozen=True)
class Scenario:
    build: Callable[[], tuple[nn.Module, tuple]]
    steps: int = 2
    inputs: Callable[[tuple, int], tuple] = _same
    context: Callable[[int, str], Any] = lambda i, device: contextlib.nullcontext()  # (step, device type)
    change: Callable[[nn.Module, int], None] | None = None  # applied to both models before step i
    accumulate: int = 1  # micro-batches per optimizer step (gradients are zeroed only after it)
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda ps: torch.optim.SGD(ps, lr=1e-3)
    tol: dict = field(default_factory=lambda: dict(rtol=1e-5, atol=1e-6))


def _hf(name: str) -> Callable[[], tuple[nn.Module, tuple]]:
    def build():
        transformers = pytest.importorskip("transformers")
        vocab, seq, batch = 512, 64, 4
        common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
        if name == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        elif name == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        else:
            model = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.1,
                decoder_start_token_id=0, pad_token_id=0))
        ids = torch.randint(1, vocab, (batch, seq))
        model.train()
        return model, ({"input_ids": ids, "labels": ids},)
    return build


SCENARIOS = {
    # what a dynamo recompile changes: each must run under its own plan
    "noncontiguous_input": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=3,
                                    inputs=_noncontiguous_on_odd_steps),
    "autocast_toggled": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=3, context=_autocast_on_odd_steps,
                                 tol=dict(rtol=2e-2, atol=2e-2)),
    "item_branch": Scenario(lambda: (ItemBranch(), (rand(BATCH, WIDTH),)), steps=3, inputs=_scaled_on_odd_steps),
    "module_wrapped": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=2, change=_wrap_at_step_1),
    # gradient accumulation: three micro-batches per optimizer step
    # (32 narrow layers: the existing gradients are a large share of the limit)
    "grad_accumulation": Scenario(lambda: (Chain(32), (rand(1536, WIDTH),)), steps=3, accumulate=3),
    # what already worked
    "graph_break": Scenario(lambda: (Chain(16, graph_break=True), (rand(BATCH, WIDTH),))),
    "graph_break_in_place": Scenario(lambda: (Chain(16, graph_break="in_place"), (rand(BATCH, WIDTH),))),
    "siamese": Scenario(lambda: (Siamese(), (rand(BATCH, WIDTH), rand(BATCH, WIDTH)))),
    "custom_function": Scenario(lambda: (Chain(custom=True), (rand(BATCH, WIDTH),))),
    "views_inplace_scatter": Scenario(lambda: (Chain(views=True), (rand(BATCH, WIDTH),))),
    "causal_sdpa": Scenario(lambda: (CausalAttention(), (rand(16, 512, 128),))),
    "sgd_momentum_5_steps": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=5,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    "adam_5_steps": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=5,
                             optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    "adamw_5_steps": Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),)), steps=5,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "hf_llama": Scenario(_hf("llama")),
    "hf_qwen2": Scenario(_hf("qwen2")),
    "hf_t5": Scenario(_hf("t5")),
}


def make(scenario: Scenario, device: str = "cpu") -> tuple[nn.Module, tuple]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, args = scenario.build()
    return model.to(device), tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, args)


class WithLoss(nn.Module):
    """``loss_of(model(...))`` as one module, so the loss is part of the compiled (planned) step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return loss_of(self.model(*args, **kwargs))


def call(m, args):
    if len(args) == 1 and isinstance(args[0], dict):
        return m(**args[0])
    return m(*args)


def loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.float().square().mean()


_limits: dict[tuple[str, str], tuple[int, int]] = {}


def limits(name: str, device: str = "cpu") -> tuple[int, int]:
    """(in-core peak, floor) of the scenario's step as it starts: with existing gradients when it accumulates.
    Both are limits: with the device's default allocator margin (none on the CPU) kept free."""
    if (name, device) not in _limits:
        scenario = SCENARIOS[name]
        model, args = make(scenario, device)
        if scenario.accumulate > 1:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        room = torch.cuda.get_device_properties(device).total_memory if device == "cuda" else "1TiB"
        plan = fxpooch.compile(WithLoss(model), args[0] if isinstance(args[0], dict) else args, room,
                               **ANALYTIC).plan
        with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
            get_planner(plan.planner)(Problem(plan.graph, plan.profile.costs(plan.graph), 1))
        margin = Margin.default_for(device)
        in_core, floor = margin.limit_for(plan.in_core_peak_bytes), margin.limit_for(info.value.min_feasible_bytes)
        if device == "cuda":  # compile measures the step there, and finds what the plan does not count
            try:
                fxpooch.compile(WithLoss(model), args[0] if isinstance(args[0], dict) else args, floor, **ANALYTIC)
            except fxpooch.InfeasibleMemoryLimit as e:  # the limit the error names is the one to use,
                in_core += e.min_feasible_bytes - floor  # and the in-core step takes as much more
                floor = e.min_feasible_bytes
        _limits[name, device] = (in_core, floor)
    return _limits[name, device]


def measured_peak(model: nn.Module, args: tuple, step: Callable[[], None], device: str = "cpu") -> int:
    """Resident bytes (parameters, buffers, gradients, inputs) plus the peak of what ``step`` allocates:
    counted by :class:`StepCounter` on the CPU, by the caching allocator on CUDA."""
    if device == "cuda":
        torch.cuda.synchronize()
        outside = torch.cuda.memory_allocated() - resident_bytes(model, list(args))  # the eager copy, optimizer state
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - outside
    counter = StepCounter(host_ops=HOST_OPS)
    counter.seed(model, args)
    resident = resident_bytes(model, list(args))
    with counter:
        step()
    return resident + counter.peak_bytes


def train(name: str, limit: int, device: str = "cpu") -> list[float]:
    """Train the scenario at ``limit`` next to eager; returns each step's measured peak / limit."""
    scenario = SCENARIOS[name]
    model, args = make(scenario, device)
    eager = copy.deepcopy(model)
    cm = fxpooch.compile(WithLoss(model), args[0] if isinstance(args[0], dict) else args, limit, **ANALYTIC)
    opt, ref_opt = scenario.optimizer(model.parameters()), scenario.optimizer(eager.parameters())
    ratios = []
    for i in range(scenario.steps):
        if scenario.change is not None:
            scenario.change(model, i)
            scenario.change(eager, i)
        step_args = scenario.inputs(args, i)

        def run(m, with_loss: bool):
            with scenario.context(i, device):
                torch.manual_seed(i)
                out = call(m, step_args)
                loss = out if with_loss else loss_of(out)
            loss.backward()

        ratios.append(measured_peak(model, step_args, lambda: run(cm, True), device) / limit)
        run(eager, False)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **scenario.tol, msg=lambda m, n=n: f"step {i}: grad of {n}: {m}")
        if (i + 1) % scenario.accumulate == 0:
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    return ratios


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CPU variant covers the same plans"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("which", ["0.6x_in_core", "1.02x_floor"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_training_loop_stays_under_the_limit(name: str, which: str, device: str):
    in_core, floor = limits(name, device)
    limit = int(0.6 * in_core) if which == "0.6x_in_core" else int(1.02 * floor)
    assert floor <= limit < in_core, (floor, limit, in_core)  # the scenario is out of core at both limits
    ratios = train(name, limit, device)
    assert max(ratios) <= TOLERANCE, [round(r, 3) for r in ratios]


# -- what re-plans, what raises ----------------------------------------------------------------
def chain_at(limit_share: float = 0.6, **kw) -> tuple[nn.Module, torch.Tensor, fxpooch.CompiledModule]:
    model, x = make(Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),))))
    in_core, _ = limits("graph_break" if kw.get("graph_break") else "noncontiguous_input")
    return model, x[0], fxpooch.compile(model, x, int(limit_share * in_core), **ANALYTIC, **kw)


def test_a_new_dynamo_graph_is_planned_with_its_reason_logged(caplog):
    model, x, cm = chain_at()
    first = cm.plan
    with caplog.at_level(logging.INFO, logger="fxpooch"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(x).float().sum().backward()
    replans = [r.message for r in caplog.records if "planning again" in r.message]
    assert len(replans) == 1, replans
    assert cm.plan is not first
    model.zero_grad(set_to_none=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fxpooch"):
        cm(x).sum().backward()  # the first plan again, from the cache
    assert not [r for r in caplog.records if "planning" in r.message]
    assert cm.plan is first


def test_past_max_plans_the_error_names_dynamos_reason():
    model, (x,) = make(SCENARIOS["item_branch"])
    cm = fxpooch.compile(model, x, "1GiB", max_plans=1, **ANALYTIC)
    with pytest.raises(fxpooch.ReplanLimitExceeded, match=r"item\(\)") as info:
        cm(x * 0.01).sum().backward()  # the other branch: a new graph after the .item() graph break
    assert "dynamo compiled graph" in str(info.value), str(info.value)


def test_a_forward_that_changes_what_dynamo_guards_on_is_refused():
    model, (x,) = make(SCENARIOS["noncontiguous_input"])
    calls = []
    model.net[0].register_forward_hook(lambda mod, inputs, out: calls.append(1) or out)
    cm = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    with pytest.raises(fxpooch.UnsupportedModel, match='guard on "calls"'):
        cm(x).sum().backward()


def test_two_forwards_before_one_backward_raise_and_say_what_to_do():
    model, x, cm = chain_at()
    a, b = x, x.flip(0)
    with pytest.raises(fxpooch.PendingBackward, match="backward on each forward"):
        (cm(a).sum() + cm(b).sum()).backward()
    # what the message suggests: one backward per forward, gradients accumulate as in eager
    eager = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    for m in (cm, eager):
        m(a).sum().backward()
        m(b).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # a forward whose outputs were dropped without backward holds nothing: the next one runs
    model.zero_grad(set_to_none=True)
    cm(a)
    cm(b).sum().backward()


class WithItsView(nn.Module):
    """Returns an output and a view of it: AOTAutograd replays the view outside the graph, so its
    ``grad_fn`` is one of autograd's C++ nodes (``SliceBackward0``)."""

    def __init__(self):
        super().__init__()
        self.net = Chain(4)

    def forward(self, x):
        y = self.net(x)
        return y, y[:, :8]


def test_an_output_and_a_view_of_it_train_as_in_eager():
    model, x = WithItsView(), rand(BATCH, WIDTH)
    eager = copy.deepcopy(model)
    in_core = fxpooch.plan(model, x, "1TiB", planner="in-core", **ANALYTIC).in_core_peak_bytes
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.compile(model, x, 1, **ANALYTIC)
    cm = fxpooch.compile(model, x, (info.value.min_feasible_bytes + in_core) // 2, **ANALYTIC)
    assert cm.plan.counts()["keep"] < len(cm.plan.graph.activations)  # out of core
    for m in (cm, eager):
        y, head = m(x)
        if m is cm:
            with pytest.raises(TypeError):  # the case: no weak reference to the view's grad_fn
                weakref.ref(head.grad_fn)
        (y.square().mean() + head.sum()).backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")
    _, head = cm(x)  # only the view kept: its graph's backward is still to run
    with pytest.raises(fxpooch.PendingBackward):
        cm(x)
    head.sum().backward()


class ScalesItsInput(Chain):
    """Doubles its input in place first (an input that requires grad: not a parameter)."""

    def forward(self, x):
        x.mul_(2)
        return super().forward(x)


def test_an_input_the_step_mutates_in_place_trains_as_in_eager():
    model, leaf = ScalesItsInput(4), rand(BATCH, WIDTH).requires_grad_()
    eager = copy.deepcopy(model)
    cm = fxpooch.compile(model, leaf * 1.0, "1TiB", **ANALYTIC)
    grads = []
    for m in (cm, eager):
        leaf.grad = None
        m(leaf * 1.0).square().mean().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_the_inspected_backward_graph_is_the_one_that_runs():
    model, x, cm = chain_at()
    calls = []
    for g in (*cm.forward_graphs, *cm.backward_graphs):
        g.register_forward_pre_hook(lambda mod, args, g=g: calls.append(g))
    cm(x).sum().backward()
    assert calls == [*cm.forward_graphs, *reversed(cm.backward_graphs)]


class FailsOnOddBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        if x.shape[0] % 2:
            raise ValueError("odd batch")
        return self.b(h)


def test_a_failed_call_keeps_no_inputs():
    torch.manual_seed(0)
    model, x = FailsOnOddBatch(), rand(BATCH, WIDTH)
    cm = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    odd = rand(BATCH - 1, WIDTH)
    with pytest.raises(ValueError, match="odd batch"):
        cm(odd)  # a new shape: captured, and the capture fails after the first graph
    assert cm._recorder.args == []
    ref = weakref.ref(odd.untyped_storage())
    del odd
    assert ref() is None, "the failed call's input is still referenced"


# -- profiling inside the step's memory --------------------------------------------------------
def test_in_situ_profiling_at_the_in_core_limit_stays_under_it():
    """Compiling at the in-core peak (profiled in situ) and re-planning for a new batch inside training."""
    model, (x,) = make(SCENARIOS["noncontiguous_input"])
    in_core = fxpooch.plan(model, x, "1TiB", **ANALYTIC).in_core_peak_bytes  # the model's own, without a loss
    compiled = {}

    def compile_step():
        compiled["cm"] = fxpooch.compile(model, x, in_core, profile="measure", hardware="cpu")

    assert measured_peak(model, (x,), compile_step) <= in_core
    cm = compiled["cm"]
    assert cm.plan.profile.source == CPU_TIMER  # in situ
    half = x[: BATCH // 2].clone()
    assert measured_peak(model, (half,), lambda: cm(half).sum().backward()) <= in_core  # re-plans in situ


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x):
        return self.net(x)


def test_per_node_profiling_under_bf16_autocast_with_layer_norm():
    torch.manual_seed(0)
    model, x = Normed(), rand(BATCH // 4, WIDTH)
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cm = fxpooch.compile(model, x, "1GiB", profile="measure", hardware="cpu", profile_mode="per-node")
        assert cm.plan.profile.source == f"{CPU_TIMER} per-node"
        cm(x).float().sum().backward()
        eager(x).float().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


# -- the memory model counts what runs ---------------------------------------------------------
class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
                                    for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpointed_recomputation_is_counted_on_its_own_buffers():
    """The step measured as the contract plans it (the output held until the backward returns, a
    dense incoming gradient) peaks at the planned in-core peak, and the floor, planned with no
    gradients resident as the measured step starts, is not above it."""
    torch.manual_seed(0)
    model, x = Checkpointed(), rand(BATCH, WIDTH)
    eager = copy.deepcopy(model)
    cm = fxpooch.compile(model, x, "1TiB", **ANALYTIC)

    def step():
        out = cm(x)
        out.backward(torch.ones_like(out))

    measured = measured_peak(model, (x,), step)
    planned = cm.plan.in_core_peak_bytes
    assert planned == measured, (planned, measured)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        get_planner(cm.plan.planner)(Problem(cm.plan.graph, cm.plan.profile.costs(cm.plan.graph), 1))
    assert info.value.min_feasible_bytes <= measured
    eager(x).backward(torch.ones_like(x))
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# -- errors that say what happened -------------------------------------------------------------
class _Skipped(nn.Module):
    """A wrapper whose forward dynamo does not trace: it runs the inner model eagerly."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    @torch.compiler.disable
    def forward(self, x):
        return self.inner(x)


def test_a_model_dynamo_runs_eagerly_is_named_so():
    with pytest.raises(fxpooch.UnsupportedModel, match="ran the model eagerly") as info:
        fxpooch.compile(_Skipped(), torch.randn(4, 8), "1GiB", **ANALYTIC)
    assert "requires_grad" not in str(info.value)
    assert "Compile the inner module" in str(info.value)


def test_a_loss_outside_the_compiled_module_costs_its_temporaries():
    """The README's boundary contract: with the model's output handed a dense gradient the whole step
    peaks at the plan's peak to the byte; a square-mean loss computed outside the compiled module
    adds its own temporaries, at most 3 output-sized buffers beyond the planned gradient."""
    model, (x,) = make(Scenario(lambda: (Chain(), (rand(BATCH, WIDTH),))))
    in_core = fxpooch.plan(model, x, "1TiB", **ANALYTIC).in_core_peak_bytes
    cm = fxpooch.compile(model, x, int(0.6 * in_core), **ANALYTIC)
    out_bytes = BATCH * WIDTH * 4

    def dense_gradient():
        out = cm(x)
        out.backward(torch.ones_like(out))

    def loss_outside():
        cm(x).square().mean().backward()

    planned = cm.plan.static_peak_bytes
    assert measured_peak(model, (x,), dense_gradient) == planned
    model.zero_grad()
    outside = measured_peak(model, (x,), loss_outside)
    assert outside <= planned + 3 * out_bytes, (planned, outside)
