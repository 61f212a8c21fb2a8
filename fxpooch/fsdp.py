"""Sharded data parallel training: ``fxpooch.compile`` of a model sharded with FSDP2's ``fully_shard``.

The supported layout is the one PyTorch documents for FSDP2: ``fully_shard`` on each block, then on
the root. fxpooch needs two more things of it:

* every parameter belongs to a sharded block, none to the root alone (shard the embedding and the
  output head as blocks of their own): FSDP's hooks around each block are graph breaks, so the
  root's forward runs outside dynamo, and a layer there would run unplanned;
* blocks are not nested (no ``fully_shard`` inside a sharded block), keep the defaults for mixed
  precision (none), CPU offload (none) and ``reshard_after_forward`` (True), on a 1-D mesh, and
  reduce-scatter their gradients at every step (no ``set_requires_gradient_sync(False)``).

:func:`separate_graphs` gives each block a ``forward`` with a code object of its own, so dynamo compiles
one graph per block (identical blocks would otherwise share one graph, run several times per step, which
a plan cannot hold) and the step is planned as one, over every block.

What a rank holds beyond the planned graphs, counted as resident through the step (:func:`held_bytes`):

* the rank's parameter shards and gradient shards (each padded as FSDP pads them);
* FSDP's window of gathered parameters, an upper bound over the step of what its hooks hold between
  and during the blocks' graphs: with ``U`` the largest block's all-gathered (unsharded) bytes, up to
  ``U`` for the block computing, ``U`` for the block prefetched in the backward (or, in the forward,
  the previous block's all-gather output, kept until the next copy-out), ``U`` for an all-gather
  output being copied out, ``U`` for each reduce-scatter input FSDP keeps in flight
  (``set_reduce_scatter_max_input_buffers``, 1 by default), and ``U`` for each temporary copy the
  process group's backend makes (gloo: one on the calling thread and one on each worker thread,
  freed when that thread is done, so how many are alive at once depends on the threads' timing;
  NCCL: none): ``(3 + buffers + temporaries) * U``.

The unsharded gradients a block's backward returns are counted by the plan until that backward call
returns (``build_step_graph(gradients_reduced=True)``): FSDP's post-backward hook then copies them
into its reduce-scatter input (in the window) and frees them. The window's parts are not all held at
once, so the plan is an upper bound of the rank's peak, above it by at most the window.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat
from .errors import InvalidOption, UnsupportedModel
from .memory import MemoryModel
from .options import CompileOptions

#: gathered blocks FSDP holds at most at once besides its reduce-scatter inputs: the one computing,
#: the one prefetched (or the previous all-gather output), and an all-gather output being copied out
GATHERED_AT_ONCE = 3

_ENTRY_TAG = "fxpooch_fsdp_block"


@dataclass(frozen=True)
class ShardedLayout:
    """What ``fully_shard`` made of a model: its sharded blocks by name, as FSDP lays them out."""

    blocks: tuple[tuple[str, compat.ShardedGroup], ...]

    @property
    def largest_unsharded_bytes(self) -> int:
        return max(g.padded_shard_bytes * g.shards for _, g in self.blocks)

    @property
    def window_bytes(self) -> int:
        """The upper bound of what FSDP's hooks hold at once beyond the shards (module docstring)."""
        buffers = max(g.reduce_scatter_buffers for _, g in self.blocks)
        temporaries = max(g.collective_temporaries for _, g in self.blocks)
        return (GATHERED_AT_ONCE + buffers + temporaries) * self.largest_unsharded_bytes


def _fsdp_classes() -> tuple[type, type] | None:
    """FSDP2's and FSDP1's module classes; None where nothing can be sharded (torch.distributed is not
    built, or FSDP was never imported: a model is sharded through it, so it is not imported here)."""
    if not torch.distributed.is_available() or "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return FSDPModule, FullyShardedDataParallel


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    classes = _fsdp_classes()
    return classes is not None and isinstance(module, classes)


