"""Scratch memory: bytes an op allocates and frees inside itself. A measured profile records them per
op, the profile's JSON keeps them, and the schedule and the simulator charge them during every run
and recompute of the op, so the planned peak equals the step's peak measured by the profiler's
allocator events (benchmarks/memprofile.py), which see inside the op."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import fxpooch
from fxpooch.graph import StepGraph
from fxpooch.profile import Profile, op_key
from fxpooch.schedule import Decision, Kind, build_schedule
from fxpooch.simulator import in_core_peak_bytes, simulate, static_memory
from memprofile import step_peak
from stepgraphs import MiB, chain

#: what the test op takes and frees inside itself: four times its 1 MiB input
SCRATCH = 4 * MiB


@torch.library.custom_op("fxpooch_test::scratchy", mutates_args=())
def scratchy(x: torch.Tensor) -> torch.Tensor:
    """``2 * x``, by way of a buffer four times the size of ``x`` that is freed when it returns."""
    tmp = torch.empty((4 * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    tmp[: x.shape[0]].copy_(x)
    return tmp[: x.shape[0]].add(x)


@scratchy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


scratchy.register_autograd(lambda ctx, grad: grad + grad)


class Net(nn.Module):
    """1 MiB weights and activations; the scratchy op's output is saved for ``b``'s weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 512, bias=False)
        self.b = nn.Linear(512, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(scratchy(torch.tanh(self.a(x)))))


def net() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(), torch.randn(512, 512)


def scratchy_key(graph: StepGraph) -> str:
    (op,) = [i for i, o in enumerate(graph.ops) if o.target == str(torch.ops.fxpooch_test.scratchy.default)]
    return op_key(graph, op)


@pytest.fixture(scope="module")
def measured() -> Profile:
    model, x = net()
    return fxpooch.profile_step(fxpooch.trace_step(model, (x,)), "measure", hardware="cpu", mode="in-situ")


@pytest.mark.parametrize("mode", ["in-situ", "per-node"])
def test_measured_profile_reports_the_ops_scratch(mode: str):
    model, x = net()
    step = fxpooch.trace_step(model, (x,))
    key = scratchy_key(step.graph)
    profile = fxpooch.profile_step(step, "measure", hardware="cpu", mode=mode)
    assert profile.op_scratch == {key: SCRATCH}
    assert key in profile.op_times


def test_analytic_profile_has_no_scratch():
    model, x = net()
    step = fxpooch.trace_step(model, (x,))
    profile = fxpooch.profile_step(step, "analytic", hardware="cpu")
    assert profile.op_scratch == {}
    assert profile.charged(step.graph) is step.graph


def train_step(module: nn.Module, x: torch.Tensor) -> None:
    out = module(x)
    out.backward(torch.ones_like(out))


def measured_peak(cm, model: nn.Module, x: torch.Tensor) -> int:
    """The second step's peak (the first fills the host pool), resident included."""
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        peaks.append(cm.plan.graph.resident_bytes + step_peak(lambda: train_step(cm, x)))
    return peaks[1]


def floor(model: nn.Module, x: torch.Tensor, planner: str, profile: Profile) -> int:
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:
        fxpooch.compile(model, x, 1, planner=planner, profile=profile, codegen="fx")
    return e.value.min_feasible_bytes


def test_planned_peak_with_a_recomputed_scratchy_op_equals_the_measured_one(measured: Profile):
    model, x = net()
    eager = copy.deepcopy(model)
    limit = floor(model, x, "checkpoint-all", measured)
    cm = fxpooch.compile(model, x, limit, planner="checkpoint-all", profile=measured, codegen="fx")
    plan = cm.plan
    assert plan.decisions == {"detach": "recompute", "scratchy": "recompute"}
    peak = measured_peak(cm, model, x)
    assert peak == plan.timeline.static_peak_bytes == plan.peak_bytes <= limit
    # the peak is the scratchy op's recompute in the backward, with its scratch
    mem = static_memory(plan.schedule)
    at = int(mem.argmax())
    instr = plan.schedule.instrs[at]
    assert instr.kind is Kind.RECOMPUTE and op_key(plan.graph, instr.op) == scratchy_key(plan.graph)
    # without the scratch, the same plan would predict 4 MiB less there, and a peak under the measured one
    bare = dataclasses.replace(plan.schedule, op_scratch=())
    bare_mem = static_memory(bare)
    assert plan.graph.resident_bytes + bare_mem[at] == peak - SCRATCH
    assert plan.graph.resident_bytes + int(bare_mem.max()) < peak
    # the gradients do not change
    model.zero_grad(set_to_none=True)
    train_step(cm, x)
    train_step(eager, x)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_in_core_plan_charges_the_scratch_of_a_forward_op(measured: Profile):
    model, x = net()
    cm = fxpooch.compile(model, x, "1TiB", planner="in-core", profile=measured, codegen="fx")
    plan = cm.plan
    assert plan.in_core_peak_bytes == in_core_peak_bytes(plan.graph) == plan.timeline.static_peak_bytes
    (at,) = [i for i, ins in enumerate(plan.schedule.instrs)
             if ins.kind is Kind.RUN and op_key(plan.graph, ins.op) == scratchy_key(plan.graph)]
    forward = plan.graph.resident_bytes + int(static_memory(plan.schedule)[at])
    bare = dataclasses.replace(plan.schedule, op_scratch=())
    assert forward == plan.graph.resident_bytes + int(static_memory(bare)[at]) + SCRATCH
    # measured, the step peaks there too, where the compiled module also holds its snapshot of the CPU
    # RNG state (to run a step again under a new plan), which the plan does not count
    assert forward == plan.timeline.static_peak_bytes
    rng_snapshot = torch.get_rng_state().nbytes
    assert measured_peak(cm, model, x) == forward + rng_snapshot


