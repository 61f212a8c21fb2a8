"""fxpooch's CUDA runtime on a real GPU: side streams, events, ``record_stream``, the pinned pool
and the caching allocator's peak. Every test is skipped where ``torch.cuda.is_available()`` is
False (the CPU tests in test_correctness.py cover the same plans with host copies).

* gradients equal eager's (fp32, rtol 1e-5) while every copy is artificially delayed, so a
  missing event, ``wait_stream`` or ``record_stream`` shows up as a wrong number;
* ``torch.cuda.max_memory_allocated`` stays under the limit over a sweep of limits, never rises
  as the limit falls, and is within 5% of the planned peak;
* host memory (the pinned pool and the process RSS) is flat over 50 steps; pool blocks are reused;
* a step that does not fit under a per-process memory cap still compiles (frugal capture,
  per-node CUDA-event profile) and runs under the cap; the link calibration, the pool bound and
  the allocator margin do what they say.
"""
from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator

import pytest
import torch

import fxpooch
from fxpooch import _torch_compat as compat
from fxpooch import runtime
from fxpooch.errors import HostPoolExhausted
from fxpooch.memory import Margin
from fxpooch.calibrate import LINK_SIZES, measure_link
from zoo import ZOO

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: these tests check fxpooch's CUDA runtime (side streams, events, pinned pool, "
           "allocator peaks); the CPU path is covered by test_correctness.py")

RTOL, ATOL = 1e-5, 1e-6
SLEEP_CYCLES = 10 ** 6  # ~0.5 ms busy-wait per copy at ~2 GHz: longer than any copy of these models
HARDWARE = "h100-pcie5"  # analytic costs: the same decisions on every GPU
PEAK_TOL = 0.05
SWEEP_POINTS = 5
RSS_SLACK = 8 * 2 ** 20  # bytes the process may grow over 45 steady steps (Python's own caches)


@pytest.fixture(autouse=True)
def exact_fp32() -> Iterator[None]:
    """No TF32, deterministic cuDNN: eager and the planned graphs compute bit-comparable numbers."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


@pytest.fixture(params=["side", "compute"])
def delayed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every offload/prefetch first enqueues a busy-wait: on its side stream ("side": copies run
    late, so the compute stream must wait for them and must not reuse their buffers early), or on
    the compute stream ("compute": the producers and earlier users of a buffer finish late)."""
    real_get = runtime._Streams.get

    def get(streams: runtime._Streams, table: dict, device: torch.device) -> torch.cuda.Stream:
        stream = real_get(streams, table, device)
        with torch.cuda.stream(stream if request.param == "side" else torch.cuda.current_stream(device)):
            compat.cuda_sleep(SLEEP_CYCLES)
        return stream

    monkeypatch.setattr(runtime._Streams, "get", get)
    return request.param


