"""The cut bound of one cut (:mod:`.bounds`), minimised over every split of its evicted bytes.

A fitting plan that evicts bytes ``X`` by swap and ``Y`` by recompute at a cut takes at least
``max(P, D(X)) + G + max(Q + R(Y), H(X))`` (and, per backward op ``k``, the copies first read by
``k`` ending before its tail). Allowing each candidate fractionally and, to relax further, as
both swapped and recomputed gives a convex piecewise-linear problem in the swapped byte count
``s``: ``min_s max(P, D*(s)) + G + max(Q + R*(e - s), H*(s))``, with ``D*``, ``H*``, ``R*`` the
cheapest-first (fractional knapsack) curves. Its minimum lies at a breakpoint of a curve or where
the two sides of a ``max`` cross, and is found exactly.

Four bytes to evict, one second of compute before the cut and two after; swapping costs a
second a byte each way, recomputing a second for all four. Swapping one byte (its D2H ends with
the compute before) and recomputing three gives ``1 + max(2 + 3/4, 1)``:

>>> split_bound(1.0, 0.0, 2.0, 4, swap=[(4.0, 4.0, 4, 7)], recompute=[(1.0, 4)])
3.75
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _curve(items: Sequence[tuple[float, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest-first cost of evicting x bytes from items ``(seconds, bytes)``, each divisible:
    the breakpoints ``(bytes, seconds)`` of a convex piecewise-linear curve from (0, 0)."""
    cost, nbytes = np.array(items, dtype=float).reshape(-1, 2).T
    some = nbytes > 0
    cost, nbytes = cost[some], nbytes[some]
    order = np.argsort(cost / nbytes, kind="stable")
    return np.concatenate([[0.0], np.cumsum(nbytes[order])]), np.concatenate([[0.0], np.cumsum(cost[order])])


def _at(curve: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The curve at each of ``x`` (its last cost beyond its capacity)."""
    return np.interp(x, *curve)


def split_bound(before: float, between: float, after: float, excess: float,
                swap: Sequence[tuple[float, float, int, int]], recompute: Sequence[tuple[float, int]],
                tails: Sequence[tuple[int, float]] = ()) -> float:
    """``min max(before, D) + between + max(after + R, H_k + tail_k)`` over fractional evictions
    of ``excess`` bytes, for the level ``(k, tail_k)`` where it is largest.

    ``swap``: ``(d2h seconds, h2d seconds, bytes, first reader)`` per swappable candidate;
    ``recompute``: ``(seconds, bytes)`` per recomputable one. ``H_k`` counts the copies of
    activations first read by op ``k`` or earlier; ``tail_k`` is the compute from op ``k`` on
    (those copies end before it starts). The level with every copy and no tail is always
    included. Infinite when the candidates cannot evict ``excess`` bytes.

    ``s`` bytes swapped, the rest recomputed: every curve is linear between breakpoints, so
    the minimum lies at a breakpoint or where the two sides of a max cross between two.
    """
    if excess <= 0:
        return before + between + after
    d, r = _curve([(x, n) for x, _, n, _ in swap]), _curve(recompute)
    lo, hi = max(0.0, excess - r[0][-1]), min(float(excess), d[0][-1])
    if lo > hi:
        return math.inf
    inner = np.concatenate([d[0], excess - r[0]])
    out = 0.0
    for k, tail in [(math.inf, 0.0), *tails]:
        h = _curve([(y if due <= k else 0.0, n) for _, y, n, due in swap])

        def sides(s: np.ndarray, h=h, tail=tail) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """At ``s`` bytes swapped: D2H past ``before``, then recomputes and copies after."""
            return _at(d, s) - before, after + _at(r, excess - s), _at(h, s) + tail

        pts = np.unique(np.concatenate([[lo, hi], inner, h[0]]))
        pts = pts[(pts >= lo) & (pts <= hi)]
        dev, rec, copies = sides(pts)
        best = float(np.min(np.maximum(dev, 0.0) + np.maximum(rec, copies)))
        for f in (dev, rec - copies):  # a sign change between two breakpoints: the sides cross there
            cross = np.flatnonzero(f[:-1] * f[1:] < 0)
            if cross.size:
                a, b, fa, fb = pts[cross], pts[cross + 1], f[cross], f[cross + 1]
                cdev, crec, ccopies = sides(a + (b - a) * fa / (fa - fb))
                best = min(best, float(np.min(np.maximum(cdev, 0.0) + np.maximum(crec, ccopies))))
        out = max(out, before + between + best)
    return out
