"""Stage 2, memory model: how many device bytes a tensor's storage occupies, and the margin kept
free of the plan for the allocator's fragmentation."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: The CUDA caching allocator rounds every block up to a multiple of 512 bytes
#: (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize); torch.cuda.max_memory_allocated
#: reports those rounded block sizes.
CUDA_ALLOCATOR_ALIGNMENT = 512

#: Share of a CUDA limit kept out of the plan by default. The caching allocator serves the
#: plan's tensors from segments (2 MiB for small blocks, 20 MiB or the rounded request for large
#: ones, CUDACachingAllocator.cpp) and splits and caches blocks, so the memory it reserves
#: exceeds the bytes allocated; a per-process cap (set_per_process_memory_fraction) bounds the
#: reserved bytes. 5% is a starting figure, not a measured one: benchmarks/gpu.py records
#: reserved next to allocated peaks so it can be checked and tuned with ``margin``.
CUDA_FRAGMENTATION_SHARE = 0.05


# Size assumed for a data-dependent (unbacked) SymInt that has no hint; the same default as
# torch._inductor.config.unbacked_symint_fallback.
UNBACKED_SIZE_FALLBACK = 8192


def size_hint(value: Any) -> Any:
    """A concrete int for a SymInt (no guards added); other values unchanged.

    A traced size such as the RNG state that ``torch.utils.checkpoint`` saves for a random op
    (``run_and_save_rng_state``) is symbolic with the traced run's value as its hint. Unbacked
    (data-dependent) sizes have no hint and become ``UNBACKED_SIZE_FALLBACK``.
    """
    if isinstance(value, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes

        hint_fn = getattr(symbolic_shapes, "optimization_hint", None)  # torch >= 2.13
        if hint_fn is not None:
            return int(hint_fn(value, fallback=UNBACKED_SIZE_FALLBACK))
        hint = value.node.hint  # older torch: the backing SymNode's recorded hint
        return UNBACKED_SIZE_FALLBACK if hint is None else int(hint)
    return value


@dataclass(frozen=True)
class Margin:
    """Device bytes the plan leaves free under ``mem_limit``: ``share`` of the limit plus ``nbytes``.

    The planner plans against ``mem_limit - margin.of(mem_limit)``.
    """

    share: float = 0.0
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"Margin.share must be in [0, 1), got {self.share!r}")
        if self.nbytes < 0:
            raise ValueError(f"Margin.nbytes must be >= 0, got {self.nbytes!r}")

    @classmethod
    def default_for(cls, device: torch.device | str) -> Margin:
        """CUDA_FRAGMENTATION_SHARE on CUDA; none on CPU and meta (allocations there are exact)."""
        return cls(CUDA_FRAGMENTATION_SHARE if torch.device(device).type == "cuda" else 0.0)

    def of(self, mem_limit: int) -> int:
        """Bytes kept free under ``mem_limit``."""
        return min(mem_limit, math.ceil(self.share * mem_limit) + self.nbytes)

    def limit_for(self, planned: int) -> int:
        """The smallest ``mem_limit`` that leaves at least ``planned`` bytes to plan."""
        def enough(limit: int) -> bool:
            return limit - self.of(limit) >= planned

        limit = math.ceil((planned + self.nbytes) / (1.0 - self.share))
        while not enough(limit):
            limit += 1
        while limit > 0 and enough(limit - 1):
            limit -= 1
        return limit


@dataclass(frozen=True)
class MemoryModel:
    """Bytes as the device allocator accounts them."""

    alignment: int = 1

    @classmethod
    def for_device(cls, device: torch.device | str) -> MemoryModel:
        """CUDA's allocator rounding for "cuda" (and for "meta": planning for a GPU), exact bytes on CPU."""
        kind = torch.device(device).type
        return cls(CUDA_ALLOCATOR_ALIGNMENT if kind in ("cuda", "meta") else 1)

    def round(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        a = self.alignment
        return (nbytes + a - 1) // a * a

    def tensor_bytes(self, t: torch.Tensor) -> int:
        """Bytes of the elements a tensor spans (what a copy of it moves and allocates)."""
        return self.round(size_hint(t.numel()) * t.element_size())

    def storage_bytes(self, t: torch.Tensor) -> int:
        """Bytes of the whole storage behind ``t`` (shared by all its views)."""
        return self.round(size_hint(t.untyped_storage().nbytes()))

    def resident_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors`` (parameters, buffers, inputs)."""
        from ._torch_compat import storage_key

        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen.setdefault(storage_key(t), self.storage_bytes(t))
        return sum(seen.values())
