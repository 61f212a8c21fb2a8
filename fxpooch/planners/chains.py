"""What recompute chains may run and rebuild, whatever else a plan decides: facts the lower
bounds of :mod:`.lp`, :mod:`.floor` and :mod:`.issue_order` rely on.

``build_schedule`` emits a chain per head (a recomputed activation not rebuilt yet) at its
first reader. A chain runs ``chain_ops`` from the head's members through the saved values of
recomputed activations, and rebuilds whole each pending recomputed activation whose member it
reaches. It reaches an activation's members only through an op that reads them, and that op
lies in the shortest chain (every other activation available) of the last activation whose
members the chain passed on its way there: that activation is recomputed, and its shortest
chain reads the one reached.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..schedule import chain_inputs, chain_ops
from .bounds import Bounds

if TYPE_CHECKING:
    from .lp import Model


def chain_readers(bounds: Bounds, model: Model, x: dict, rec: list[float]) -> dict[int, list[int]]:
    """Per activation ``b``, the recomputable ``c`` whose shortest chain reads it (the module
    docstring): a recomputed ``b`` is rebuilt by a chain not its own only where one of them is
    recomputed."""
    graph, owner = bounds.ev.graph, bounds.ev.owner
    readers: dict[int, list[int]] = {}
    for c in range(len(graph.activations)):
        if rec[c] < math.inf and model.hi[x[("r", c)]] > 0:
            for b in chain_inputs(graph, c, owner):
                readers.setdefault(b, []).append(c)
    return readers


def rebuilt_by(readers: dict[int, list[int]], first_reader: list, x: dict, op: int):
    """``may(a)``: variables of which one is 1 wherever a recomputed ``a`` was rebuilt before
    backward op ``op`` ran: a chain not its own rebuilt it (its own runs at its first reader,
    later), so one of its readers (:func:`chain_readers`) was rebuilt in that chain, by its own
    chain if first read by ``op`` (``x_c^r``), else in the same way (a DAG: this ends)."""
    memo: dict[int, frozenset[int]] = {}

    def may(a: int) -> frozenset[int]:
        if a not in memo:
            memo[a] = frozenset().union(*(frozenset((x[("r", c)],)) if first_reader[c] is not None
                                          and first_reader[c] <= op else may(c) for c in readers.get(a, ())))
        return memo[a]
    return may


def reach(graph, owner: dict[int, int], a: int) -> set[int]:
    """Every op a chain of ``a`` may run, whatever else is recomputed: its longest chain, and
    the longest chains of the activations with a member in it (``build_schedule`` rebuilds those
    whole), until none is added."""
    ops: set[int] = set()
    todo, seen = [a], set()
    while todo:
        c = todo.pop()
        seen.add(c)
        ops |= chain_ops(graph, c, lambda _: True, owner, strict=False)
        todo.extend({owner[v] for v in ops if v in owner} - seen - set(todo))
    return ops
