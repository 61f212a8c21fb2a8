"""Stage 3, scratch: device memory an op takes and frees inside itself, measured per node.

An op's scratch is the allocator's peak while it runs less the larger of the bytes allocated
before it and after it returns: its outputs stay, its scratch goes (on CPU, oneDNN's
``convolution_backward`` on NCHW tensors copies its input and gradient to blocked layouts and frees
them before it returns). The memory model charges it during every run of the op
(:attr:`fxpooch.graph.StepGraph.op_scratch`).

A :class:`ScratchMeter` marks each node's call (``with meter.node(key): out = run(node)``, its
inputs freed after the block) during one pass over the graphs: on CUDA it reads the caching
allocator's statistics around the call; on CPU the pass runs under ``torch.profiler`` with
allocator events, each call marked by a ``record_function`` range, and a node's scratch is read
from the events inside its range. Allocations outside the allocator (oneDNN or OpenMP workspaces
taken with ``malloc``) are not seen.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from . import _torch_compat as compat

log = logging.getLogger("fxpooch.profile")

#: the ``record_function`` name marking the n-th measured call on CPU
RANGE_PREFIX = "fxpooch.scratch:"


def cpu_allocator_events(events: list) -> list:
    """The CPU allocator's events among the profiler's raw ``events``, in time order (stable:
    events of the same time keep their order)."""
    mine = [e for e in events if e.name == compat.MEMORY_EVENT and e.device_type == "cpu"]
    return sorted(mine, key=lambda e: e.start_ns)


def running_peak(events: list) -> tuple[int, int]:
    """The largest running sum of the signed sizes of allocator ``events`` given in time order, and
    the sum at the end: (peak, end), bytes above what was held before the first."""
    held = peak = 0
    for e in events:
        held += e.nbytes
        peak = max(peak, held)
    return peak, held


class ScratchMeter:
    """Measures the scratch of the calls it marks; ``result()`` is the largest per key, nonzero only."""

    def __init__(self) -> None:
        self.scratch: dict[str, int] = {}

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Around the whole pass."""
        yield

    def node(self, key: str) -> contextlib.AbstractContextManager:
        """Around the call that makes node ``key``'s outputs (not the frees of its inputs)."""
        return contextlib.nullcontext()

    def record(self, key: str, nbytes: int) -> None:
        if nbytes > self.scratch.get(key, 0):
            self.scratch[key] = nbytes

    def result(self) -> dict[str, int]:
        return dict(self.scratch)


class CudaScratchMeter(ScratchMeter):
    """The caching allocator's peak statistic, reset before each call."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    @contextlib.contextmanager
    def node(self, key: str) -> Iterator[None]:  # type: ignore[override]
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        yield
        after = torch.cuda.memory_allocated(self.device)
        self.record(key, torch.cuda.max_memory_allocated(self.device) - max(before, after))


class CpuScratchMeter(ScratchMeter):
    """The profiler's allocator events inside each call's ``record_function`` range."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, str] = {}  # range name -> key, for calls that returned

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        events = compat.profiler_events(prof)
        ranges = sorted((e.start_ns, e.end_ns, self.keys[e.name]) for e in events if e.name in self.keys)
        starts = [r[0] for r in ranges]
        deltas: dict[int, list] = {}  # range index -> its allocator events
        for e in cpu_allocator_events(events):
            r = bisect.bisect_right(starts, e.start_ns) - 1
            if r >= 0 and e.start_ns <= ranges[r][1]:
                deltas.setdefault(r, []).append(e)
        for r, inside in deltas.items():
            peak, held = running_peak(inside)
            self.record(ranges[r][2], peak - max(held, 0))

    @contextlib.contextmanager
    def node(self, key: str) -> Iterator[None]:  # type: ignore[override]
        name = f"{RANGE_PREFIX}{len(self.keys)}"
        with record_function(name):
            yield
        self.keys[name] = key  # a call that raised (and is retried another way) is not counted


def measure_scratch(device: torch.device, run: Callable[[ScratchMeter], Any]) -> dict[str, int]:
    """Scratch bytes per key of the calls ``run(meter)`` marks, nonzero only; ``{}`` on a device
    neither CUDA nor CPU."""
    if device.type == "cuda":
        meter: ScratchMeter = CudaScratchMeter(device)
    elif device.type == "cpu":
        meter = CpuScratchMeter()
    else:
        return {}
    with meter.measuring():
        run(meter)
    scratch = meter.result()
    log.info("%d ops take scratch memory, %d bytes at most", len(scratch), max(scratch.values(), default=0))
    return scratch