def cuda_zoo(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model, x = ZOO[name]()
    return model.cuda(), x.cuda()


def device_memory() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def compile_cuda(model: torch.nn.Module, x: torch.Tensor, limit: int, planner: str = "pooch",
                 profile: str | fxpooch.Profile = "analytic", **options) -> fxpooch.CompiledModule:
    hardware = HARDWARE if isinstance(profile, str) and profile == "analytic" else None
    return fxpooch.compile(model, x, limit, planner=planner, profile=profile, hardware=hardware, **options)


def floor_and_in_core(model: torch.nn.Module, x: torch.Tensor, profile: str | fxpooch.Profile = "analytic"
                      ) -> tuple[int, int]:
    """The smallest feasible limit and the limit at which the in-core step fits (both with the
    default allocator margin)."""
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        compile_cuda(model, x, 1, profile=profile)
    in_core = compile_cuda(model, x, device_memory(), planner="in-core", profile=profile).plan.in_core_peak_bytes
    return info.value.min_feasible_bytes, Margin.default_for("cuda").limit_for(in_core)


_limits: dict[str, tuple[int, int]] = {}


def step(cm: fxpooch.CompiledModule, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward + backward(ones) from ``.grad = None`` (what the plans assume)."""
    model.zero_grad(set_to_none=True)
    out = cm(x)
    out.backward(torch.ones_like(out))
    return out.detach()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- (a) gradients under delayed copies ---------------------------------------------------------
@pytest.mark.parametrize("which", ["in_core", "middle", "floor", "swap-all"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_gradients_match_eager_with_delayed_copies(name: str, which: str, delayed: str):
    model, x = cuda_zoo(name)
    if name not in _limits:
        _limits[name] = floor_and_in_core(model, x)
    floor, in_core = _limits[name]
    limit = {"in_core": in_core, "middle": (floor + in_core) // 2, "floor": floor, "swap-all": device_memory()}[which]
    eager = copy.deepcopy(model)
    # the plans as made at these limits: compile's check would find the compiled step above its plan
    # (on an H100, mlp 8 MiB and transformer_block 7-8 MiB above: not yet explained) and name a higher
    # floor; this test is about the streams' ordering, not the peak
    cm = compile_cuda(model, x, limit, planner="swap-all" if which == "swap-all" else "pooch", peak_check_rounds=0)
    counts = cm.plan.counts()
    assert cm.plan.peak_bytes <= limit
    if which in ("middle", "floor"):
        assert counts["swap"] + counts["recompute"] > 0, counts
    if which == "swap-all":
        assert counts["swap"] > 0, counts
    for seed in range(3):  # later steps reuse the pool's host blocks and the streams
        torch.manual_seed(seed)
        out = step(cm, model, x)
        torch.manual_seed(seed)
        ref = step(eager, eager, x)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n, s=seed: f"step {s}, grad of {n} ({delayed} delay): {m}")
        for (n, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"buffer {n}: {m}")


@pytest.mark.parametrize("delayed", ["side"], indirect=True)
def test_offloaded_buffer_is_not_reused_before_its_copy(delayed: str):
    """``record_stream``: freeing the source while its (late) D2H copy is queued must not let the
    allocator hand its memory to the next tensor; the round trip then returns the original."""
    n = 1 << 22
    x = torch.randn(n, device="cuda")
    expected = x.cpu()
    host = torch.ops.fxpooch.offload(x, 0)
    del x
    torch.empty(n, device="cuda").fill_(7.0)  # takes x's block if record_stream were missing
    back = torch.ops.fxpooch.wait(torch.ops.fxpooch.prefetch(host, torch.device("cuda"), 0), 0)
    back = back * 1  # a compute-stream read, ordered by wait
    torch.testing.assert_close(back.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("delayed", ["side"], indirect=True)
def test_released_buffer_is_reused_at_once_in_stream_order(delayed: str):
    """``offload(..., released=True)`` holds the source until ``release``, which makes the compute
    stream wait for the (late) copy: the next allocation takes the source's block at once (no
    ``record_stream`` keeps it), and what the compute stream writes there comes after the copy."""
    rt = runtime.Runtime()
    torch.cuda.empty_cache()  # no cached block but the source's can serve the allocation below
    n = 1 << 22
    x = torch.randn(n, device="cuda")
    expected, ptr = x.cpu(), x.data_ptr()
    host = rt.offload(x, 0, released=True)
    del x  # the graph's last reader is done; the runtime still holds the source
    other = torch.empty(n, device="cuda")
    assert other.data_ptr() != ptr
    host = rt.release(host, 0)
    y = torch.empty(n, device="cuda")
    assert y.data_ptr() == ptr
    y.fill_(7.0)  # would overwrite the source before its late copy without release's wait
    back = rt.wait(rt.prefetch(host, torch.device("cuda"), 0), 0) * 1
    torch.testing.assert_close(back.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("delayed", ["side"], indirect=True)
def test_prefetched_buffer_is_reused_at_once_after_its_wait(delayed: str):
    """A prefetched buffer is read only after its ``wait`` (the compute stream waits for the late
    copy): once its readers are done, the next allocation takes its block at once, and the value its
    reader computed is the host copy's."""
    rt = runtime.Runtime()
    torch.cuda.empty_cache()
    n = 1 << 22
    x = torch.randn(n, device="cuda")
    expected = x.cpu()
    host = rt.offload(x, 0)  # x stays: its block is no candidate below
    back = rt.prefetch(host, torch.device("cuda"), 0)
    ptr = back.data_ptr()
    doubled = rt.wait(back, 0) * 2
    assert not rt.incoming
    del back
    y = torch.empty(n, device="cuda")
    assert y.data_ptr() == ptr
    y.fill_(7.0)
    torch.testing.assert_close(doubled.cpu(), expected * 2, rtol=0, atol=0)


def test_copies_are_queued_not_waited_for():
    """Offload and prefetch only queue their copies on the side streams: with the compute stream busy
    (which both copies wait for), each returns before its copy has run. A copy from or to pageable
    host memory would hold the host until it ends, and no compute could be queued meanwhile."""
    rt = runtime.Runtime()
    x = torch.randn(1 << 24, device="cuda")  # 64 MiB
    expected = x.cpu()
    rt.wait(rt.prefetch(rt.offload(x, 0), x.device, 0), 0)  # the pool's pinned block, made (and timed) before
    torch.cuda.synchronize()
    compat.cuda_sleep(50 * SLEEP_CYCLES)  # ~25 ms on the compute stream
    host = rt.offload(x, 0)
    offloaded = rt.slots[0].copied
    back = rt.prefetch(host, x.device, 0)
    assert not offloaded.query() and not rt.prefetched[0].query()
    back = rt.wait(back, 0) * 1
    torch.testing.assert_close(back.cpu(), expected, rtol=0, atol=0)


# -- (b) measured peaks over a sweep of limits ---------------------------------------------------
def measured_peak(cm: fxpooch.CompiledModule, model: torch.nn.Module, x: torch.Tensor,
                  plan: fxpooch.Plan | None = None) -> int:
    """``max_memory_allocated`` of one step, counted like the plan (``cm.plan`` unless given):
    resident bytes + the step's own, without what other tests or the cuBLAS workspace hold on the
    device."""
    step(cm, model, x)  # warm-up: pool blocks, cuBLAS workspaces, lazy kernels
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    outside = torch.cuda.memory_allocated() - (plan or cm.plan).graph.resident_bytes
    torch.cuda.reset_peak_memory_stats()
    step(cm, model, x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - outside


@pytest.mark.parametrize("name", ["mlp", "resnet_small", "transformer_block"])
def test_measured_peak_within_limit_and_monotone(name: str):
    model, x = cuda_zoo(name)
    profile = compile_cuda(model, x, device_memory(), profile="measure").plan.profile  # CUDA events, real link
    if keep := os.environ.get("FXPOOCH_KEEP_PROFILES"):  # a folder: the measured profile, to replay plans elsewhere
        profile.save(os.path.join(keep, f"{name}.json"))
    floor, in_core = floor_and_in_core(model, x, profile)
    limits = sorted({floor + (in_core - floor) * i // (SWEEP_POINTS - 1) for i in range(SWEEP_POINTS)}, reverse=True)
    peaks = []
    for limit in limits:
        model.zero_grad(set_to_none=True)  # a plan counts existing gradients as resident: none, as for the floor
        cm = compile_cuda(model, x, limit, profile=profile)
        peak = measured_peak(cm, model, x)
        planned = cm.plan.peak_bytes
        assert peak <= limit, f"limit {limit}: measured {peak} bytes (planned {planned}, {cm.plan.counts()})"
        assert abs(planned - peak) <= PEAK_TOL * peak, \
            f"limit {limit}: planned {planned}, static {cm.plan.static_peak_bytes}, measured {peak} bytes"
        peaks.append(peak)
    assert all(lower <= higher for higher, lower in zip(peaks, peaks[1:])), \
        f"a lower limit gave a higher peak: {list(zip(limits, peaks))}"


# -- (c, d) host memory ------------------------------------------------------------------------
def swapping_module(name: str) -> tuple[fxpooch.CompiledModule, torch.nn.Module, torch.Tensor]:
    model, x = cuda_zoo(name)
    cm = compile_cuda(model, x, device_memory(), planner="swap-all")
    assert cm.plan.counts()["swap"] > 0
    return cm, model, x


def test_host_memory_flat_over_50_steps():
    cm, model, x = swapping_module("transformer_block")
    pool_bytes, rss, pending = [], [], []
    for _ in range(50):
        step(cm, model, x)
        torch.cuda.synchronize()  # as a training loop that logs its loss does
        gc.collect()
        pool_bytes.append(cm.host_pool_bytes)
        rss.append(rss_bytes())
        pending.append((len(cm.runtime.slots), len(cm.runtime.prefetched)))
    assert set(pool_bytes) == {pool_bytes[0]}, f"pinned pool grew: {pool_bytes}"
    assert set(pending) == {pending[0]}, f"copy events accumulate: {pending}"
    assert rss[-1] - rss[4] <= RSS_SLACK, f"RSS grew {(rss[-1] - rss[4]) / 2**20:.1f} MiB over 45 steps"


def test_pinned_pool_blocks_are_reused():
    cm, model, x = swapping_module("mlp")
    pool = cm.host_pool
    assert pool.pin, "on a CUDA machine host copies must be pinned (else copies are synchronous)"
    step(cm, model, x)
    torch.cuda.synchronize()
    after_first = pool.total_bytes
    for _ in range(9):
        step(cm, model, x)
        torch.cuda.synchronize()
    assert pool.total_bytes == after_first, "step 10 allocated host blocks instead of reusing step 1's"
    blocks = [b.data for free in pool.free.values() for b in free]
    assert blocks and all(b.is_pinned() for b in blocks)
    assert pool.total_bytes <= cm.plan.host_bytes  # the plan's blocks (rounded to 512 B there), nothing more



def test_pool_bounded_at_the_plans_host_bytes_without_host_syncs():
    """Blocks are reused as soon as their prefetch is queued (the next D2H copy waits for it on
    the device), so steps back to back without a synchronize fit in the plan's host bytes."""
    model, x = cuda_zoo("transformer_block")
    eager = copy.deepcopy(model)
    probe = compile_cuda(model, x, device_memory(), planner="swap-all")
    cm = fxpooch.compile(model, x, device_memory(), planner="swap-all", profile="analytic", hardware=HARDWARE,
                         host_pool_limit=probe.plan.host_bytes)
    for seed in range(10):  # the block's dropout draws from the seed: the last step and eager's draw alike
        torch.manual_seed(seed)
        out = step(cm, model, x)
    torch.manual_seed(seed)
    ref = step(eager, eager, x)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert 0 < cm.host_pool_bytes <= probe.plan.host_bytes
    with pytest.raises(HostPoolExhausted):  # in compile's measured step, or else in the first step
        small = fxpooch.compile(model, x, device_memory(), planner="swap-all", profile="analytic", hardware=HARDWARE,
                                host_pool_limit=probe.plan.host_bytes // 2)
        step(small, model, x)


# -- (e) a step that does not fit, the link and the margin -------------------------------------
def test_step_over_a_memory_cap_compiles_and_runs_under_it():
    """Capture holds no activations and the profile is per node (CUDA events), so compiling needs
    far less than the in-core step: everything here runs under set_per_process_memory_fraction, and
    the step allocates at most the limit. The cap leaves the caching allocator 64 MiB on top for what its
    segments (2 and 20 MiB) strand at this scale (on an H100, capture under a cap of the limit failed a
    2 MiB allocation with 17 MiB of 90 reserved but unallocated; under 1.25 times the limit, with 33 MiB)."""
    model, x = cuda_zoo("transformer_block")
    eager = copy.deepcopy(model)
    floor, in_core = floor_and_in_core(model, x)
    limit = (floor + in_core) // 2
    resident = compile_cuda(model, x, device_memory(), planner="in-core").plan.graph.resident_bytes
    measure_link(torch.device("cuda"))  # its buffers (2 x 64 MiB) would not fit under this cap
    gc.collect()
    torch.cuda.empty_cache()
    outside = torch.cuda.memory_allocated() - resident
    torch.cuda.set_per_process_memory_fraction((outside + limit + 64 * 2**20) / device_memory())
    torch.cuda.reset_peak_memory_stats()
    try:
        cm = fxpooch.compile(model, x, limit, profile="measure")
        assert cm.plan.profile.source == "cuda-events per-node"
        table = cm._current.table
        assert len(cm.plan.profile.op_times) == sum(n.op == "call_function" for n in table.nodes)
        assert cm.plan.margin_bytes >= Margin.default_for("cuda").of(limit)  # more where its measured step took more
        assert cm.plan.peak_bytes <= limit - cm.plan.margin_bytes
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()  # compile's own measured steps try plans that may go over
        out = step(cm, model, x)
        assert torch.cuda.max_memory_allocated() - outside <= limit
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.manual_seed(0)
    ref = step(eager, eager, x)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_link_calibration_is_timed_per_direction_and_cached():
    link = measure_link(torch.device("cuda"))
    assert measure_link(torch.device("cuda", torch.cuda.current_device())) is link
    cal = link.calibration
    assert cal is not None and cal.sizes == LINK_SIZES
    for times in (cal.d2h, cal.h2d, cal.d2h_concurrent, cal.h2d_concurrent):
        assert all(t > 0 for t in times) and times[-1] > times[0]  # 64 MiB takes longer than 64 KiB
    for direction in ("d2h", "h2d"):
        assert cal.fit(direction).bandwidth == pytest.approx(link.directed(direction).bandwidth)
    assert link.bandwidth == min(cal.fit("d2h").bandwidth, cal.fit("h2d").bandwidth)
    model, x = cuda_zoo("mlp")
    profile = compile_cuda(model, x, device_memory(), profile="measure").plan.profile
    assert profile.link is link


# -- (f) inductor's compiled steps, measured by the allocator ---------------------------------
INDUCTOR_RTOL, INDUCTOR_ATOL = 1e-3, 1e-3  # inductor's kernels sum in other orders than eager's


def test_inductor_steps_measure_within_the_limit_on_both_paths():
    """``fxpooch.compile(..., codegen="inductor")`` checks its compiled step before returning; the
    ``torch.compile`` backend checks the caller's steps. Either way the steps after the check measure
    (``max_memory_allocated``) within the limit, with eager's gradients."""
    model, x = cuda_zoo("resnet_small")
    eager = copy.deepcopy(model)
    floor, in_core = floor_and_in_core(model, x)
    limit = (floor + in_core) // 2
    step(eager, eager, x)

    compiled_model = copy.deepcopy(model)
    cm = fxpooch.compile(compiled_model, x, limit, codegen="inductor", hardware=HARDWARE)
    assert measured_peak(cm, compiled_model, x) <= limit, cm.plan.counts()

    backend = fxpooch.backend(limit, hardware=HARDWARE)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    for _ in range(8):  # each plan's second step is measured, read as the next starts
        step(compiled, model, x)
    (check,) = backend.checks.values()
    assert check.result is not None and check.result.peak_bytes <= limit, check.measured
    assert measured_peak(compiled, model, x, backend.plan) <= limit
    for p, q, r in zip(compiled_model.parameters(), model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=INDUCTOR_RTOL, atol=INDUCTOR_ATOL)
        torch.testing.assert_close(q.grad, r.grad, rtol=INDUCTOR_RTOL, atol=INDUCTOR_ATOL)
