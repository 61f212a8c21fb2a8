"""Stage 7, runtime: the ``fxpooch::`` ops the rewritten graphs call.

On CUDA, ``offload`` copies device -> pinned host on a D2H side stream and ``prefetch`` host ->
device on an H2D side stream; events order them after their producers and ``wait`` makes the
compute stream wait for a prefetch. ``record_stream`` tells the caching allocator that a side
stream still uses a buffer, so its memory is not reused before the copy is done. Host buffers
come from a :class:`HostPool` reused across steps. On CPU the same ops are plain host copies,
so rewritten graphs run (and are tested) on any machine.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

log = logging.getLogger("fxpooch.runtime")

_lib = torch.library.Library("fxpooch", "DEF")
_lib.define("offload(Tensor x) -> Tensor")
_lib.define("prefetch(Tensor host, Device device) -> Tensor")
_lib.define("wait(Tensor(a) x) -> Tensor(a)")
_lib.define("drop(Tensor x) -> Tensor")


@dataclass
class HostPool:
    """Host (pinned, on CUDA machines) buffers by byte size, reused once their copies are done.

    A block goes back to the pool when its prefetch is done, or when the host copy is dropped
    without one (a forward whose backward never runs); returning twice is harmless.
    """

    pin: bool = field(default_factory=torch.cuda.is_available)
    free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pending: list[tuple[torch.Tensor, object]] = field(default_factory=list)  # (block, event or None)
    in_use: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # data_ptr -> (token, block)
    total_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _tokens: itertools.count = field(default_factory=itertools.count, repr=False)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor with ``like``'s shape, strides and dtype."""
        nbytes = _span_bytes(like)
        if nbytes == 0:
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
        with self.lock:
            self._collect()
            blocks = self.free.get(nbytes)
            if blocks:
                block = blocks.pop()
            else:
                block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
                self.total_bytes += nbytes
            token = next(self._tokens)
            self.in_use[block.data_ptr()] = (token, block)
        host = torch.empty(0, dtype=like.dtype).set_(block.untyped_storage(), 0, like.shape, like.stride())
        weakref.finalize(host, self._dropped, block.data_ptr(), token)
        return host

    def give_back(self, host: torch.Tensor, after: object = None) -> None:
        """Return ``host``'s block once ``after`` (a CUDA event, or None: now) has completed."""
        self._release(host.untyped_storage().data_ptr(), None, after)

    def _dropped(self, ptr: int, token: int) -> None:
        self._release(ptr, token, _offloaded.pop(ptr, None))

    def _release(self, ptr: int, token: int | None, after: object) -> None:
        with self.lock:
            entry = self.in_use.get(ptr)
            if entry is None or (token is not None and entry[0] != token):
                return  # already returned (and perhaps handed out again)
            del self.in_use[ptr]
            self.pending.append((entry[1], after))
            self._collect()

    def _collect(self) -> None:
        still = []
        for block, event in self.pending:
            if event is None or event.query():
                self.free.setdefault(block.numel(), []).append(block)
            else:
                still.append((block, event))
        self.pending = still


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a view's first element to its last (what a copy with its strides needs)."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return extent * t.element_size()


class _Streams:
    """Per-device side streams, created on first use."""

    def __init__(self) -> None:
        self.d2h: dict[int, torch.cuda.Stream] = {}
        self.h2d: dict[int, torch.cuda.Stream] = {}

    def get(self, table: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in table:
            table[idx] = torch.cuda.Stream(device=idx)
        return table[idx]


POOL = HostPool()
_streams = _Streams()
_offloaded: dict[int, torch.cuda.Event] = {}  # host data_ptr -> D2H done
_prefetched: dict[int, torch.cuda.Event] = {}  # device data_ptr -> H2D done


def _offload_cpu(x: torch.Tensor) -> torch.Tensor:
    host = POOL.take(x)
    host.copy_(x)
    return host


def _offload_cuda(x: torch.Tensor) -> torch.Tensor:
    host = POOL.take(x)
    stream = _streams.get(_streams.d2h, x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)
    _offloaded[host.data_ptr()] = done
    return host


def _prefetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        out.copy_(host)
        POOL.give_back(host)
        return out
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    stream = _streams.get(_streams.h2d, out.device)
    offloaded = _offloaded.pop(host.data_ptr(), None)
    stream.wait_stream(torch.cuda.current_stream(out.device))  # ``out`` was allocated on compute
    if offloaded is not None:
        stream.wait_event(offloaded)
    with torch.cuda.stream(stream):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    out.record_stream(stream)
    _prefetched[out.data_ptr()] = done
    POOL.give_back(host, after=done)
    return out


def _wait(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        done = _prefetched.pop(x.data_ptr(), None)
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)
    return x


def _drop(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


_lib.impl("offload", _offload_cpu, "CPU")
_lib.impl("offload", _offload_cuda, "CUDA")
_lib.impl("prefetch", _prefetch, "CPU")
_lib.impl("wait", _wait, "CompositeExplicitAutograd")
_lib.impl("drop", _drop, "CompositeExplicitAutograd")
_lib.impl("offload", lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu"), "Meta")


def _prefetch_meta(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="meta")


_lib.impl("prefetch", _prefetch_meta, "Meta")