def test_a_share_of_the_in_core_peak_counts_the_scratch(measured: Profile):
    # twice the scratch: the in-core peak is the scratchy op's, above the one the graph alone gives
    doubled = dataclasses.replace(measured, op_scratch={k: 2 * v for k, v in measured.op_scratch.items()})
    model, x = net()
    plan = fxpooch.compile(model, x, "100%", profile=doubled, codegen="fx").plan
    assert plan.in_core_peak_bytes == in_core_peak_bytes(dataclasses.replace(plan.graph, op_scratch=())) + 4 * MiB
    assert plan.mem_limit == plan.in_core_peak_bytes == plan.peak_bytes
    assert set(plan.decisions.values()) == {"keep"}


def test_profile_json_round_trip_keeps_the_scratch(measured: Profile, tmp_path):
    path = tmp_path / "p.json"
    measured.save(path)
    loaded = Profile.load(path)
    assert loaded == measured and loaded.op_scratch == measured.op_scratch != {}
    # a file saved before scratch was measured still loads, with none
    data = json.loads(path.read_text())
    del data["op_scratch"]
    old = Profile.from_json(data)
    assert old.op_scratch == {} and old.op_times == measured.op_times


def test_static_memory_and_simulate_charge_scratch_while_the_op_runs():
    # x=0, a1=1, a2=2 (1 and 2 MiB), then g2=3 (reads a2), g1=4 (reads a1 and g2), 1 MiB gradients, 1 s each
    graph, costs = chain([1, 1], [1, 1], [1, 2], [(0, 0), (0, 0)])
    graph = dataclasses.replace(graph, op_scratch=(0, 0, 5 * MiB, 0, 2 * MiB))
    keep = build_schedule(graph, [Decision.KEEP] * 2)
    assert [i.op for i in keep.instrs] == [0, 1, 2, 3, 4]
    # a1; a1 a2 + 5; a1 a2 g2; a1 g2 g1 + 2
    assert static_memory(keep).tolist() == [0, 1 * MiB, 8 * MiB, 4 * MiB, 5 * MiB]
    timeline = simulate(graph, keep, costs)
    assert timeline.peak_bytes == timeline.static_peak_bytes == 8 * MiB
    # a2 runs from 1 s to 2 s: its 2 MiB and 5 MiB of scratch at 1 s, the scratch back at 2 s
    assert (1.0, 8 * MiB) in timeline.memory and (2.0, 3 * MiB) in timeline.memory
    # recomputed a2: its scratch is charged again in the backward, where g1's is too
    recompute = build_schedule(graph, [Decision.KEEP, Decision.RECOMPUTE])
    kinds = [(i.kind, i.op) for i in recompute.instrs]
    assert kinds == [(Kind.RUN, 0), (Kind.RUN, 1), (Kind.RUN, 2), (Kind.RECOMPUTE, 2), (Kind.RUN, 3), (Kind.RUN, 4)]
    # a1 a2 + 5 (a2 freed after it); a1 a2' + 5; a1 a2' g2; a1 g2 g1 + 2
    assert static_memory(recompute).tolist() == [0, 1 * MiB, 8 * MiB, 8 * MiB, 4 * MiB, 5 * MiB]
    assert in_core_peak_bytes(graph) == 8 * MiB
    assert in_core_peak_bytes(dataclasses.replace(graph, op_scratch=())) == 4 * MiB


def test_simulate_waits_for_an_offload_before_an_ops_scratch():
    # a1 -> a2 -> a3, 1 MiB each, 1 s each; a1 swapped out over 10 s; a3 takes 2 MiB of scratch
    graph, costs = chain([1, 1, 1], [1, 1, 1], [1, 1, 1], [(10, 10), (0, 0), (0, 0)])
    graph = dataclasses.replace(graph, op_scratch=(0, 0, 0, 2 * MiB, 0, 0, 0))
    swap = build_schedule(graph, [Decision.SWAP, Decision.KEEP, Decision.KEEP])
    a3 = next(i for i, ins in enumerate(swap.instrs) if ins.kind is Kind.RUN and ins.op == 3)
    # a1 a2 a3 + 2 = 5 MiB do not fit 4 MiB: a3 starts when a1's copy is done (1 s + 10 s)
    timeline = simulate(graph, swap, costs, mem_limit=4 * MiB)
    assert timeline.start[a3] == 11.0 and timeline.peak_bytes == 4 * MiB
    # without its scratch a3 fits at once, after a2
    bare = dataclasses.replace(swap, op_scratch=())
    assert simulate(graph, bare, costs, mem_limit=4 * MiB).start[a3] == 2.0
