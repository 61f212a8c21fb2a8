"""Compiling a step that does not fit: memory-frugal capture, per-node profiling, the allocator
margin and the bounded host pool (CPU; tests/test_cuda.py checks the same on a GPU)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxpooch
from fxpooch import _torch_compat as compat
from fxpooch import pipeline, runtime
from fxpooch.capture import FrugalForward, Recorder, capture_step
from fxpooch.errors import HostPoolExhausted
from fxpooch.memory import Margin
from fxpooch.timing import ProfileOptions, measure_profile
from fxpooch.simulator import in_core_peak_bytes
from measure import HOST_OPS, counting_graphs, measured_step_peak
from memcount import LiveStorageCounter
from zoo import MiB, mlp

#: the source label of a measured CPU profile: the thread clock with one intra-op thread
CPU_TIMER = "cpu-thread-time" if ProfileOptions().thread_clock() else "cpu-timer"

ANALYTIC = dict(profile="analytic", hardware="cpu")


def deep_mlp(layers: int = 8, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """``layers`` x (Linear(512, 512), ReLU) on a (2048, 512) input: every activation 4 MiB."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(512, 512), nn.ReLU())])
        x = torch.randn(2048, 512)
    return model, x


class Lookup(nn.Module):
    """Embedding, gather and a cross-entropy: integer inputs that must stay in range."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 256)
        self.proj = nn.Linear(256, 4096)

    def forward(self, ids):
        logits = self.proj(torch.tanh(self.emb(ids)))
        picked = logits.gather(-1, ids.unsqueeze(-1))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + picked.mean()


def lookup() -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Lookup(), torch.randint(4000, 4096, (8, 64))  # ids far from 0: zeros would differ


# -- capture -------------------------------------------------------------------------------------
def test_capture_does_not_hold_the_activations():
    model, x = deep_mlp()
    in_core = fxpooch.compile(model, x, "1TiB", planner="in-core", **ANALYTIC)
    step_bytes = measured_step_peak(in_core, (x,), resident=0)
    model.zero_grad(set_to_none=True)

    recorder = Recorder()
    counter = LiveStorageCounter(host_ops=HOST_OPS)
    with counting_graphs(counter) as ran, compat.dynamo_limits():
        pairs, _ = capture_step(pipeline.compile_entry(model, recorder), recorder, model, (x,), {})
    assert ran == ["forward0"]
    # the forward's largest few live values (4 MiB each), not its 16 saved activations
    assert counter.peak_bytes <= 3 * 4 * MiB, counter.peak_bytes
    assert counter.peak_bytes * 4 <= step_bytes, (counter.peak_bytes, step_bytes)
    assert all(isinstance(p.run_forward, torch.fx.GraphModule) for p in pairs)  # nothing stays bound
    assert all(p.grad is None for p in model.parameters())


def test_frugal_forward_returns_real_user_outputs_and_zero_byte_stand_ins():
    model, x = deep_mlp(layers=2)
    recorder = Recorder()
    with compat.dynamo_limits():
        (pair,), (args,) = capture_step(pipeline.compile_entry(model, recorder), recorder, model, (x,), {})
    with torch.no_grad():
        outs = FrugalForward(pair)(list(args))
        real = pair.forward(*args)
    n = pair.num_user_outputs
    for got, want in zip(outs[:n], real[:n]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for node, got, want in zip(pair.forward.graph.output_node().args[0][n:], outs[n:], real[n:]):
        assert got.shape == want.shape and got.dtype == want.dtype
        if node.op != "placeholder":
            assert got.untyped_storage().nbytes() == got.element_size(), node.name


@pytest.mark.parametrize("limit", ["floor", "middle"])
def test_compiled_deep_mlp_matches_eager(limit):
    model, x = deep_mlp()
    eager = copy.deepcopy(model)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.compile(model, x, 1, **ANALYTIC)
    floor = info.value.min_feasible_bytes
    in_core = in_core_peak_bytes(fxpooch.compile(model, x, "1TiB", **ANALYTIC)._current.graph)
    cm = fxpooch.compile(model, x, floor if limit == "floor" else (floor + in_core) // 2, **ANALYTIC)
    for _ in range(2):
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        cm(x).sum().backward()
        eager(x).sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# -- profile -------------------------------------------------------------------------------------
def _footprint(node: torch.fx.Node) -> int:
    """Bytes of a node's distinct inputs and its outputs, from the traced values."""
    def nbytes(n: torch.fx.Node) -> int:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else [vals]
        return sum(v.untyped_storage().nbytes() for v in vals if isinstance(v, torch.Tensor))
    return sum(nbytes(a) for a in node.all_input_nodes) + nbytes(node)


