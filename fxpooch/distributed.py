"""Data parallel training: what a DistributedDataParallel wrapper holds per rank, and a compiled
module that runs inside one.

Two orders are supported, both built on ``torch.nn.parallel.DistributedDataParallel`` itself:

* ``DDP(fxpooch.compile(model, ...))``: the compiled module runs inside DDP's forward. The first
  time it does, it plans the step again, counting DDP's gradient buckets.
* ``fxpooch.compile(DDP(model), ...)``: the inner module is compiled and planned with DDP's
  buckets counted, and :class:`CompiledDDP` runs DDP's own forward with the compiled module in
  place of the inner one for the duration of each call (DDP's state dict and hooks are untouched).

In both, DDP's reducer hooks fire on the gradients the rewritten backward graphs produce and
all-reduce them bucket by bucket. Dynamo's split of the step at the buckets (DDPOptimizer) is
off while fxpooch runs (see ``_torch_compat.dynamo_limits``): every activation stays plannable,
and the all-reduce starts when a backward graph has produced its gradients, not in the middle
of it (no overlap within a graph).

Sharding with FSDP2's ``fully_shard`` is :mod:`fxpooch.fsdp`'s.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat
from .memory import MemoryModel


def ddp_of(model: nn.Module) -> nn.Module | None:
    """``model`` if it is a ``DistributedDataParallel`` wrapper, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def active_wrapper() -> nn.Module | None:
    """The DDP wrapper whose forward is running on this thread (a compiled module runs inside it), or None."""
    return compat.active_ddp_module()


def held_bytes(wrapper: nn.Module | None, device: torch.device) -> int:
    """Device bytes ``wrapper`` holds through the step beyond its module: DDP's gradient buckets,
    one flat copy of every parameter it reduces (allocated when DDP is built, alive with it).

    Counted per parameter at the allocator's rounding, which can only over-count the few larger
    bucket tensors. With ``gradient_as_bucket_view=True`` the gradients are views of the buckets
    once reduced, so counting both is an upper bound.
    """
    if wrapper is None:
        return 0
    memory = MemoryModel.for_device(device)
    ignored = set(getattr(wrapper, "parameters_to_ignore", ()))
    return sum(memory.tensor_bytes(p) for name, p in wrapper.module.named_parameters()
               if p.requires_grad and name not in ignored)


@contextlib.contextmanager
def _module_swapped(wrapper: nn.Module, module: nn.Module) -> Iterator[None]:
    inner = wrapper.module
    wrapper.module = module
    try:
        yield
    finally:
        wrapper.module = inner


class CompiledDDP(nn.Module):
    """``fxpooch.compile(DDP(model), ...)``: runs DDP's forward (buffer broadcast, reducer set-up)
    with the compiled inner module in place of ``model`` during each call.

    ``model`` is the DDP wrapper as passed (its state dict is unchanged); ``compiled`` the
    :class:`~fxpooch.api.CompiledModule` of its inner module, whose plan counts DDP's buckets.
    """

    def __init__(self, wrapper: nn.Module, compiled: nn.Module):
        super().__init__()
        self.model = wrapper
        object.__setattr__(self, "compiled", compiled)  # not a submodule: its parameters are the wrapper's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _module_swapped(self.model, self.compiled):
            return self.model(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync``: gradients accumulate locally (a plan of its own: they are resident)."""
        return self.model.no_sync()

    @property
    def plan(self) -> Any:
        return self.compiled.plan

    @property
    def replans(self) -> int:
        return self.compiled.replans

    @property
    def host_pool(self) -> Any:
        return self.compiled.host_pool

    @property
    def host_pool_bytes(self) -> int:
        return self.compiled.host_pool_bytes

    @property
    def forward_graphs(self) -> list[torch.fx.GraphModule]:
        return self.compiled.forward_graphs

    @property
    def backward_graphs(self) -> list[torch.fx.GraphModule]:
        return self.compiled.backward_graphs
