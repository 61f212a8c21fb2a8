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

from ..segments import chain_inputs, chain_ops
from .bounds import Bounds

if TYPE_CHECKING:
    from .lpmodel import Model


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


def chain_sharing(bounds: Bounds, model: Model, x: dict, y: dict[int, int],
                  rec: list[float]) -> tuple[dict[int, int], list[tuple[int, int, float]]]:
    """:mod:`.lp`'s sharing rows. A plan's schedule shares the chains of its recomputed
    activations but those apart (``sigma_a = 1``; ``plan_recomputes(apart=...)``): a set closed
    over readers (``sigma_a >= sigma_c + x_a^r - 1`` where ``a``'s shortest chain reads ``c``) of
    activations recomputed (``sigma_a <= x_a^r``), each rebuilt by its own chain alone at its
    first reader (``y_a >= sigma_a``). A head ``b`` not apart rebuilds every recomputed
    activation its shortest chain reads that is first read later (``y_a + y_b + x_a^r - sigma_b
    <= 2``; none of them is apart, by the closure), and through it those that one's chain reads,
    and so on (a path of recomputed activations first read after ``b``: ``y_c + y_b + sum of x^r
    on the path - sigma_b <= 1 + its length``; a chain that rebuilt one of them earlier read the
    rest then). Apart, a head's chain reruns the shortest chains of the recomputed activations it
    reads, and theirs in turn (``z_ac``). Returns ``sigma`` per activation of ``y`` and ``(a,
    z_ac, seconds)``: what each adds to ``a``'s chain, each op counted once per chain."""
    ev = bounds.ev
    graph, owner = ev.graph, ev.owner
    sigma = {a: model.var(1.0, True) for a in y}
    chain = {a: chain_ops(graph, a, lambda c: False, owner, strict=False) for a in y}
    reads = {a: sorted(c for c in {owner[v] for o in ops for v in graph.ops[o].recompute_args if v in owner} - {a}
                       if c in y) for a, ops in chain.items()}
    for a in y:
        model.ge([(x[("r", a)], 1.0), (sigma[a], -1.0)], 0.0)
        model.ge([(y[a], 1.0), (sigma[a], -1.0)], 0.0)
        for c in reads[a]:
            model.ge([(sigma[a], 1.0), (sigma[c], -1.0), (x[("r", a)], -1.0)], -1.0)
    fr = bounds.first_reader
    for b in y:  # through every path of recomputed activations first read after b
        path = {a: (a,) for a in reads[b] if fr[a] > fr[b]}
        queue = list(path)
        while queue:
            a = queue.pop(0)
            model.ge([(y[a], -1.0), (y[b], -1.0), *((x[("r", c)], -1.0) for c in path[a]), (sigma[b], 1.0)],
                     -1.0 - len(path[a]))
            for c in reads[a]:
                if c not in path and c != b and fr[c] > fr[b]:
                    path[c] = (*path[a], c)
                    queue.append(c)
    terms = []
    op_time = ev.problem.costs.op_time
    for a in y:
        seen = set(chain[a])
        parent = {c: None for c in reads[a]}
        queue = list(reads[a])
        while queue:
            c = queue.pop(0)
            z = model.var(1.0)
            if parent[c] is None:
                model.ge([(z, 1.0), (x[("r", a)], -1.0), (x[("r", c)], -1.0), (sigma[a], -1.0)], -2.0)
            else:
                model.ge([(z, 1.0), (parent[c], -1.0), (x[("r", c)], -1.0)], -1.0)
            cost = sum(op_time[o] for o in chain[c] - seen) / model.unit
            seen |= chain[c]
            if cost > 0:
                terms.append((a, z, cost))
            for d in reads[c]:
                if d not in parent and d != a:
                    parent[d] = z
                    queue.append(d)
    return sigma, terms