@pytest.mark.parametrize("build", [deep_mlp, lookup])
def test_per_node_profile_times_every_op_within_one_nodes_footprint(build):
    model, x = build()
    planned = fxpooch.compile(model, x, "1TiB", **ANALYTIC)._current
    graph, table = planned.graph, planned.table
    counter = LiveStorageCounter()
    with counter:
        profile = measure_profile(graph, table, [], fxpooch.HARDWARE_PRESETS["cpu"].link, ProfileOptions("per-node"))
    assert profile.source == f"{CPU_TIMER} per-node"
    calls = [i for i, n in enumerate(table.nodes) if n.op == "call_function"]
    keys = {f"{graph.ops[i].graph}/{graph.ops[i].phase.value}/{graph.ops[i].name}" for i in calls}
    assert keys == set(profile.op_times)
    assert all(t >= 0 for t in profile.op_times.values())
    assert sum(profile.op_times.values()) > 0
    largest = max(_footprint(table.nodes[i]) for i in calls)
    assert 0 < counter.peak_bytes <= largest, (counter.peak_bytes, largest)
    assert counter.peak_bytes < in_core_peak_bytes(graph) - graph.resident_bytes


def test_measured_profile_is_per_node_when_the_step_does_not_fit():
    model, x = deep_mlp()
    fits = fxpooch.compile(model, x, "1TiB", planner="in-core", profile="measure", hardware="cpu")
    assert fits.plan.profile.source == CPU_TIMER
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.compile(model, x, 1, **ANALYTIC)
    tight = fxpooch.compile(model, x, (info.value.min_feasible_bytes + fits.plan.in_core_peak_bytes) // 2,
                            profile="measure", hardware="cpu")
    assert tight.plan.profile.source == f"{CPU_TIMER} per-node"
    assert set(tight.plan.profile.op_times) == set(fits.plan.profile.op_times)
    forced = fxpooch.compile(model, x, "1TiB", profile="measure", hardware="cpu", profile_mode="per-node")
    assert forced.plan.profile.source == f"{CPU_TIMER} per-node"
    with pytest.raises(fxpooch.InvalidProfile, match="per-node"):
        fxpooch.compile(model, x, "1TiB", profile_mode="sometimes")


# -- margin --------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads, clock, source", [
    (1, "auto", "cpu-thread-time"), (2, "auto", "cpu-timer"), (2, "thread", "cpu-thread-time"), (1, "wall", "cpu-timer")])
def test_cpu_profile_clock_is_thread_time_with_one_intra_op_thread(threads, clock, source):
    model, x = mlp()
    planned = fxpooch.compile(model, x, "1TiB", **ANALYTIC)._current
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        options = ProfileOptions("per-node", clock=clock)
        assert options.thread_clock() == (source == "cpu-thread-time")
        profile = measure_profile(planned.graph, planned.table, [], fxpooch.HARDWARE_PRESETS["cpu"].link, options)
    finally:
        torch.set_num_threads(previous)
    assert profile.source == f"{source} per-node"
    assert set(profile.op_times) == {f"{op.graph}/{op.phase.value}/{op.name}" for op, n in
                                     zip(planned.graph.ops, planned.table.nodes) if n.op == "call_function"}
    with pytest.raises(fxpooch.InvalidProfile, match="clock 'sundial'"):
        ProfileOptions(clock="sundial")