def layout(model: nn.Module) -> ShardedLayout | None:
    """The sharded layout of ``model`` (None if nothing in it is sharded); :class:`UnsupportedModel`
    for a layout fxpooch does not plan (see the module docstring)."""
    classes = _fsdp_classes()
    if classes is None:
        return None
    fsdp2, fsdp1 = classes
    modules = list(model.named_modules())
    old = [name or "the model" for name, m in modules if isinstance(m, fsdp1)]
    if old:
        raise UnsupportedModel(
            f"{old[0]} is wrapped in FullyShardedDataParallel (FSDP1), which fxpooch does not plan: shard it with "
            "FSDP2's fully_shard on each block and then on the root (torch.distributed.fsdp.fully_shard)")
    sharded = [(name, m) for name, m in modules if isinstance(m, fsdp2)]
    if not sharded:
        return None
    if sharded[0][1] is not model:
        raise UnsupportedModel(
            f"{sharded[0][0]} is sharded by fully_shard but the model given to fxpooch is not: apply fully_shard "
            "to each block and then to the root module, and compile the root (if fully_shard was applied "
            "after fxpooch.compile, apply it before instead)")
    root_group = compat.fsdp_sharded_group(model)
    if root_group is not None:
        raise UnsupportedModel(
            "the root module's fully_shard holds parameters of its own (of layers outside the sharded blocks, "
            "such as an embedding or an output head): FSDP's hooks break the graph at each block, so those "
            "layers would run outside fxpooch's plan. Apply fully_shard to the modules that hold them too "
            "(each as a block) before the root's")
    blocks = []
    for name, module in sharded[1:]:
        outer = next((n for n, m in sharded[1:] if m is not module and name.startswith(n + ".")), None)
        if outer is not None:
            raise UnsupportedModel(
                f"{name} is sharded inside the sharded block {outer}: fxpooch plans blocks that are not nested; "
                f"apply fully_shard to {name} or to {outer}, not to both")
        group = compat.fsdp_sharded_group(module)
        if group is None:
            continue
        if not group.plain:
            raise UnsupportedModel(
                f"{name} is sharded with a mixed-precision or CPU-offload policy, or on a 2-D (HSDP) mesh: fxpooch "
                "plans FSDP2 with its defaults on a 1-D mesh only; leave mp_policy and offload_policy unset")
        if not group.reshards_after_forward:
            raise UnsupportedModel(
                f"{name} is sharded with reshard_after_forward=False (or an int): its gathered parameters would stay "
                "through the step, which fxpooch does not count; keep the default reshard_after_forward=True")
        if not group.reduces_gradients:
            raise UnsupportedModel(
                f"{name} accumulates its gradients unsharded (set_requires_gradient_sync(False)), which fxpooch does "
                "not count: keep gradient sync on, or accumulate by adding the losses of several micro-batches")
        blocks.append((name, group))
    if not blocks:
        raise UnsupportedModel("fully_shard was applied but no sharded block holds parameters: shard each block "
                               "that holds parameters, then the root")
    return ShardedLayout(tuple(blocks))


def separate_graphs(model: nn.Module, sharded: ShardedLayout) -> None:
    """Give each sharded block a class of its own whose ``forward`` (calling the block's own) has a code
    object of its own, so that dynamo compiles a graph per block instead of one shared by all.

    A class, not an instance attribute: a copy of the block (``copy.deepcopy``) keeps calling its own
    forward. ``fully_shard`` swaps the class the same way."""
    modules = dict(model.named_modules())
    for name, _ in sharded.blocks:
        block = modules[name]
        base = type(block)
        if base.__dict__.get(_ENTRY_TAG, False):
            continue
        forward = compat.fresh_entry(base.forward, f"{_ENTRY_TAG}_{name.replace('.', '_')}")
        block.__class__ = type(base.__name__, (base,), {"forward": forward, _ENTRY_TAG: True,
                                                        "__module__": base.__module__})


def held_bytes(model: nn.Module, sharded: ShardedLayout | None, device: torch.device) -> int:
    """Bytes a rank holds through the step beyond the model's resident tensors and the planned graphs:
    FSDP's window of gathered parameters and, where no gradient shard exists yet, the shards the
    reduce-scatters will make (see the module docstring)."""
    if sharded is None:
        return 0
    memory = MemoryModel.for_device(device)
    # a block's gradient shards are views of one reduce-scatter output (existing ones are resident already)
    missing = any(p.grad is None for p in model.parameters() if p.requires_grad)
    gradient_shards = sum(memory.round(g.padded_shard_bytes) for _, g in sharded.blocks) if missing else 0
    return memory.round(sharded.window_bytes) + gradient_shards


def check_inputs(sharded: ShardedLayout | None, inputs: Any) -> None:
    """An input that requires grad would keep its gradient to the step's end, where a sharded step's plan
    frees every gradient once its backward graph returns."""
    leaves = compat.tree_leaves(inputs)
    if sharded is not None and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        raise UnsupportedModel("an input of a model FSDP shards requires grad: fxpooch plans a sharded step's "
                               "gradients as reduce-scattered (freed after their block's backward), not kept in "
                               "an input's .grad; pass inputs that do not require grad")


def options_for(options: CompileOptions, sharded: ShardedLayout | None) -> CompileOptions:
    """``options`` for a sharded model: a measured profile times each node alone on fresh inputs, since
    the captured inputs of the blocks' graphs include gathered parameters FSDP has freed since."""
    if sharded is None or options.profile_source != "measure" or options.profile_mode == "per-node":
        return options
    if options.profile_mode == "in-situ":
        raise InvalidOption("profile_mode='in-situ' on a model FSDP shards: the captured inputs include gathered "
                            "parameters that FSDP frees after each block; pass profile_mode='per-node' or 'auto'")
    return dataclasses.replace(options, profile_mode="per-node")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``t``: the local shard of a ``DTensor``, else ``t``."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t


__all__ = ["ShardedLayout", "check_inputs", "held_bytes", "is_sharded", "layout", "local_tensor", "options_for",
           "separate_graphs"]
