"""fxpooch inside ``torch.compile``: ``fxpooch.backend(...)`` and the registered name ``"fxpooch"``.

Every graph dynamo compiles is planned (alone before it first runs, then the step as one), the
gradients are those of ``torch.compile``'s inductor, and the profiler measures a step's peak within
the limit."""
from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch
import torch.nn as nn

import fxpooch
from memprofile import step_peak

MiB = 2**20
#: the same kernels as torch.compile(backend="inductor"): equal up to rounding (observed: bit-equal)
INDUCTOR_TOL = dict(rtol=1e-6, atol=1e-6)


class TwoGraphs(nn.Module):
    """Six 1 MiB layers with a graph break in the middle; 2 MiB activations at batch 1024."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(512, 512), nn.GELU())])
        self.b = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(512, 512), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def model_and_input(batch: int = 1024) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TwoGraphs(), torch.randn(batch, 512)


def train_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    out.backward(torch.ones_like(out))
    return out


def resident_bytes(model: nn.Module, x: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles the same model class again: without a reset, dynamo's per-frame recompile
    limit (8) would make it run the later compiles eagerly, with no graph for any backend."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


LIMIT = 33 * MiB  # under the step's in-core peak (35 MiB planned), above the floor of each graph alone


def test_backend_plans_the_step_as_one_and_matches_inductor_within_the_limit():
    model, x = model_and_input()
    reference = copy.deepcopy(model)
    be = fxpooch.backend(mem_limit=LIMIT)
    compiled = torch.compile(model, backend=be, dynamic=False)
    plain = torch.compile(reference, backend="inductor", dynamic=False)
    peaks = []
    for _ in range(3):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        peaks.append(resident_bytes(model, x) + step_peak(lambda: train_step(compiled, x)))
        train_step(plain, x)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **INDUCTOR_TOL)
    # after the first step the two graphs are planned as one step, and that plan runs
    (pairs, planned), = be.plans.items()
    assert len(pairs) == 2 and be.plan is planned.plan and len(be.forward_graphs) == 2
    counts = be.plan.counts()
    assert counts["swap"] + counts["recompute"] > 0, counts
    assert be.plan.in_core_peak_bytes > LIMIT >= be.plan.peak_bytes
    # the profiler's peak (steps 2 and 3: the host pool is filled by then) is within the limit
    assert max(peaks[1:]) <= LIMIT, [p / MiB for p in peaks]
    # what runs is inductor's code compiled from the inspected graphs
    forward, _ = be.graph_code[0]
    assert "fxpooch.offload" in forward.source_code or "fxpooch.drop" in forward.source_code


def test_evaluation_under_no_grad_runs_inductor_code_unplanned():
    model, x = model_and_input(512)
    be = fxpooch.backend(mem_limit="1TiB")
    compiled = torch.compile(model, backend=be, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), torch.compile(copy.deepcopy(model), backend="inductor")(x),
                                   **INDUCTOR_TOL)
    assert not be.plans and not be.recorder.pairs  # nothing to plan: no graph pair was made
    train_step(compiled, x)  # a training step after evaluation is planned as usual
    assert be.plan.counts()["keep"] > 0


def test_a_recompiled_graph_is_planned_too():
    model, x = model_and_input()
    reference = copy.deepcopy(model)
    be = fxpooch.backend(mem_limit=LIMIT, codegen="fx")
    compiled = torch.compile(model, backend=be, dynamic=False)
    for batch in (1024, 512, 1024, 512):  # a new batch size: dynamo compiles new graphs
        xb = x[:batch]
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(train_step(compiled, xb), train_step(reference, xb))
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(be.plans) == 2 and {len(pairs) for pairs in be.plans} == {2}
    assert be.replans >= 1


def test_registered_name_takes_its_options_and_the_environment(monkeypatch):
    assert "fxpooch" in torch._dynamo.list_backends()
    names = {e.name: e.value for e in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("fxpooch") == "fxpooch.torch_backend:registered"
    options = {"mem_limit": "40MiB", "planner": "swap-all"}
    model, x = model_and_input()
    train_step(torch.compile(model, backend="fxpooch", options=options, dynamic=False), x)
    assert fxpooch.named_backend(options).plan.planner == "swap-all"
    monkeypatch.setenv("FXPOOCH_MEM_LIMIT", "1TiB")
    model, x = model_and_input(512)
    train_step(torch.compile(model, backend="fxpooch", dynamic=False), x)
    assert fxpooch.named_backend().plan.mem_limit == 2**40


def test_dynamic_shapes_are_refused_with_the_way_out():
    model, x = model_and_input(256)  # (a batch of 512 would be specialised: it equals the width)
    compiled = torch.compile(model, backend=fxpooch.backend("1TiB", codegen="fx"), dynamic=True)
    with pytest.raises(Exception, match="dynamic=False"):
        train_step(compiled, x)


def test_backend_options_are_checked(monkeypatch):
    monkeypatch.delenv("FXPOOCH_MEM_LIMIT", raising=False)
    with pytest.raises(fxpooch.InvalidMemoryLimit, match="FXPOOCH_MEM_LIMIT"):
        fxpooch.backend()
    with pytest.raises(fxpooch.InvalidOption, match="unknown"):
        fxpooch.backend("1GiB", mem_limt="1GiB")
    with pytest.raises(fxpooch.InvalidOption, match="before it first runs"):
        fxpooch.backend("1GiB", profile="measure")
    with pytest.raises(fxpooch.UnknownName):
        fxpooch.backend("1GiB", planner="nope")
