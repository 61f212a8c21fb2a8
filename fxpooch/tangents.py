"""The incoming gradients of a backward call beyond the tangents its graph was traced with.

AOTAutograd gives a view the model returns of another value (``return y, y[:, :64]``) no tangent:
it makes the view outside the graph, and autograd adds the caller's gradient of the view, through
the view's backward (a zero-filled gradient of the whole base, for a view of part of it), into a
gradient of the base, which is the tangent. :func:`beside_tangents` says what that holds beside
the tangents (the caller's gradients) and for a moment before the call (the sums), for
:func:`fxpooch.graph.build_step_graph` to count. Dynamo too returns outputs beside its graphs'
(one output twice, a parameter as it is); :func:`caller_gradients` says what the caller's
gradients of those hold.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from . import _torch_compat as compat
from .capture import GraphPair
from .memory import MemoryModel, size_hint


def node_tensors(node: fx.Node) -> list[torch.Tensor]:
    """The tensors a node's value holds, nested ones included (a higher-order op such as
    ``run_with_rng_state`` returns its op's outputs as a tuple inside its own)."""
    return [v for v in compat.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, as its strides lay them out: what
    ``empty_strided`` allocates for its layout."""
    return sum((size_hint(n) - 1) * size_hint(s) for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0


def accumulation_peak(new: Sequence[bool]) -> int:
    """How many base-sized gradients, beyond the sum it ends with, autograd holds at once while it adds
    gradients into one (``new``: per gradient in the order they arrive, whether it is a buffer of its
    own, a view's zero-filled backward, rather than one the caller holds or a view of it). The first
    is taken as it is; each later one makes a new sum, then frees the old sum (not the caller's) and itself.

    >>> accumulation_peak([False, True]), accumulation_peak([True, True]), accumulation_peak([False, False])
    (1, 2, 0)
    """
    live = peak = 0
    owned = None  # whether the sum so far is autograd's own
    for fresh in new:
        live += fresh
        if owned is not None:
            live += 1  # the new sum
            peak = max(peak, live)
            live -= owned + fresh
            owned = True
        else:
            owned = fresh
        peak = max(peak, live)
    return peak - live


def beside_tangents(pair: GraphPair, memory: MemoryModel) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(name, bytes) of the gradients the caller holds through ``pair``'s backward call beside its
    tangents, when it holds the outputs, and of what autograd allocates for a moment before the call
    (``grad_sum_<base>``). The caller's gradient of a returned view is held, and so is its gradient of
    the base where it sees the base too (the tangent is then autograd's sum, a new buffer; freed after
    its last reader, but counted held like the other tangents: high by at most its bytes)."""
    outs = pair.forward.graph.output_node().args[0]
    held: list[tuple[str, int]] = []
    arrivals: dict[fx.Node, list[bool]] = {}  # base -> per gradient autograd adds into its own: a new one
    for view, base, seen in pair.returned_views or ():
        v = node_tensors(outs[view])[0]
        held.append((f"grad_{outs[view].name}", memory.tensor_bytes(v)))
        if base is not None:
            b = node_tensors(outs[base])[0]
            if seen and outs[base] not in arrivals:
                held.append((f"grad_{outs[base].name}", memory.tensor_bytes(b)))
            arrivals.setdefault(outs[base], [False] if seen else []).append(v.numel() < b.numel())
    transient = [(f"grad_sum_{base.name}", extra * memory.tensor_bytes(node_tensors(base)[0]))
                 for base, new in arrivals.items() if (extra := accumulation_peak(new))]
    return held, transient


def caller_gradients(pairs: Sequence[GraphPair], memory: MemoryModel) -> list[tuple[str, int]]:
    """(name, bytes) of the caller's gradients that autograd holds from the step's first backward
    on, beside the tangents: one per time the model returns a graph's output where that gradient is
    not the tangent itself (an earlier graph's output, whose backward runs later, that no later graph
    takes: one a later graph takes, as logits taken by a loss, has for its incoming gradient the one
    that graph passes on; one returned twice, whose tangent is the sum of the caller's gradients),
    and one per parameter or input the model returns as it is (:attr:`GraphPair.to_caller`,
    :attr:`GraphPair.to_later`, :attr:`GraphPair.leaves_to_caller`)."""
    out: list[tuple[str, int]] = []
    for g, pair in enumerate(pairs):
        outs = pair.forward.graph.output_node().args[0]
        for i in sorted(set(pair.to_caller)):
            times = pair.to_caller.count(i)
            if (g < len(pairs) - 1 and i not in pair.to_later) or times > 1:
                out += [(f"grad_{outs[i].name}_{k}", memory.tensor_bytes(node_tensors(outs[i])[0])) for k in range(times)]
        out += [(f"grad_leaf_{k}", memory.tensor_bytes(t)) for k, t in enumerate(pair.leaves_to_caller)]
    return out
