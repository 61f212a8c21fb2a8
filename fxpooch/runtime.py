"""Stage 7, runtime: the ``fxpooch::`` ops the rewritten graphs call, and the state they run on.

Each swapped activation copy has a slot, an int the passes assign from the schedule, and its
three ops name it: ``offload(x, slot)`` in the forward, then ``prefetch(host, device, slot)``
and ``wait(x, slot)`` in the backward, so the printed graphs show which offload feeds which
prefetch and which wait. The ops look the slot up in the :class:`Runtime` entered on the calling
thread (each compiled module enters its own around every forward and backward graph it runs;
outside one, :data:`DEFAULT`): its slot table holds the host copy and its copy events, its
:class:`HostPool` the host blocks, and its side streams the copies.

On CUDA, ``offload`` copies device -> pinned host on a D2H side stream after the producer and
``prefetch`` host -> device on an H2D side stream after the offload's event; ``wait`` makes the
compute stream wait for the prefetch's event. An offloaded buffer is freed in stream order where
the plan has its copy done: ``offload(x, slot, released=True)`` holds ``x`` until
``release(host, slot)``, placed there by the passes, makes the compute stream wait for the copy's
event and drops it, so the caching allocator hands its memory to the next compute-stream
allocation at once. (The runtime holds the very tensor it copied: a compiler may give ``offload``
a copy of the graph's value that its graph frees at once.) A prefetched buffer is read only after
its ``wait``, so it is freed in stream order after its last reader, as any other. Elsewhere (an
offload with no release: the plan allocates before any op after the copy, e.g. its own prefetch)
``record_stream`` tells the allocator that a side stream still uses a buffer, so its memory is not
reused before the copy is done; under a memory cap, such a buffer the allocator needs costs a host
synchronization. Nothing here waits on the host: ordering is by events between streams. On CPU the
same ops are plain host copies, so rewritten graphs run (and are tested) on any machine.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .hostpool import Block, HostPool

__all__ = ["DEFAULT", "Block", "HostCopy", "HostPool", "Runtime", "current"]

_lib = torch.library.Library("fxpooch", "DEF")
# A compiler may pick another layout for an activation than the traced graph has (inductor makes
# convolution outputs channels-last on CPU); the host copy, and so the prefetched tensor the backward
# was compiled for, must keep the traced layout: the compiler gives ``offload`` its input in that order.
_lib.define("offload(Tensor x, int slot, *, bool released=False) -> Tensor", tags=(torch.Tag.needs_fixed_stride_order,))
# ``host`` itself, once the compute stream has waited for the copy into it (``slot``); the device
# tensor copied (held since ``offload(..., released=True)``) then dies in stream order
_lib.define("release(Tensor(a) host, int slot) -> Tensor(a)")
_lib.define("prefetch(Tensor host, Device device, int slot) -> Tensor")
_lib.define("wait(Tensor(a) x, int slot) -> Tensor(a)")
_lib.define("drop(Tensor x) -> Tensor")
# ``x`` itself, once every tensor in ``done`` has been computed: an ordering edge for a compiler that
# computes a value only when a reader needs it (inductor); see :func:`fxpooch.codegen.compile_graph`
_lib.define("after(Tensor(a) x, Tensor[] done) -> Tensor(a)")


@dataclass(eq=False)
class HostCopy:
    """A slot's host copy: its pool block (None once returned, or for a zero-byte copy), the
    event (None: none, or on CPU) that its device-to-host copy recorded, and the device tensor
    copied, while it is held for a stream-ordered release."""

    block: Block | None
    copied: object = None
    source: torch.Tensor | None = None


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


class Runtime:
    """One compiled module's runtime state: its host pool, the slot table of host copies
    (``slots``: slot -> :class:`HostCopy`, from offload to prefetch), the prefetches' events
    (``prefetched``: slot -> CUDA event, from prefetch to wait) and device copies (``incoming``: held
    from prefetch to wait, so none is freed before the compute stream has waited for its copy) and
    its side streams.

    A host copy's block returns to the pool when its prefetch is issued, tagged with the
    prefetch's event; a host copy that dies without a prefetch (a forward whose backward never
    runs) returns its block when it is freed.
    """

    def __init__(self, pool: HostPool | None = None, stream_ordered: bool = True) -> None:
        self.pool = pool if pool is not None else HostPool()
        #: False: ``release`` waits for nothing and every offloaded and prefetched buffer is freed by
        #: ``record_stream`` (for comparison)
        self.stream_ordered = stream_ordered
        self.slots: dict[int, HostCopy] = {}
        self.prefetched: dict[int, torch.cuda.Event] = {}
        self.incoming: dict[int, torch.Tensor] = {}
        self.streams = _Streams()

    @contextlib.contextmanager
    def entered(self) -> Iterator[Runtime]:
        """The ``fxpooch::`` ops called on this thread inside the block run on this state."""
        previous = getattr(_active, "runtime", None)
        _active.runtime = self
        try:
            yield self
        finally:
            _active.runtime = previous

    # -- the ops -------------------------------------------------------------------------------
    def offload(self, x: torch.Tensor, slot: int, released: bool = False) -> torch.Tensor:
        """The host copy of ``x``, recorded in ``slot`` for its prefetch. ``released``: ``x`` is held
        until :meth:`release` frees it in stream order (else ``record_stream``)."""
        nbytes = _span_bytes(x)
        if nbytes == 0:
            self.slots[slot] = HostCopy(None)
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        block = self.pool.take(nbytes)
        host = block.view(x)
        copy = HostCopy(block)
        with self.pool.lock:
            self.slots[slot] = copy  # an earlier copy still in the slot returns its block when it is freed
        # on the storage (the block's view has one of its own), not on this tensor object: a compiled graph
        # may return another tensor object on it (a view it re-strides), and the copy lives as long as any
        weakref.finalize(host.untyped_storage(), self._dropped, slot, copy)
        if x.device.type != "cuda":
            host.copy_(x)
            return host
        stream = self.streams.get(self.streams.d2h, x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # after x's producer
        if block.after is not None:
            stream.wait_event(block.after)  # the block's previous prefetch has read it
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
            copy.copied = torch.cuda.Event()
            copy.copied.record(stream)
        if released and self.stream_ordered:
            copy.source = x
        else:
            x.record_stream(stream)
        return host

    def release(self, host: torch.Tensor, slot: int) -> torch.Tensor:
        """``host``, once the compute stream waits for the copy into it (``slot``); the device tensor
        copied is dropped, so what the compute stream allocates in its memory is ordered after the copy."""
        copy = self.slots.get(slot)
        if copy is not None and copy.source is not None:
            torch.cuda.current_stream(copy.source.device).wait_event(copy.copied)
            copy.source = None
        return host

    def prefetch(self, host: torch.Tensor, device: torch.device, slot: int) -> torch.Tensor:
        """A device copy of the host copy in ``slot`` (``host``); the slot's block goes back to the pool."""
        with self.pool.lock:
            copy = self.slots.pop(slot, None)
        if copy is not None:
            self._unhold(copy)
        if copy is None or (copy.block is not None and host.untyped_storage().data_ptr() != copy.block.data.data_ptr()):
            raise RuntimeError(
                f"fxpooch.prefetch: slot {slot} does not hold this host copy (its offload ran on another runtime "
                "state, or a later forward offloaded into the slot before this backward ran); run each forward's "
                "backward before the next forward, inside the same compiled module")
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if out.device.type != "cuda":
            out.copy_(host)
            self._release(copy, None)
            return out
        stream = self.streams.get(self.streams.h2d, out.device)
        stream.wait_stream(torch.cuda.current_stream(out.device))  # ``out`` was allocated on compute
        if copy.copied is not None:
            stream.wait_event(copy.copied)
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # Every reader of ``out`` on the compute stream comes after its wait, and so does its free: the
        # caching allocator may hand its memory to the next compute-stream allocation at once. A
        # ``record_stream`` would hold it until the H2D stream's queue (later prefetches included) has
        # run, and under a memory cap the allocator synchronizes to get it back.
        if self.stream_ordered:
            self._drop_incoming(slot)  # a prefetch whose wait never ran (a backward stopped midway)
            self.incoming[slot] = out
        else:
            out.record_stream(stream)
        self.prefetched[slot] = done
        self._release(copy, done)
        return out

    def wait(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """``x``, the prefetch of ``slot``, once the compute stream has waited for its copy."""
        done = self.prefetched.pop(slot, None)
        if done is not None and x.device.type == "cuda":
            torch.cuda.current_stream(x.device).wait_event(done)
        self.incoming.pop(slot, None)
        return x

    def _drop_incoming(self, slot: int) -> None:
        """A device copy still held (its wait did not run) is freed when the H2D stream is done with it."""
        out = self.incoming.pop(slot, None)
        if out is not None:
            out.record_stream(self.streams.get(self.streams.h2d, out.device))

    # -- host copies -------------------------------------------------------------------------
    def _unhold(self, copy: HostCopy) -> None:
        """A device tensor still held for a release that did not run is freed when its copy ends."""
        if copy.source is not None:
            copy.source.record_stream(self.streams.get(self.streams.d2h, copy.source.device))
            copy.source = None

    def _release(self, copy: HostCopy, after: object) -> None:
        with self.pool.lock:
            if copy.block is not None:
                self.pool.give_back(copy.block, after)
                copy.block = None

    def _dropped(self, slot: int, copy: HostCopy) -> None:
        """``copy``'s host tensor was freed: a copy never prefetched gives its block back."""
        with self.pool.lock:
            if self.slots.get(slot) is copy:
                del self.slots[slot]
            self._unhold(copy)
            self._release(copy, copy.copied)


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a view's first element to its last (what a copy with its strides needs)."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return extent * t.element_size()


#: the state of ops called outside any compiled module (e.g. a rewritten graph run by hand)
DEFAULT = Runtime()
_active = threading.local()


def current() -> Runtime:
    """The runtime state entered on this thread (:data:`DEFAULT` outside any)."""
    return getattr(_active, "runtime", None) or DEFAULT


def _offload(x: torch.Tensor, slot: int, released: bool = False) -> torch.Tensor:
    return current().offload(x, slot, released)


def _release(host: torch.Tensor, slot: int) -> torch.Tensor:
    return current().release(host, slot)


def _prefetch(host: torch.Tensor, device: torch.device, slot: int) -> torch.Tensor:
    return current().prefetch(host, device, slot)


def _wait(x: torch.Tensor, slot: int) -> torch.Tensor:
    return current().wait(x, slot)


def _drop(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def _after(x: torch.Tensor, done: list[torch.Tensor]) -> torch.Tensor:
    return x


_lib.impl("offload", _offload, "CPU")
_lib.impl("offload", _offload, "CUDA")
_lib.impl("prefetch", _prefetch, "CPU")
_lib.impl("release", _release, "CompositeExplicitAutograd")
_lib.impl("wait", _wait, "CompositeExplicitAutograd")
_lib.impl("drop", _drop, "CompositeExplicitAutograd")
_lib.impl("after", _after, "CompositeExplicitAutograd")


# Fake kernels: what a compiler (inductor) sees when it traces a rewritten graph with fake tensors.
# ``offload`` makes a host tensor, ``prefetch`` a device one, ``wait`` and ``after`` return their first
# input and ``release`` its host copy (aliases, as their schemas say), ``drop`` an empty tensor; all stay
# calls into this module at run time. ``register_fake`` also makes each one the op's Meta kernel (a graph
# run on meta tensors): there ``prefetch`` stays on meta. (torch 2.11 refuses a fake kernel beside a Meta one.)
@torch.library.register_fake("fxpooch::offload", lib=_lib)
def _offload_fake(x: torch.Tensor, slot: int, released: bool = False) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.register_fake("fxpooch::prefetch", lib=_lib)
def _prefetch_fake(host: torch.Tensor, device: torch.device, slot: int) -> torch.Tensor:
    on = host.device if host.device.type == "meta" else device
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=on)


@torch.library.register_fake("fxpooch::wait", lib=_lib)
def _wait_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    return x


@torch.library.register_fake("fxpooch::release", lib=_lib)
def _release_fake(host: torch.Tensor, slot: int) -> torch.Tensor:
    return host


@torch.library.register_fake("fxpooch::after", lib=_lib)
def _after_fake(x: torch.Tensor, done: list[torch.Tensor]) -> torch.Tensor:
    return x


@torch.library.register_fake("fxpooch::drop", lib=_lib)
def _drop_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)
