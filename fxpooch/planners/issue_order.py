"""Valid inequalities of :func:`.lp.relaxation`'s model (``Families.issue_order``): prefetches
leave in the order they are first needed.

``build_schedule`` needs a swap ``a`` first at ``first_use(a)``: its first backward reader, or
the first reader of a recomputed activation whose chain (emitted there) reads it, if earlier.
``place_prefetches`` issues each prefetch of a backward graph no earlier than the one before it
in ``(first_use, a)`` order, and the H2D stream copies in the order they were issued. So where
``j`` comes before ``k`` in that order and both are swapped, ``k``'s copy ends at least ``h_k``
after ``j``'s: ``W_k >= W_j + h_k``, with ``W`` a lower bound on each swap's prefetch end (the
*Streams* one of :mod:`.floor`, and ``θ_p`` plus the wait of point ``p`` plus ``h_j`` at each
point that evicts ``j``). Compute runs ``k``'s first reader after ``W_k``, and the first chain
that reads it (*Chain deadlines*) after ``W_k`` too. A small swap first needed after a large
one queues behind it (a batch norm's statistics swapped beside the conv output the chain of a
recomputed conv reads: that output's copy, issued where memory first allows, holds up every
copy after it).

The order is not known before the decisions. ``j`` is needed by ``use``: its first reader, or
the first reader of a recomputed ``c`` whose chain reads it (``floor.chain_deadlines``, where
its ``needs`` are recomputed). ``k`` is needed before ``use`` only where a chain that reads it
runs by then: one that runs the shortest chain of one of its readers (``chains.chain_readers``),
rebuilt by then (``chains.rebuilt_by``). Where none of those is 1, ``j`` comes before ``k``
if ``(use, j) < (first_reader(k), k)``; otherwise, or where ``j`` or ``k`` is not swapped, the
inequality is relaxed by a bound on any step's time (``big``).
"""
from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from .bounds import Bounds
from .chains import chain_readers, rebuilt_by
from .floor import compute_after, recomputed_all

if TYPE_CHECKING:
    from .lp import Model, _Point


def issue_order(bounds: Bounds, model: Model, x: dict, points: list[_Point], theta: list[int],
                waits: list[float], evicted: dict[tuple[int, int], int], prefetched: dict[int, int],
                prefix: list[float], suffix: list[float], d2h: list[float], h2d: list[float], rec: list[float],
                deadlines: dict[int, list[tuple[int, tuple[int, ...], float]]]) -> None:
    """Add the module docstring's inequalities. ``waits``: per point, what its evictees' H2D copies
    wait for after ``θ_p``; ``evicted``: ``(point, activation) -> s_ap``; ``prefetched``: the
    *Streams* bound per swap (``floor.streams``)."""
    ev = bounds.ev
    graph, fr = ev.graph, bounds.first_reader
    acts = graph.activations
    swaps = [a for a in range(len(acts)) if h2d[a] < math.inf and model.hi[x[("s", a)]] > 0 and fr[a] is not None]
    if len(swaps) < 2:
        return
    compute = sum(ev.problem.costs.op_time) / model.unit
    # no step is longer than every op run once per chain and once more, every copy in turn
    big = (2 + len(acts)) * compute + sum(t for t in d2h + h2d if t < math.inf)
    keys = [p.key for p in points]
    w = {a: model.var() for a in swaps}
    for a in swaps:
        if a in prefetched:
            model.ge([(w[a], 1.0), (prefetched[a], -1.0)], 0.0)
    for (i, a), s in evicted.items():
        if a in w:  # issued after the point: W_a >= θ_i + wait_i + h_a where evicted there
            model.ge([(w[a], 1.0), (theta[i], -1.0), (s, -big)], waits[i] + h2d[a] - big)
    readers = chain_readers(bounds, model, x, rec)
    reaches = compute_after(model, points, theta, prefix, suffix)
    read_by: dict[int, object] = {}  # op -> rebuilt_by(.., op)
    needed: dict[tuple[int, ...], int] = {}  # needs -> 1 where all are recomputed
    for j in swaps:  # j is needed first by its first reader, or by c's chain where needs are recomputed
        for use, needs in [(fr[j], ()), *((fr[c], needs) for c, needs, _ in deadlines.get(j, ()))]:
            if needs and needs not in needed:
                needed[needs] = recomputed_all(model, x, needs)
            for k in swaps:
                if acts[j].graph != acts[k].graph or (use, j) >= (fr[k], k) or k == j:
                    continue
                if use not in read_by:
                    read_by[use] = rebuilt_by(readers, fr, x, use)
                early = read_by[use](k)  # one is 1 where a chain that reads k may run by then
                model.ge([(w[k], 1.0), (w[j], -1.0), (x[("s", j)], -big), (x[("s", k)], -big),
                          *(((needed[needs], -big),) if needs else ()), *((v, big) for v in early)],
                         h2d[k] - (3 if needs else 2) * big)
    for k in swaps:
        reaches(fr[k], w[k], 0.0)
        for c, needs, after in deadlines.get(k, ()):  # before the first chain that reads k (floor.py)
            if needs not in needed:
                needed[needs] = recomputed_all(model, x, needs)
            model.ge([(0, 1.0), (w[k], -1.0), (needed[needs], -(after + suffix[fr[c]] - suffix[fr[k]]))], suffix[fr[k]])
            q = bisect.bisect_left(keys, (fr[c], 1))  # and the first point from c's first reader on
            if q < len(points):
                model.ge([(theta[q], 1.0), (w[k], -1.0), (needed[needs], -big)],
                         after + prefix[points[q].op] - prefix[fr[c]] - big)
