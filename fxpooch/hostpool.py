"""Stage 7, runtime: the bounded pool of host blocks that hold the host copies of swapped activations."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from . import _torch_compat as compat
from .errors import HostPoolExhausted
from .limits import host_available_bytes
from .units import format_bytes

log = logging.getLogger("fxpooch.runtime")


@dataclass(eq=False)
class Block:
    """One host block: ``data`` (uint8, pinned on CUDA machines) and ``after``, the CUDA event
    (None: none) recorded by the last copy that read it; its next writer waits for that event."""

    data: torch.Tensor = field(repr=False)
    after: object = None

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor on this block with ``like``'s shape, strides and dtype, on a storage of its own that
        borrows the block's memory: the storage dies when the copy's last view does (whatever tensor
        objects a compiled graph made of it), while the block stays the pool's."""
        storage = compat.borrowed_storage(self.data)
        return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape, like.stride())


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
    free: dict[int, list[Block]] = field(default_factory=dict)  # size -> free blocks of that size
    in_use: set[Block] = field(default_factory=set)
    total_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def take(self, nbytes: int) -> Block:
        """A block of ``nbytes`` (> 0): a free one whose last reader is done if there is one, else
        any free one (its ``after`` event says what to wait for), else a new one."""
        with self.lock:
            blocks = self.free.get(nbytes)
            if blocks:
                done = next((i for i, b in enumerate(blocks) if b.after is None or b.after.query()), 0)
                block = blocks.pop(done)
            else:
                self._make_room(nbytes)
                block = Block(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))
                self.total_bytes += nbytes
            self.in_use.add(block)
            return block

    def give_back(self, block: Block, after: object = None) -> None:
        """Return ``block``; its next user must wait for ``after`` (a CUDA event, or None)."""
        with self.lock:
            self.in_use.remove(block)
            block.after = after
            self.free.setdefault(block.nbytes, []).append(block)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory held (0 without CUDA: the blocks are ordinary host memory)."""
        return self.total_bytes if self.pin else 0

    @property
    def in_use_bytes(self) -> int:
        with self.lock:
            return sum(block.nbytes for block in self.in_use)

    def check_plan(self, host_bytes: int) -> bool:
        """Warn (and return False) when a plan's host copies, ``host_bytes`` per step, exceed the bound."""
        if self.limit_bytes is None or host_bytes <= self.limit_bytes:
            return True
        log.warning("the plan swaps %s to host memory per step but the host pool may hold %s (host_pool_limit; by "
                    "default the host memory available when compiling): the step will raise HostPoolExhausted. Add "
                    "host memory, raise host_pool_limit, or give the plan more device memory", format_bytes(host_bytes),
                    format_bytes(self.limit_bytes))
        return False

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
