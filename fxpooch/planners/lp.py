"""A linear-programming relaxation of the lower bound: the cuts of ``bounds`` solved together.

``Bounds.bound`` takes the largest of the cut bounds, each minimised on its own, so a plan
near the floor, which must evict at many cuts, is bounded by its single worst cut. Here every
activation gets one fractional decision ``x_a^k + x_a^s + x_a^r = 1`` shared by all cuts, and
each cut ``c`` evicts fractions ``s_ac <= x_a^s``, ``r_ac <= x_a^r`` of its candidates with
``sum bytes_a (s_ac + r_ac) >= e_c``. ``T`` is at least

* the compute, every op once, plus ``sum r_a x_a^r`` (each recompute runs; ``r_a`` as in
  ``Bounds.recompute_costs``, so shared segments are not counted twice);
* at each cut, the four sums that ``max(P_c, D) + G_c + max(Q_c + R, H)`` (``bounds``' cut
  argument) is at least: ``P_c + G_c + Q_c + R``, ``D + G_c + H``, ``P_c + G_c + H`` and
  ``D + G_c + Q_c + R``, with ``D``, ``H``, ``R`` the evicted swaps' D2H and H2D seconds and the
  evicted recomputes' seconds at that cut.

Any fitting plan gives a feasible point (its decisions and evictions, 0/1), so the LP's minimum
is a lower bound on its step time. Solved by HiGHS through ``scipy.optimize.linprog`` (scipy is
an optional dependency, ``pip install fxpooch[lp]``); without scipy the cut bound is returned.
"""
from __future__ import annotations

import logging
import math

from .bounds import Bounds
from .common import Evaluator

log = logging.getLogger("fxpooch.planner.lp")


def lp_lower_bound(ev: Evaluator) -> float:
    """The LP relaxation's bound, never below ``bounds.lower_bound`` (its cut bound is kept when
    larger, and returned alone where scipy is missing or the LP fails)."""
    bounds = Bounds(ev)
    cut_bound = bounds.bound()
    try:
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError:
        log.info("scipy is not installed: the cut bound only")
        return cut_bound
    if cut_bound == math.inf or not bounds.cuts:
        return cut_bound
    n = len(bounds.nbytes)
    rec = bounds.recompute_costs([None] * n)
    cols: list[float] = [1.0]  # objective coefficient per variable; 0 is T
    index = {}

    def var(key) -> int:
        index[key] = len(cols)
        cols.append(0.0)
        return index[key]

    for a in range(n):
        for d in "ksr":
            var((d, a))
    rows, cols_i, vals, rhs_ub = [], [], [], []
    eq_rows, eq_cols, eq_vals = [], [], []
    r = 0

    def ub(terms: list[tuple[int, float]], bound: float) -> None:
        nonlocal r
        for j, v in terms:
            rows.append(r)
            cols_i.append(j)
            vals.append(v)
        rhs_ub.append(bound)
        r += 1

    upper = [(0.0, None)] + [(0.0, 1.0)] * (3 * n)
    for a in range(n):
        for d in "ksr":
            eq_rows.append(a)
            eq_cols.append(index[(d, a)])
            eq_vals.append(1.0)
        if bounds.d2h[a] == math.inf:
            upper[index[("s", a)]] = (0.0, 0.0)
        if rec[a] == math.inf:
            upper[index[("r", a)]] = (0.0, 0.0)
    # T >= compute + sum r_a x_a^r
    ub([(0, -1.0)] + [(index[("r", a)], rec[a]) for a in range(n) if rec[a] < math.inf], -bounds.compute)
    for c, cut in enumerate(bounds.cuts):
        s_vars, r_vars = [], []
        for a in cut.candidates:
            if bounds.d2h[a] < math.inf:
                j = var(("sc", a, c))
                upper.append((0.0, 1.0))
                ub([(j, 1.0), (index[("s", a)], -1.0)], 0.0)
                s_vars.append((a, j))
            if rec[a] < math.inf:
                j = var(("rc", a, c))
                upper.append((0.0, 1.0))
                ub([(j, 1.0), (index[("r", a)], -1.0)], 0.0)
                r_vars.append((a, j))
        ub([(j, -float(bounds.nbytes[a])) for a, j in s_vars + r_vars], -float(cut.excess))
        d = [(j, bounds.d2h[a]) for a, j in s_vars]
        h = [(j, bounds.h2d[a]) for a, j in s_vars]
        rr = [(j, rec[a]) for a, j in r_vars]
        p, g, q = cut.before, cut.between, cut.after
        for terms, const in ((rr, p + g + q), (d + h, g), (h, p + g), (d + rr, g + q)):
            ub([(0, -1.0)] + terms, -const)
    m = len(cols)
    a_ub = coo_matrix((vals, (rows, cols_i)), shape=(r, m)).tocsr()
    a_eq = coo_matrix((eq_vals, (eq_rows, eq_cols)), shape=(n, m)).tocsr()
    res = linprog(np.asarray(cols), A_ub=a_ub, b_ub=np.asarray(rhs_ub), A_eq=a_eq, b_eq=np.ones(n),
                  bounds=upper, method="highs")
    if res.status == 2:  # infeasible: no split of the evictions reaches every cut's excess
        return math.inf
    if res.status != 0:
        log.warning("LP relaxation: %s; the cut bound only", res.message)
        return cut_bound
    return max(cut_bound, float(res.fun))
