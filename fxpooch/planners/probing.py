"""Probing: the recomputes no fitting plan can take, found by LP, and ruled out before the bound.

Every fitting plan is a feasible point of :func:`.lp.relaxation`'s model with its decisions
integral. So where the model cannot reach ``x_a^r = 1``, no fitting plan recomputes ``a``, and
``x_a^r = 0`` holds for all of them: fixing it keeps the bound a bound. Near the floor that is most
of the LP's gap. The LP recomputes 80% of an attention's 384 MiB softmax output, which needs only
80% of the memory its chain takes at its rebuild point; no plan recomputes it whole (HF GPT-2 at
2 layers at its PCIe3 floor: after probing the LP rises from 1.065x to 1.426x in-core, the best
plan known is 1.493x).

A probe maximises ``x_a^r`` over a smaller model still (``lp.PROBING``: its points' memory, the
recomputed activations' rebuilds and the swaps their chains read, no timing), with only the rows
of the points at the ``window`` ops either side of ``a``'s first reader and the rows of no point
(fewer rows: a relaxation, so a maximum below 1 still rules the recompute out). Its points do not
grow in number with the graph, and the memory that keeps a recompute out is near where it runs:
before its reader (the chain's own buffers), or just after it, where what its chain read must
still be on the device (HF GPT-2's attention dropout output: its chain reads the query and the
key, read again by the backward of the matmul that made the scores, after the softmax's backward).
A fix may rule out another recompute, so the rounds repeat until one fixes nothing.

HiGHS's tolerances are absolute and the memory rows are in bytes: the probes solve the model with
every right-hand side loosened by ``LOOSEN`` of itself, a relaxation, so that a plan exactly at the
limit is never judged infeasible by a rounding error.
"""
from __future__ import annotations

import logging

from .bounds import Bounds
from .lpmodel import Model

log = logging.getLogger("fxpooch.planner.probing")

#: a probe has the points at this many ops before the first reader, at it and after it (HF
#: GPT-2 rules out its attention softmaxes' recomputes within 10 ops before, its dropout
#: outputs' within 8 after)
WINDOW = 16
#: relative amount every right-hand side is loosened by in a probe
LOOSEN = 1e-6
#: a probe's maximum below this rules the recompute out
ONE = 1 - 1e-6


def probe(model: Model, bounds: Bounds, window: int = WINDOW) -> list[int]:
    """The recompute variables ``x_a^r`` of ``model`` (built by :func:`.lp.relaxation` for
    ``bounds``) that are below 1 at every feasible point: their upper limit in ``model.hi`` is set
    to 0 and they are returned, in the order found."""
    import numpy as np
    from scipy.optimize import Bounds as VarBounds, LinearConstraint, milp

    _, a_ub, b_ub, a_eq, b_eq, lo, hi = model.matrices()
    b_ub = b_ub + LOOSEN * np.maximum(1.0, np.abs(b_ub))
    eq_slack = LOOSEN * np.maximum(1.0, np.abs(b_eq))
    eq_cols = a_eq.tocsc()
    row_ops = np.asarray([-1 if op is None else op for op in model.row_ops])
    shared = row_ops < 0
    first_reader = bounds.first_reader
    probes = [(j, first_reader[a]) for (d, a), j in sorted(model.decisions.items(), key=lambda t: t[0][1])
              if d == "r" and first_reader[a] is not None]
    fixed: list[int] = []
    solves = 0
    while True:
        found = []
        for j, reader in probes:
            if hi[j] == 0:
                continue
            rows = np.flatnonzero(shared | ((row_ops >= reader - window) & (row_ops <= reader + window)))
            below = a_ub[rows]
            cols, eqs = _closure(below, a_eq, eq_cols, j)
            at = np.searchsorted(cols, j)  # x_a^r's column in the probe
            cost = np.zeros(len(cols))
            cost[at] = -1.0
            res = milp(cost, bounds=VarBounds(lo[cols], hi[cols]), constraints=[
                LinearConstraint(below[:, cols], -np.inf, b_ub[rows]),
                LinearConstraint(a_eq[eqs][:, cols], b_eq[eqs] - eq_slack[eqs], b_eq[eqs] + eq_slack[eqs])])
            solves += 1
            if res.status == 2 or (res.status == 0 and res.x[at] < ONE):
                hi[j] = 0.0
                found.append(j)
        fixed += found
        if not found:
            break
    for j in fixed:
        model.hi[j] = 0.0
    log.info("probing: %d recomputes ruled out in %d LPs", len(fixed), solves)
    return fixed


def _closure(below, a_eq, eq_cols, j: int):
    """The columns of a probe's model (sorted) and its equality rows: the variables of the rows
    ``below`` and ``j``, and, in turn, the equality rows any of them is in and their variables.
    Every other variable is in no row of the probe: dropping it leaves the same maximum."""
    import numpy as np

    keep = np.zeros(a_eq.shape[1], dtype=bool)
    keep[below.indices] = True
    keep[j] = True
    while True:
        eqs = np.unique(eq_cols[:, np.flatnonzero(keep)].indices)
        more = a_eq[eqs].indices
        if keep[more].all():
            return np.flatnonzero(keep), eqs
        keep[more] = True
