"""A step's memory peak from ``torch.profiler`` memory events, the same way for every method.

A ``TorchDispatchMode`` counter (tests/memcount.py) sees the tensors each ATen op returns, so it
cannot see inside an inductor kernel, which allocates its buffers itself. The profiler's memory
events come from the allocator: every allocation and free, with its size, whoever asked for it
(an eager op, an inductor kernel's buffer, autograd, a runtime copy). Summing them in time order
gives the bytes held above what was live when profiling started; its maximum is the peak.

    with profiled_memory() as mem:
        loss = step(x); loss.backward()
    print(mem.peak_bytes)              # bytes above the start, e.g. 3 * 2**20

Only the allocator's events of ``device`` are summed. What it does not see: scratch a kernel takes
from outside the allocator (oneDNN or OpenMP workspaces), the free of a block allocated before
profiling started (reported or not depending on whether the profiler, earlier in the process,
saw it allocated; start a step with nothing of the previous one alive, so no such free happens),
and, on CUDA, fragmentation (the caching allocator's reserved bytes).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

#: the name the profiler gives an allocator event (size > 0: allocated, < 0: freed)
MEMORY_EVENT = "[memory]"

_DEVICE_TYPES = {"cpu": torch.autograd.DeviceType.CPU, "cuda": torch.autograd.DeviceType.CUDA}


@dataclass
class MemoryTrace:
    """What the allocator of ``device`` did while profiled: filled when the block exits.

    ``peak_bytes``: the largest running sum of allocations minus frees (bytes held above the
    start; 0 if nothing was held). ``end_bytes``: the sum at the end (negative when more was
    freed than allocated). ``allocations``/``frees``: event counts.
    """

    device: str = "cpu"
    peak_bytes: int = 0
    end_bytes: int = 0
    allocations: int = 0
    frees: int = 0
    deltas: list[int] = field(default_factory=list, repr=False)

    def add(self, deltas: Iterable[int]) -> None:
        """Accumulate signed allocator events, in the order they happened."""
        for d in deltas:
            self.deltas.append(d)
            self.end_bytes += d
            self.peak_bytes = max(self.peak_bytes, self.end_bytes)
            self.allocations += d > 0
            self.frees += d < 0


def _allocator_deltas(prof: profile, device: str) -> list[int]:
    """Signed sizes of the allocator events of ``device``, in time order (the one place that reads
    the profiler's raw Kineto events; the public ``events()`` folds them into their ops)."""
    kind = _DEVICE_TYPES[device]
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == MEMORY_EVENT and e.device_type() == kind]
    events.sort(key=lambda e: e.start_ns())  # stable: same-timestamp events keep their order
    return [e.nbytes() for e in events]


@contextlib.contextmanager
def profiled_memory(device: str = "cpu") -> Iterator[MemoryTrace]:
    """Profile the block's memory events of ``device`` ("cpu" or "cuda"); the yielded
    :class:`MemoryTrace` is filled when the block exits."""
    if device not in _DEVICE_TYPES:
        raise ValueError(f"device={device!r}: pass one of {sorted(_DEVICE_TYPES)}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    trace = MemoryTrace(device)
    with profile(activities=activities, profile_memory=True) as prof:
        yield trace
    trace.add(_allocator_deltas(prof, device))


def step_peak(step: Callable[[], object], device: str = "cpu") -> int:
    """Peak bytes that ``step()`` allocates on ``device`` above what was in use before it."""
    with profiled_memory(device) as trace:
        step()
    return trace.peak_bytes


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
