"""Peak memory of a step from the profiler's allocation events, seen from outside the step.

A dispatch-mode counter (``memcount.py``) sees only op outputs, and inductor's kernels write into
buffers it allocates itself; the profiler instead records every allocation and free the allocator
makes (``profile_memory=True``), whoever makes it. The running sum of those events, in the order
they happened, is the memory the block added; its maximum, plus what was resident before, is the
peak. On CPU the events are the CPU allocator's (so host copies count too, unless they come from
a pool that already holds them: measure a step after a warm-up step); on CUDA a caller should
prefer ``torch.cuda.max_memory_allocated``, which this helper reads when the step runs there.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["PeakMeter", "measure_peak"]


@dataclass
class PeakMeter:
    """What :func:`measure_peak` found: ``peak_bytes`` above the bytes in use when it started, and
    ``events`` (allocation / free sizes, in order) for whoever reads a mismatch."""

    device: torch.device
    peak_bytes: int = 0
    events: list[int] = field(default_factory=list)


def _cpu_events(prof: profile) -> list[int]:
    """Every CPU allocation (+bytes) and free (-bytes) the profiler recorded, in time order (the raw
    records: the aggregated event list folds most of them into the ops that made them)."""
    mem = [e for e in prof.profiler.kineto_results.events()
           if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    mem.sort(key=lambda e: e.start_ns())  # stable: ties keep the order they were recorded in
    return [e.nbytes() for e in mem]


@contextlib.contextmanager
def measure_peak(device: torch.device | str = "cpu") -> Iterator[PeakMeter]:
    """Measure the peak of the memory allocated on ``device`` inside the block.

    CPU: the profiler's memory events (sum in time order, maximum of the running total). CUDA:
    ``max_memory_allocated`` minus ``memory_allocated`` at the start, after resetting the peak.
    """
    device = torch.device(device)
    meter = PeakMeter(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield meter
        torch.cuda.synchronize(device)
        meter.peak_bytes = torch.cuda.max_memory_allocated(device) - start
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield meter
    meter.events = _cpu_events(prof)
    running = 0
    for nbytes in meter.events:
        running += nbytes
        meter.peak_bytes = max(meter.peak_bytes, running)


def step_peak(step: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes that ``step()`` (a forward and backward) allocates above what was in use before it."""
    with measure_peak(device) as meter:
        step()
    return meter.peak_bytes
