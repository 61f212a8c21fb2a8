"""Stage 3, link calibration: the copies that stand in for swaps, timed.

``measure_link`` times pinned host<->device copies of several sizes on a GPU, alone and next to
compute; ``measure_host_link`` the host copies a CPU run makes instead, on the thread that runs the
ops, as :func:`fxpooch.timing.measure_profile` times them.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .hardware import Link, LinkCalibration, get_link
from .timing import ProfileOptions, thread_clock, wall_clock

log = logging.getLogger("fxpooch.profile")

#: copy sizes of the link calibration: 64 KiB (latency-bound) to 64 MiB (bandwidth-bound)
LINK_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 26)
_links: dict[str, Link] = {}  # calibrated links of this process, by device


def measure_link(device: torch.device | str, sizes: Sequence[int] = LINK_SIZES, repeats: int = 5) -> Link:
    """Pinned host<->device copies of ``sizes`` timed with CUDA events on a side stream, each
    direction alone and while a memory-bound kernel runs on the compute stream; latency and
    bandwidth fitted per direction (:class:`~fxpooch.hardware.LinkCalibration`, kept in the
    link and so in a saved profile). Measured once per device in a process; needs twice the
    largest size of device memory (copy buffer and kernel operand) for a moment."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = f"cuda:{index}"
    if key not in _links:
        with torch.cuda.device(index):
            cal = _calibrate(torch.device(key), tuple(sizes), repeats)
        _links[key] = Link.calibrated(f"measured:{cal.device}", cal)
        log.info("link of %s: %s", key, _links[key])
    return _links[key]


#: copy sizes of the host link: 64 KiB to 16 MiB. Larger new tensors come from fresh pages (glibc maps
#: allocations past its threshold, 32 MiB at most, anew and the first write faults each page in), a
#: cost per byte several times the copy's that a latency + bandwidth line through both would smear
#: over every size
HOST_LINK_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)


def measure_host_link(sizes: Sequence[int] = HOST_LINK_SIZES, repeats: int = 5,
                      options: ProfileOptions = ProfileOptions()) -> Link:
    """The copies a CPU run makes in place of swaps, timed on this thread as :func:`measure_profile`
    times the ops (``options``' clock and summary of ``repeats`` after a warm-up): an offload into a
    reused host block, a prefetch into a new tensor (its allocation included), each repeat on other
    memory than the last (an activation copied in a step was written long before, not just now: out
    of cache). They run on the compute thread (``on_compute_stream``), so nothing overlaps them.
    Measured once per process and clock."""
    clock = thread_clock if options.thread_clock() else wall_clock
    key = f"cpu {clock.__name__}"
    if key not in _links:
        sizes, span = tuple(sizes), max(sizes)
        src = torch.ones((repeats + 1) * span, dtype=torch.uint8)  # repeat r copies from [r * span, ...)
        block = torch.ones_like(src)

        def timed(copy: Callable[[int, int], Any]) -> tuple[float, ...]:
            per_size = []
            for size in sizes:
                times = []
                for r in range(repeats + 1):  # the first run warms up
                    stop = clock()
                    out = copy(r * span, size)
                    elapsed = stop()
                    del out
                    if r:
                        times.append(elapsed)
                per_size.append(options.summary(times))
            return tuple(per_size)

        d2h = timed(lambda at, n: block[at:at + n].copy_(src[at:at + n]))
        h2d = timed(lambda at, n: torch.empty(n, dtype=torch.uint8).copy_(block[at:at + n]))
        _links[key] = host_link(LinkCalibration("cpu", sizes, d2h, h2d, d2h, h2d))
        log.info("host copies: %s", _links[key])
    return _links[key]


def host_link(calibration: LinkCalibration) -> Link:
    """The link fitted to timed host copies, or, where their times do not grow with size (on a busy
    host a copy split over intra-op threads waits a time slice for each, whatever its size), the
    "host" preset's, with a warning: a plan priced on a fit through noise would be worse than one
    priced on the preset."""
    try:
        return Link.calibrated("measured:cpu", calibration, on_compute_stream=True)
    except ValueError as e:
        preset = get_link("host")
        log.warning("host copies could not be fitted (%s); pricing swaps on the %r link preset instead. "
                    "Profile on a quieter machine, with torch.set_num_threads(1), or pass link=", e, preset.name)
        return preset


def _calibrate(device: torch.device, sizes: tuple[int, ...], repeats: int) -> LinkCalibration:
    n = max(sizes)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)

    def enqueue(to_host: bool) -> list[list[tuple[torch.cuda.Event, torch.cuda.Event]]]:
        per_size = []
        with torch.cuda.stream(side):
            for size in sizes:
                src, dst = (dev[:size], host[:size]) if to_host else (host[:size], dev[:size])
                dst.copy_(src, non_blocking=True)  # warm-up
                pairs = []
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(side)
                    dst.copy_(src, non_blocking=True)
                    end.record(side)
                    pairs.append((start, end))
                per_size.append(pairs)
        return per_size

    def seconds(per_size: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]]) -> tuple[float, ...]:
        return tuple(statistics.median(s.elapsed_time(e) / 1e3 for s, e in pairs) for pairs in per_size)

    side.wait_stream(compute)
    alone = [enqueue(True), enqueue(False)]
    side.synchronize()
    d2h, h2d = seconds(alone[0]), seconds(alone[1])
    # a memory-bound kernel (in-place scaling of the largest size) repeated to outlast every copy
    work = torch.ones(n // 4, dtype=torch.float32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    work.mul_(1.0)
    start.record(compute)
    work.mul_(1.0)
    end.record(compute)
    end.synchronize()
    per_kernel = max(start.elapsed_time(end) / 1e3, 1e-6)
    copies = (1 + repeats) * (sum(d2h) + sum(h2d))
    side.wait_stream(compute)
    begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(compute)
    for _ in range(math.ceil(2 * copies / per_kernel) + 1):
        work.mul_(1.0)
    finish.record(compute)
    concurrent = [enqueue(True), enqueue(False)]
    last = concurrent[1][-1][-1][1]
    torch.cuda.synchronize(device)
    if begin.elapsed_time(last) > begin.elapsed_time(finish):
        log.warning("link calibration: the compute kernel ended before the copies; the concurrent figures "
                    "are partly copies alone")
    return LinkCalibration(torch.cuda.get_device_name(device), sizes, d2h, h2d,
                           seconds(concurrent[0]), seconds(concurrent[1]))
