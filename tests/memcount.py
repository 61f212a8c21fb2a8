"""Independent measurement of the memory that a training step keeps alive.

This module deliberately shares no code with ``fxpooch``: it is the yardstick the
tests use to check fxpooch's own memory accounting and the plans it produces.

:class:`LiveStorageCounter` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.
While it is active it sees every ATen op dispatched on the calling thread (forward
*and* the autograd backward, which for CPU tensors runs on the calling thread and
inherits the mode through the engine's thread-local state). For every tensor an op
returns it looks at the tensor's untyped storage:

* a storage the counter has not seen before, which is not the storage of one of
  the op's tensor inputs, is a *new allocation*: its ``nbytes`` are added to
  ``current_bytes`` (views and in-place results alias an input, so they never
  count twice; storages that existed before the counter, e.g. parameters and
  inputs, never count at all);
* when the op is a *host op* (its name is in ``host_ops``), the new storage is
  host memory: it is remembered, so that views of it are not counted either, but
  contributes no bytes;
* zero-byte storages contribute nothing (they are remembered, so that a later op
  that grows them in place, e.g. ``resize_``, is accounted for).

Freeing is observed with a weak reference on the storage's Python object
(``torch.UntypedStorage``). PyTorch *preserves* that object: once created it stays
alive for exactly as long as the C++ ``StorageImpl`` does, even when no Python
reference remains and the storage's last owner is C++ (e.g. a tensor saved for
backward that autograd releases). The weak-reference callback therefore fires
exactly when the storage's memory is released. :func:`storage_pyobject_preserved`
checks this property at run time and the tests assert it.

What the counter cannot see (by design, documented for whoever reads a mismatch):

* scratch memory allocated *inside* an op's kernel (e.g. ``mm`` making a stride-0
  operand contiguous) -- only op outputs are visible to a dispatch mode;
* ops run on other threads that do not carry the mode (CUDA autograd device
  threads, DataLoader workers, ...);
* storage resizes that bypass the dispatcher (``tensor.untyped_storage().resize_(n)``);
  call :meth:`LiveStorageCounter.refresh` after such a resize to resynchronise.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveStorageCounter", "resident_bytes", "storage_pyobject_preserved", "storage_key"]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage: the address of its C++ ``StorageImpl``.

    Unique among live storages and identical for every tensor (view) sharing a
    storage. ``None`` for tensors without a storage (sparse, nested, ...).
    """
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # e.g. some wrapper subclasses
        return None


def storage_pyobject_preserved() -> bool:
    """Whether a storage's Python object lives exactly as long as the storage.

    Checks the two properties :class:`LiveStorageCounter` relies on: (1) dropping
    every Python reference to a storage object while a tensor still uses the
    storage does *not* kill the object (a weak reference to it stays alive), and
    (2) the weak reference dies as soon as the last tensor using it is freed.
    """
    t = torch.empty(4)
    ref = weakref.ref(t.untyped_storage())  # the temporary storage object is dropped here
    survived_python_release = ref() is not None
    same_object = ref() is t.untyped_storage()
    del t
    return survived_python_release and same_object and ref() is None


@dataclass
class _Entry:
    """Bookkeeping for one storage created while the counter was active."""

    ref: weakref.ref  # weak reference to the storage's Python object; its callback frees
    nbytes: int  # bytes currently accounted for this storage (0 for host storages)
    counted: bool  # False for outputs of host ops
    op: str  # name of the op that created it (for debugging)


def _op_names(func: Any) -> frozenset[str]:
    """Spellings under which ``func`` may appear in ``host_ops``.

    For ``torch.ops.fxpooch.offload.default`` these are ``"fxpooch::offload"``,
    ``"fxpooch::offload.default"``, ``"fxpooch.offload.default"`` and
    ``"fxpooch.offload"``.
    """
    names = {str(func)}
    schema = getattr(func, "_schema", None)
    if schema is not None:
        names.add(schema.name)
        overload = schema.overload_name or "default"
        names.add(f"{schema.name}.{overload}")
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        names.add(str(packet))
    return frozenset(names)


def _on_storage_freed(counter_ref: weakref.ref, key: int, _dead: weakref.ref) -> None:
    """Weak-reference callback: the storage identified by ``key`` was freed."""
    counter = counter_ref()
    if counter is not None:
        counter._release(key, _dead)


