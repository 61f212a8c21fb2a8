"""Realise one graph pair's part of a schedule: forward offloads, backward prefetch/wait/recompute."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxpooch.graph import NodeTable, StepGraph
from fxpooch.schedule import Schedule

from .offload import rewrite_forward
from .slots import swap_slots
from .swapin import rewrite_backward


@dataclass(frozen=True)
class RewrittenPair:
    forward: fx.GraphModule
    backward: fx.GraphModule


def rewrite_pair(g: int, graph: StepGraph, table: NodeTable, schedule: Schedule,
                 releases: dict[int, int] | None = None) -> RewrittenPair:
    """Graph pair ``g`` rewritten for ``schedule``; ``releases`` (swapped activation -> op, from
    :func:`fxpooch.simulator.release_points`): where each offloaded buffer is freed in stream order
    (None or absent: when its copy ends, ``record_stream``)."""
    pair = table.pairs[g]
    slots = swap_slots(graph, schedule)
    return RewrittenPair(
        rewrite_forward(pair.forward, g, graph, table, schedule, slots, releases or {}),
        rewrite_backward(pair.backward, g, graph, table, schedule, slots, releases or {}),
    )
