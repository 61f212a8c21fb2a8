"""Probing: the decisions no fitting plan can take, found by LP, and fixed before the bound.

Every fitting plan is a feasible point of :func:`.lp.relaxation`'s model with its decisions
integral. So where the model is infeasible with ``x_a^d = 1``, no fitting plan gives ``a``
decision ``d``, and ``x_a^d = 0`` holds for all of them: fixing it keeps the bound a bound. Near
the floor that is most of the LP's gap. The LP recomputes 80% of an attention's 384 MiB softmax
output, which needs only 80% of the memory its chain takes at its rebuild point; no plan
recomputes it whole (HF GPT-2 at 2 layers at its PCIe3 floor: after probing the LP rises from
1.065x to 1.337x in-core, the best plan known is 1.493x).

A probe is an LP feasibility problem on the smallest model (``Families.none()``: its points'
memory and the recomputed activations' rebuilds, no timing families). Most probes are feasible
and need no solve of their own: one LP that maximises the sum of the unknown variables shows
every variable it takes to 1 feasible (a witness), and is repeated while it finds more. The rest
are solved one by one, each within ``seconds`` (a probe that runs out fixes nothing). A fix may
make another probe infeasible, so the rounds repeat until one fixes nothing.

HiGHS's tolerances are absolute and the memory rows are in bytes: the probes solve the model with
every right-hand side loosened by ``LOOSEN`` of itself, a relaxation, so that a plan exactly at the
limit is never judged infeasible by a rounding error.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from .bounds import Bounds
from .lp import CORE, Families, Model, ModelTooLarge, relaxation

log = logging.getLogger("fxpooch.planner.probing")

#: relative amount every right-hand side is loosened by in a probe
LOOSEN = 1e-6
#: a witness's variable at least this is taken as 1
ONE = 1 - 1e-6


class NoPlanFits(Exception):
    """The model is infeasible with no variable fixed."""


def probe(model, variables: Sequence[int], seconds: float | None = 5.0) -> list[int]:
    """The ``variables`` (binary ones of ``model``) that are 0 at every feasible point: their
    upper limit in ``model.hi`` is set to 0 and they are returned, in the order found.

    Raises :class:`NoPlanFits` where the model is infeasible as it is."""
    import numpy as np
    from scipy.optimize import Bounds as VarBounds, LinearConstraint, milp

    _, a_ub, b_ub, a_eq, b_eq, lo, hi = model.matrices()
    b_ub = b_ub + LOOSEN * np.maximum(1.0, np.abs(b_ub))
    eq_slack = LOOSEN * np.maximum(1.0, np.abs(b_eq))
    constraints = [LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(a_eq, b_eq - eq_slack, b_eq + eq_slack)]
    solves = 0

    def solve(cost, low, limit):
        nonlocal solves
        solves += 1
        options = {} if limit is None else {"time_limit": limit}
        return milp(cost, constraints=constraints, bounds=VarBounds(low, hi), options=options)

    fixed: list[int] = []
    while True:
        unknown = [j for j in variables if hi[j] > 0]
        while unknown:  # witnesses: one LP shows every variable it takes to 1 feasible
            cost = np.zeros(len(lo))
            cost[unknown] = -1.0
            res = solve(cost, lo, None)
            if res.status == 2:
                raise NoPlanFits("the model is infeasible")
            if res.status != 0:
                break
            left = [j for j in unknown if res.x[j] < ONE]
            if len(left) == len(unknown):
                break
            unknown = left
        found = []
        zero = np.zeros(len(lo))
        for j in unknown:
            low = lo.copy()
            low[j] = 1.0
            res = solve(zero, low, seconds)
            if res.status == 2:  # infeasible (a probe that ran out of time proves nothing)
                hi[j] = 0.0
                found.append(j)
        fixed += found
        log.debug("probing: %d probes solved one by one, %d fixed", len(unknown), len(found))
        if not found:
            break
    for j in fixed:
        model.hi[j] = 0.0
    log.info("probing: %d variables fixed at 0 in %d LPs", len(fixed), solves)
    return fixed


def probed_relaxation(bounds: Bounds, families: Families = Families(), max_nonzeros: int | None = None,
                      seconds: float | None = 5.0) -> Model:
    """:func:`.lp.relaxation`'s model with the decisions :func:`probe` finds impossible (a keep or a
    recompute; probed on ``Families.none()``) fixed at 0. Where the model with ``families`` would
    pass ``max_nonzeros``, the one with :data:`.lp.CORE` (the families whose size grows as the
    points times their candidates), then the probed one; :class:`ModelTooLarge` where even that
    one would.

    Raises :class:`NoPlanFits` where no plan fits the probed model."""
    n = len(bounds.ev.graph.activations)
    bare = relaxation(bounds, Families.none(), max_nonzeros)
    fixed = set(probe(bare, [j for (d, _), j in bare.decisions.items() if d in "kr" and bare.hi[j] > 0], seconds))
    impossible = [key for key, j in bare.decisions.items() if j in fixed]
    for tried in dict.fromkeys((families, CORE)):
        if tried == Families.none():
            break
        try:
            model = relaxation(bounds, tried, max_nonzeros)
        except ModelTooLarge as e:
            log.info("relaxation: %s (%d activations); fewer families", e, n)
            continue
        for key in impossible:
            model.hi[model.decisions[key]] = 0.0
        return model
    return bare
