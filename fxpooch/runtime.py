"""Stage 7, runtime: the ``fxpooch::`` ops the rewritten graphs call.

On CUDA, ``offload`` copies device -> pinned host on a D2H side stream and ``prefetch`` host ->
device on an H2D side stream; events order them after their producers and ``wait`` makes the
compute stream wait for a prefetch. ``record_stream`` tells the caching allocator that a side
stream still uses a buffer, so its memory is not reused before the copy is done. Nothing here
waits on the host: ordering is by events between streams. Host buffers come from a
:class:`HostPool` (each compiled module has its own, see :func:`using_pool`) reused across
steps. On CPU the same ops are plain host copies, so rewritten graphs run (and are tested) on
any machine.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import HostPoolExhausted
from .limits import host_available_bytes
from .units import format_bytes

log = logging.getLogger("fxpooch.runtime")

_lib = torch.library.Library("fxpooch", "DEF")
_lib.define("offload(Tensor x) -> Tensor")
_lib.define("prefetch(Tensor host, Device device) -> Tensor")
_lib.define("wait(Tensor(a) x) -> Tensor(a)")
_lib.define("drop(Tensor x) -> Tensor")


@dataclass
class HostPool:
    """Host blocks (pinned on CUDA machines) for the host copies of swapped activations, reused
    across steps and bounded by ``limit_bytes`` (by default the host memory available when the
    pool is made; None: no bound).

    A block returns to the pool when its prefetch is issued, tagged with that copy's CUDA event
    (or when the host copy is dropped without one: a forward whose backward never runs). A block
    handed out again still carries the event, and the next device-to-host copy into it waits for
    that event on the copy stream: reuse never waits on the host. A new block that would take
    the pool past ``limit_bytes`` first releases free blocks of other sizes (another input
    shape's plan); if the blocks in use still leave no room, :class:`HostPoolExhausted`.
    """

    limit_bytes: int | None = field(default_factory=host_available_bytes)
    pin: bool = field(default_factory=torch.cuda.is_available)
    free: dict[int, list[tuple[torch.Tensor, object]]] = field(default_factory=dict)  # size -> (block, event)
    in_use: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # data_ptr -> (token, block)
    total_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _tokens: itertools.count = field(default_factory=itertools.count, repr=False)

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, object]:
        """An uninitialised host tensor with ``like``'s shape, strides and dtype, and the event
        (None: none) that the last reader of its block recorded."""
        nbytes = _span_bytes(like)
        if nbytes == 0:
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype), None
        with self.lock:
            blocks = self.free.get(nbytes)
            if blocks:
                done = next((i for i, (_, e) in enumerate(blocks) if e is None or e.query()), 0)
                block, after = blocks.pop(done)
            else:
                self._make_room(nbytes)
                block, after = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None
                self.total_bytes += nbytes
            token = next(self._tokens)
            self.in_use[block.data_ptr()] = (token, block)
        host = torch.empty(0, dtype=like.dtype).set_(block.untyped_storage(), 0, like.shape, like.stride())
        weakref.finalize(host, self._dropped, block.data_ptr(), token)
        return host, after

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory held (0 without CUDA: the blocks are ordinary host memory)."""
        return self.total_bytes if self.pin else 0

    def check_plan(self, host_bytes: int) -> bool:
        """Warn (and return False) when a plan's host copies, ``host_bytes`` per step, exceed the bound."""
        if self.limit_bytes is None or host_bytes <= self.limit_bytes:
            return True
        log.warning("the plan swaps %s to host memory per step but the host pool may hold %s (host_pool_limit; by "
                    "default the host memory available when compiling): the step will raise HostPoolExhausted. Add "
                    "host memory, raise host_pool_limit, or give the plan more device memory", format_bytes(host_bytes),
                    format_bytes(self.limit_bytes))
        return False

    @property
    def in_use_bytes(self) -> int:
        with self.lock:
            return sum(block.numel() for _, block in self.in_use.values())

    def _make_room(self, nbytes: int) -> None:
        if self.limit_bytes is None or self.total_bytes + nbytes <= self.limit_bytes:
            return
        for size in list(self.free):  # no free block has ``nbytes``: all are of other sizes
            blocks = self.free[size]
            while blocks and self.total_bytes + nbytes > self.limit_bytes:
                blocks.pop()  # a copy still reading it keeps it alive in torch's pinned cache
                self.total_bytes -= size
            if not blocks:
                del self.free[size]
        if self.total_bytes + nbytes > self.limit_bytes:
            raise HostPoolExhausted(self.limit_bytes, self.in_use_bytes, nbytes)

    def give_back(self, host: torch.Tensor, after: object = None) -> None:
        """Return ``host``'s block; its next user must wait for ``after`` (a CUDA event, or None)."""
        self._release(host.untyped_storage().data_ptr(), None, after)

    def _dropped(self, ptr: int, token: int) -> None:
        with self.lock:
            entry = self.in_use.get(ptr)
            if entry is None or entry[0] != token:
                return  # given back already; the block (and its registry entry) may be another copy's now
            copy = _host_copies.pop(ptr, None)
            self._release(ptr, token, None if copy is None else copy[1])

    def _release(self, ptr: int, token: int | None, after: object) -> None:
        with self.lock:
            entry = self.in_use.get(ptr)
            if entry is None or (token is not None and entry[0] != token):
                return  # already returned (and perhaps handed out again)
            del self.in_use[ptr]
            block = entry[1]
            self.free.setdefault(block.numel(), []).append((block, after))


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


#: the pool of offloads made outside a CompiledModule call (e.g. the ops called directly)
POOL = HostPool()
_streams = _Streams()
_active = threading.local()
_host_copies: dict[int, tuple[HostPool, object]] = {}  # host data_ptr -> (its pool, D2H done or None)
_prefetched: dict[int, torch.cuda.Event] = {}  # device data_ptr -> H2D done


@contextlib.contextmanager
def using_pool(pool: HostPool) -> Iterator[None]:
    """Offloads on this thread take their host blocks from ``pool`` inside the block."""
    previous = getattr(_active, "pool", None)
    _active.pool = pool
    try:
        yield
    finally:
        _active.pool = previous


def _take(x: torch.Tensor) -> tuple[torch.Tensor, object]:
    pool = getattr(_active, "pool", None) or POOL
    host, after = pool.take(x)
    if _span_bytes(x):  # zero-byte copies are not pool blocks
        _host_copies[host.data_ptr()] = (pool, None)
    return host, after


def _offload_cpu(x: torch.Tensor) -> torch.Tensor:
    host, _ = _take(x)
    host.copy_(x)
    return host


def _offload_cuda(x: torch.Tensor) -> torch.Tensor:
    host, block_free = _take(x)
    stream = _streams.get(_streams.d2h, x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    if block_free is not None:
        stream.wait_event(block_free)  # the block's previous prefetch has read it
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)
    if host.data_ptr() in _host_copies:
        _host_copies[host.data_ptr()] = (_host_copies[host.data_ptr()][0], done)
    return host


def _prefetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    copy = _host_copies.pop(host.data_ptr(), None)
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    if device.type != "cuda":
        out.copy_(host)
        if copy is not None:
            copy[0].give_back(host)
        return out
    stream = _streams.get(_streams.h2d, out.device)
    stream.wait_stream(torch.cuda.current_stream(out.device))  # ``out`` was allocated on compute
    if copy is not None and copy[1] is not None:
        stream.wait_event(copy[1])
    with torch.cuda.stream(stream):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    out.record_stream(stream)
    _prefetched[out.data_ptr()] = done
    if copy is not None:
        copy[0].give_back(host, after=done)
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
