"""The LP relaxation of :mod:`.lp` with its decisions and evictions integral: a mixed-integer
program (HiGHS through ``scipy.optimize.milp``, ``pip install fxpooch[lp]``).

It models the simulator only as far as the LP does (memory at the cuts and where a recompute
runs, the three streams' ordering), so its optimum is a lower bound on the simulated step
time, not the optimum plan: every fitting plan is one of its feasible points. Integral
decisions make it much tighter than the LP near the floor, where the LP recomputes a fraction
of an activation to meet a point's memory without paying for the chain that rebuilds it.
With a time limit HiGHS may stop before it proves the MILP's optimum: the bound it has proved
by then (its dual bound) is returned, still a lower bound.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .bounds import Bounds
from .common import Evaluator
from .lp import MAX_NONZEROS, ModelTooLarge, probed_cut_bound, probed_relaxation, solve

log = logging.getLogger("fxpooch.planner.milp")


@dataclass(frozen=True)
class MilpBound:
    bound: float  # seconds no fitting plan beats (infinite: none fits)
    proved: bool  # HiGHS finished within its gap tolerances (else it stopped at the time limit)
    seconds: float | None  # the MILP's best point's objective (None: none found); not a bound


def milp_lower_bound(ev: Evaluator, time_limit: float | None = 60.0,
                     max_nonzeros: int | None = MAX_NONZEROS) -> MilpBound:
    """The MILP's bound after probing (:mod:`.probing`), never below the cut bound after probing
    (:func:`.lp.probed_cut_bound`); ``time_limit``: HiGHS's wall-clock seconds; that cut bound
    alone where even the probed model would pass ``max_nonzeros`` (:data:`.lp.MAX_NONZEROS`).

    Raises ImportError without scipy."""
    bounds = Bounds(ev)
    cut_bound, ruled_out = probed_cut_bound(bounds)
    if cut_bound == math.inf:
        return MilpBound(math.inf, True, None)
    try:
        model = probed_relaxation(bounds, max_nonzeros=max_nonzeros, ruled_out=ruled_out)
    except ModelTooLarge as e:
        log.warning("MILP: %s (%d activations); the cut bound after probing only", e, len(ev.graph.activations))
        return MilpBound(cut_bound, False, None)
    res = solve(model, integral=True, time_limit=time_limit)
    if res.status == 2:  # infeasible: no integral choice of evictions meets every point
        return MilpBound(math.inf, True, None)
    # HiGHS stops within its gap tolerances (an absolute one of 1e-6, not small beside a step of
    # milliseconds): its incumbent may exceed the MILP's optimum, its dual bound may not
    dual = getattr(res, "mip_dual_bound", None)
    if res.status == 0 and dual is not None and math.isfinite(dual):
        return MilpBound(max(cut_bound, float(dual) * model.unit), True, float(res.fun) * model.unit)
    if dual is None or not math.isfinite(dual):
        log.warning("MILP: %s; the cut bound after probing only", res.message)
        return MilpBound(cut_bound, False, None)
    log.info("MILP stopped (%s): dual bound %.6g", res.message, dual)
    return MilpBound(max(cut_bound, float(dual) * model.unit), False,
                     None if res.x is None else float(res.fun) * model.unit)
