"""Stage 2, memory model: how many device bytes a tensor's storage occupies."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: The CUDA caching allocator rounds every block up to a multiple of 512 bytes
#: (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize); torch.cuda.max_memory_allocated
#: reports those rounded block sizes.
CUDA_ALLOCATOR_ALIGNMENT = 512


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
        return self.round(t.numel() * t.element_size())

    def storage_bytes(self, t: torch.Tensor) -> int:
        """Bytes of the whole storage behind ``t`` (shared by all its views)."""
        return self.round(t.untyped_storage().nbytes())

    def resident_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors`` (parameters, buffers, inputs)."""
        from ._torch_compat import storage_key

        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen.setdefault(storage_key(t), self.storage_bytes(t))
        return sum(seen.values())