class LiveStorageCounter(TorchDispatchMode):
    """Counts bytes of live storages created by ops while the mode is active.

    Args:
        host_ops: names of ops whose outputs live in host memory and must not be
            counted, e.g. ``{"fxpooch::offload"}`` (any of ``"ns::op"``,
            ``"ns::op.overload"``, ``"ns.op.overload"`` or ``"ns.op"`` matches).
        record_events: keep a list of ``(op_name, current_bytes)`` after every
            op that allocated, in :attr:`events` (off by default: it grows).

    Attributes:
        current_bytes: bytes of counted storages created while active and still alive.
        peak_bytes: maximum of ``current_bytes`` seen right after an op returned.
        peak_op: name of the op whose output set the peak (``None`` before any).
        allocated_bytes: total bytes ever counted (cumulative, never decreases).
        num_allocations: number of counted storages created.
        num_ops: number of ops seen.
        events: ``[(op_name, current_bytes), ...]`` when ``record_events``.

    The mode may be entered several times; counts accumulate until :meth:`reset`.
    Storages keep being tracked after the mode exits: ``current_bytes`` drops when
    they are freed later.
    """

    #: higher-order operators (the RNG-state ops torch.utils.checkpoint puts around a random op)
    #: come to ``__torch_dispatch__`` too and run as one op: their outputs are counted, what they
    #: allocate and free inside is not seen
    supports_higher_order_operators = True

    def __init__(self, host_ops: Iterable[str] = (), *, record_events: bool = False) -> None:
        super().__init__()
        self.host_ops: frozenset[str] = frozenset(host_ops)
        self.record_events = record_events
        # RLock: a weak-reference callback may fire on this thread while we hold the
        # lock (a decref inside our own bookkeeping can free a tracked storage).
        self._lock = threading.RLock()
        self._live: dict[int, _Entry] = {}
        self._self_ref = weakref.ref(self)
        self._host_cache: dict[Any, bool] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_op: str | None = None
        self.allocated_bytes = 0
        self.num_allocations = 0
        self.num_ops = 0
        self.events: list[tuple[str, int]] = []

    # ------------------------------------------------------------------ public API
    def reset(self) -> None:
        """Forget every tracked storage and zero all counters."""
        with self._lock:
            self._live.clear()
            self.current_bytes = 0
            self.peak_bytes = 0
            self.peak_op = None
            self.allocated_bytes = 0
            self.num_allocations = 0
            self.num_ops = 0
            self.events = []

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` to ``current_bytes`` (start a new peak window)."""
        with self._lock:
            self.peak_bytes = self.current_bytes
            self.peak_op = None

    def refresh(self) -> int:
        """Re-read the size of every tracked storage; return ``current_bytes``.

        Needed only after resizes that bypass the dispatcher
        (``untyped_storage().resize_``). Raises the peak if the total grew.
        """
        with self._lock:
            for entry in list(self._live.values()):
                storage = entry.ref()
                if storage is not None and entry.counted:
                    self._set_size(entry, storage.nbytes(), "refresh")
            return self.current_bytes

    @property
    def live_storages(self) -> int:
        """Number of tracked, still-alive storages (counted or not)."""
        with self._lock:
            return len(self._live)

    # ------------------------------------------------------------- dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._observe(func, args, kwargs, out)
        return out

    # ------------------------------------------------------------ implementation
    def _is_host(self, func: Any) -> bool:
        hit = self._host_cache.get(func)
        if hit is None:
            hit = bool(_op_names(func) & self.host_ops)
            self._host_cache[func] = hit
        return hit

    def _observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        with self._lock:
            self.num_ops += 1
        if not outputs:
            return
        name = str(func)
        host = self._is_host(func)
        input_keys: set[int] | None = None  # computed lazily: most outputs are new
        allocated = False
        for t in outputs:
            key = storage_key(t)
            if key is None:
                continue
            storage = t.untyped_storage()
            with self._lock:
                entry = self._live.get(key)
                if entry is not None:
                    # Seen before: an in-place op or a view. It may have grown (resize_).
                    if entry.counted:
                        allocated |= self._set_size(entry, storage.nbytes(), name)
                    continue
            if input_keys is None:
                input_keys = {
                    k for k in (storage_key(x) for x in tree_leaves((args, kwargs))
                                if isinstance(x, torch.Tensor)) if k is not None
                }
            if key in input_keys:
                continue  # aliases a storage that predates the counter (or a host one)
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, functools.partial(_on_storage_freed, self._self_ref, key))
            with self._lock:
                entry = _Entry(ref=ref, nbytes=0, counted=not host, op=name)
                self._live[key] = entry
                if entry.counted and nbytes:
                    self.num_allocations += 1
                    allocated |= self._set_size(entry, nbytes, name)
        if allocated and self.record_events:
            with self._lock:
                self.events.append((name, self.current_bytes))

    def _set_size(self, entry: _Entry, nbytes: int, op: str) -> bool:
        """Account ``entry`` at ``nbytes``; return whether it grew. Caller holds the lock."""
        delta = nbytes - entry.nbytes
        if delta == 0:
            return False
        entry.nbytes = nbytes
        self.current_bytes += delta
        if delta > 0:
            self.allocated_bytes += delta
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
                self.peak_op = op
        return delta > 0

    def _release(self, key: int, dead_ref: weakref.ref) -> None:
        """A tracked storage died: stop accounting it."""
        with self._lock:
            entry = self._live.get(key)
            # After reset() the key may have been re-used by a new storage: only drop
            # the entry whose weak reference this callback belongs to.
            if entry is None or entry.ref is not dead_ref:
                return
            del self._live[key]
            self.current_bytes -= entry.nbytes


def resident_bytes(*objs: Any) -> int:
    """Bytes of the unique storages behind ``objs``.

    Each argument may be a tensor (its ``.grad`` is included when it is a leaf
    with one), an ``nn.Module`` (all parameters, their existing ``.grad`` and all
    buffers, recursively), ``None`` (ignored) or a list/tuple/set/dict (values) of
    those. Tensors sharing a storage are counted once. Meta tensors count their
    nominal storage size.
    """
    seen: dict[int, int] = {}

    def add_tensor(t: torch.Tensor | None) -> None:
        if t is None:
            return
        key = storage_key(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()

    def visit(obj: Any) -> None:
        if obj is None:
            return
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                add_tensor(p)
                add_tensor(p.grad)
            for b in obj.buffers():
                add_tensor(b)
        elif isinstance(obj, torch.Tensor):
            add_tensor(obj)
            if obj.is_leaf:  # .grad of a non-leaf is always None (and warns)
                add_tensor(obj.grad)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                visit(v)
        else:
            raise TypeError(f"resident_bytes: cannot measure {type(obj).__name__}; "
                            "pass tensors, modules or containers of them")

    for o in objs:
        visit(o)
    return sum(seen.values())
