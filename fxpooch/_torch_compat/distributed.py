"""What fxpooch reads of DistributedDataParallel and FSDP2 (private members of both)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


# -- DistributedDataParallel: what dynamo reads of it (a private member of DDP) ----------------
def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` whose forward is running on this thread, or None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


# -- FSDP2 (fully_shard): what a sharded module's parameter group holds (private members) ------
@dataclass(frozen=True)
class ShardedGroup:
    """One ``fully_shard`` module's parameters as FSDP2 lays them out on this rank.

    ``padded_shard_bytes``: the rank's shards, each padded to an equal slice of dim 0 (what the
    all-gather sends); ``shards``: the ranks it shards over; ``reshards_after_forward``: the
    unsharded parameters are freed after the module's forward; ``plain``: default mixed precision
    and no CPU offload, on a 1-D mesh (parameters all-gathered in their own dtype);
    ``reduce_scatter_buffers``: reduce-scatter inputs FSDP keeps alive between modules;
    ``reduces_gradients``: gradients are reduce-scattered after the backward (not accumulated
    unsharded, ``set_requires_gradient_sync(False)``); ``collective_temporaries``: copies the size of
    a collective's tensor its process group's backend may hold at once (:func:`collective_temporaries`).
    """

    padded_shard_bytes: int
    shards: int
    reshards_after_forward: bool
    plain: bool
    reduce_scatter_buffers: int
    reduces_gradients: bool
    collective_temporaries: int = 0


def fsdp_sharded_group(module: Any) -> ShardedGroup | None:
    """The layout of ``module``'s ``fully_shard`` parameter group; None if it manages no parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return None
    mesh = group.mesh_info
    plain = (isinstance(mesh, FSDPMeshInfo) and not isinstance(mesh, HSDPMeshInfo)
             and group.mp_policy == MixedPrecisionPolicy() and type(group.offload_policy) is OffloadPolicy)
    nbytes = sum(p.padded_sharded_param_size.numel() * p.sharded_param.element_size() for p in group.fsdp_params)
    shards = mesh.shard_mesh_size if isinstance(mesh, FSDPMeshInfo) else 1
    process_group = getattr(mesh, "shard_process_group", None)
    return ShardedGroup(nbytes, shards, group.post_forward_mesh_info is not None, plain,
                        getattr(group, "reduce_scatter_max_input_buffers", 1),  # one where torch lacks the setting
                        group.reduce_grads, 0 if process_group is None else collective_temporaries(process_group))


def collective_temporaries(process_group: Any) -> int:
    """Copies the size of a collective's tensor that ``process_group``'s backend may hold at once
    beyond its inputs and outputs: gloo copies on the calling thread and on each of its worker threads
    (the profiler shows a buffer of the gathered size allocated on each, and those of a worker thread
    are freed when it is done, while the calling thread may go on); 0 for other backends (NCCL's
    buffers are its own, outside the caching allocator)."""
    import torch.distributed as dist

    if dist.get_backend(process_group) != "gloo":
        return 0
    try:
        threads = int(process_group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):  # where torch does not say: gloo's default
        threads = 2
    return 1 + threads