def test_repeats_are_summarised_by_their_median_on_the_thread_clock_else_their_least():
    thread, wall = ProfileOptions(clock="thread"), ProfileOptions(clock="wall")
    assert thread.summary([3.0, 1.0, 2.0]) == 2.0  # not inflated by load: the typical run
    assert wall.summary([3.0, 1.0, 2.0]) == 1.0  # load only adds: the least disturbed run
    assert thread.summary([3.0, 1.0, 2.0], on_cuda=True) == 1.0  # CUDA events: the least


def test_margin_is_planned_for_and_shown():
    model, x = mlp()
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as bare:
        fxpooch.compile(model, x, 1, **ANALYTIC)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as kept:
        fxpooch.compile(model, x, 1, margin="8MiB", **ANALYTIC)
    assert kept.value.min_feasible_bytes == bare.value.min_feasible_bytes + 8 * MiB
    assert "margin" in str(kept.value)
    limit = kept.value.min_feasible_bytes
    cm = fxpooch.compile(model, x, limit, margin="8MiB", **ANALYTIC)
    assert cm.plan.margin_bytes == 8 * MiB
    assert cm.plan.static_peak_bytes <= limit - 8 * MiB
    assert measured_step_peak(cm, (x,), cm.plan.graph.resident_bytes) <= limit - 8 * MiB
    assert "allocator margin" in str(cm.plan)
    assert fxpooch.compile(model, x, limit, **ANALYTIC).plan.margin_bytes == 0  # none by default on CPU


def test_margin_defaults_and_inverse():
    assert Margin.default_for("cpu") == Margin() == Margin.default_for("meta")
    cuda = Margin.default_for("cuda")
    assert cuda.of(2**30) == pytest.approx(0.05 * 2**30, abs=1)
    for m in (cuda, Margin(0.1, 12345), Margin(nbytes=7)):
        for planned in (1, 10**6 + 3, 3 * 2**30):
            limit = m.limit_for(planned)
            assert limit - m.of(limit) >= planned > limit - 1 - m.of(limit - 1)


# -- host pool -----------------------------------------------------------------------------------
def test_pool_reuses_blocks_across_steps_and_reports_bytes():
    model, x = mlp()
    global_before = runtime.DEFAULT.pool.total_bytes
    cm = fxpooch.compile(model, x, "1TiB", planner="swap-all", **ANALYTIC)
    assert cm.plan.counts()["swap"] > 0
    sizes = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        cm(x).sum().backward()
        sizes.append(cm.host_pool_bytes)
    assert sizes == [cm.plan.host_bytes] * 3
    assert not cm.host_pool.in_use
    assert not cm.runtime.slots
    assert runtime.DEFAULT.pool.total_bytes == global_before  # each compiled module has its own pool


def test_pool_bound_raises_a_typed_error():
    model, x = mlp()
    cm = fxpooch.compile(model, x, "1TiB", planner="swap-all", host_pool_limit=4 * MiB, **ANALYTIC)
    assert cm.plan.host_bytes > 4 * MiB
    with pytest.raises(HostPoolExhausted, match="host_pool_limit"):
        cm(x).sum().backward()


def test_pool_releases_other_sizes_before_giving_up():
    pool = runtime.HostPool(limit_bytes=3 * MiB, pin=False)
    a = pool.take(MiB)
    b = pool.take(MiB)
    pool.give_back(a)
    pool.give_back(b)
    again = pool.take(MiB)
    assert again.after is None and again in (a, b)  # reused, not new
    assert pool.total_bytes == 2 * MiB
    pool.take(2 * MiB)  # the free 1 MiB block makes room
    assert pool.total_bytes == 3 * MiB and pool.in_use_bytes == 3 * MiB
    with pytest.raises(HostPoolExhausted):
        pool.take(16)
