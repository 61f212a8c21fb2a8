"""Deterministic analytic (roofline) time of one node of an aten-level torch.fx graph.

Nodes come from AOTAutograd / ``make_fx`` graphs: ``call_function`` nodes whose targets are
``OpOverload``s and whose ``node.meta["val"]`` is a FakeTensor or a tuple/list of them. The model
is ``max(flops / peak_flops, bytes / mem_bandwidth) + launch_overhead`` per kernel; nodes that
launch no kernel (placeholders, ``getitem``, views per the op schema) cost nothing.

Nothing is cached across calls and no global state is touched, so the result depends only on
the node and the :class:`~fxpooch.hardware.Hardware`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .hardware import Hardware
from .memory import UNBACKED_SIZE_FALLBACK, size_hint as _hint  # noqa: F401 (UNBACKED_SIZE_FALLBACK: re-exported)
from .opkind import is_kernel_free
from . import _torch_compat as compat
from ._torch_compat import OpOverload, tree_leaves, tree_map

__all__ = ["is_kernel_free", "node_flops", "node_bytes", "analytic_time", "fused_time", "is_pointwise", "tensor_nbytes"]

log = logging.getLogger("fxpooch.costmodel")

# --------------------------------------------------------------------------- tensor helpers

def tensor_nbytes(t: torch.Tensor) -> int:
    """``numel * element_size`` of ``t``, with symbolic sizes replaced by their hints."""
    numel = 1
    for size in t.shape:
        numel *= _hint(size)
    return int(numel) * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among the pytree leaves of ``value`` (a ``meta["val"]`` or an argument)."""
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def _val_bytes(node: fx.Node) -> int:
    return sum(tensor_nbytes(t) for t in _tensors(node.meta.get("val")))


def _to_meta(value: Any) -> Any:
    """Rebuild a ``meta["val"]`` leaf as a real meta tensor (or a concrete int for a SymInt)."""
    if isinstance(value, torch.Tensor):
        size = tuple(_hint(s) for s in value.shape)
        stride = tuple(_hint(s) for s in value.stride())
        return torch.empty_strided(size, stride, dtype=value.dtype, device="meta")
    return _hint(value)


class _MissingVal(LookupError):
    """An argument node carries no ``meta["val"]``, so the op cannot be replayed."""


def _arg_value(arg: fx.Node) -> Any:
    if "val" not in arg.meta:
        raise _MissingVal(arg.name)
    return tree_map(_to_meta, arg.meta["val"])


def _may_have_flops(op: OpOverload) -> bool:
    """Whether FlopCounterMode could count anything for ``op``.

    It counts ops with a registered formula, and decomposes CompositeImplicitAutograd ops into
    ops that may have one; anything else always yields 0, so it is not worth replaying.
    """
    if op.overloadpacket in flop_registry:
        return True
    return compat.has_composite_implicit_kernel(op)


def _without_fake_mode():
    """Context manager that leaves an ambient FakeTensorMode (if any) while replaying on meta."""
    return compat.outside_fake_mode()


# --------------------------------------------------------------------------- public API

def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` as counted by :class:`torch.utils.flop_counter.FlopCounterMode`.

    The op is replayed on meta tensors rebuilt from the arguments' ``meta["val"]``; returns 0
    for kernel-free nodes, ops without a flop formula, and ops that cannot run on meta.
    """
    if is_kernel_free(node) or not _may_have_flops(node.target):
        return 0
    try:
        with _without_fake_mode():
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), _arg_value)
            counter = FlopCounterMode(display=False)
            with counter:
                node.target(*args, **kwargs)
            return int(counter.get_total_flops())
    except Exception as exc:  # a cost model must not abort planning; log and count no FLOPs
        log.debug("node_flops: cannot replay %s (%s) on meta: %s", node.name, node.target, exc)
        return 0


def node_bytes(node: fx.Node) -> int:
    """Device-memory traffic of ``node``: bytes of its tensor inputs plus its tensor outputs.

    Each distinct input node is read once (``cat([x, x])`` reads ``x`` once). In-place ops that
    return nothing (``_foreach_add_``) are charged for writing their mutated arguments.
    Kernel-free nodes move no bytes.
    """
    if is_kernel_free(node):
        return 0
    read = sum(_val_bytes(arg) for arg in node.all_input_nodes)
    written = _val_bytes(node)
    if written == 0 and isinstance(node.target, OpOverload):
        written = sum(_val_bytes(arg) for arg in _mutated_args(node))
    return read + written


def _mutated_args(node: fx.Node) -> Iterable[fx.Node]:
    """The argument nodes that ``node``'s schema marks as written (``Tensor(a!)``)."""
    seen: dict[fx.Node, None] = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.name in node.kwargs else (
            node.args[i] if i < len(node.args) else None)
        fx.node.map_arg(value, lambda n: seen.setdefault(n, None))
    return seen.keys()


def _out_dtype(node: fx.Node) -> torch.dtype:
    """dtype that sets the FLOP rate: the first output tensor's, else the first input's."""
    for t in _tensors(node.meta.get("val")):
        return t.dtype
    for arg in node.all_input_nodes:
        for t in _tensors(arg.meta.get("val")):
            return t.dtype
    return torch.float32


def analytic_time(node: fx.Node, hw: Hardware) -> float:
    """Roofline seconds for ``node`` on ``hw``; 0.0 for kernel-free nodes.

    ``max(flops / hw.peak_flops(dtype), bytes / hw.mem_bandwidth) + hw.launch_overhead``, with
    ``dtype`` the output dtype (see :meth:`Hardware.peak_flops` for the fallback).
    """
    if is_kernel_free(node):
        return 0.0
    compute = node_flops(node) / hw.peak_flops(_out_dtype(node))
    memory = node_bytes(node) / hw.mem_bandwidth
    return max(compute, memory) + hw.launch_overhead


def is_pointwise(node: fx.Node) -> bool:
    """A kernel-launching elementwise op (``torch.Tag.pointwise``): one a fusing compiler merges
    with its pointwise producers and consumers."""
    return (node.op == "call_function" and not is_kernel_free(node)
            and torch.Tag.pointwise in getattr(node.target, "tags", ()))


def fused_time(node: fx.Node, hw: Hardware) -> float:
    """Roofline seconds for ``node`` when a fusing compiler (inductor) runs its graph: a pointwise
    op does not read the values its pointwise producers computed (they stay in registers), and
    when every reader of its output is pointwise too it writes nothing and launches no kernel of
    its own (it runs inside its readers'). Other ops cost :func:`analytic_time`."""
    if not is_pointwise(node):
        return analytic_time(node, hw)
    read = sum(_val_bytes(arg) for arg in node.all_input_nodes if not is_pointwise(arg))
    fused_into_readers = bool(node.users) and all(is_pointwise(u) for u in node.users)
    written = 0 if fused_into_readers else _val_bytes(node)
    compute = node_flops(node) / hw.peak_flops(_out_dtype(node))
    return max(compute, (read + written) / hw.mem_bandwidth) + (0.0 if fused_into_readers else hw.launch_overhead)
