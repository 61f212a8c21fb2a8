"""The LP / MILP of :mod:`.lp` with some decisions fixed: a bound on every completion of a
partial plan, what the exact search prunes with on mid-size graphs.

Every fitting plan that agrees with a partial plan is a feasible point of :func:`.lp.relaxation`'s
model with the decided activations' variables fixed (``x_a^d = 1`` for the decision ``d``), so
the model's minimum over those points, or any lower bound on it (an LP's optimum, a MILP's dual
bound), bounds every completion. The model is built once per problem; each bound only changes
the variables' limits. HiGHS's tolerances are absolute (the times are in units of the step's
compute, about 1): a bound is lowered by ``SLACK`` of itself so that a rounding error in the
solver never cuts a subtree that holds the optimum.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..schedule import Decision
from .bounds import Bounds

log = logging.getLogger("fxpooch.planner.fixed")

#: relative amount taken off every solved bound (HiGHS's feasibility tolerance is 1e-7, absolute,
#: on times of about 1)
SLACK = 1e-6
_LETTER = {Decision.KEEP: "k", Decision.SWAP: "s", Decision.RECOMPUTE: "r"}


class FixedBound:
    """Per problem: :func:`.lp.relaxation`'s model, solved with a partial plan's decisions fixed.

    ``probed``: the recomputes :mod:`.probing` rules out are fixed at 0 too (every fitting plan
    leaves them out, so the bounds stay bounds, tighter near the floor; the model may then be a
    smaller one, :func:`.lp.probed_relaxation`). :class:`~.lpmodel.ModelTooLarge` past
    ``max_nonzeros``. ``solves`` counts the LPs and MILPs run (a
    search's work). Raises ImportError without scipy."""

    def __init__(self, bounds: Bounds, probed: bool = False, max_nonzeros: int | None = None):
        import numpy as np
        import scipy.optimize  # noqa: F401  (ImportError here, not at the first bound)

        from .lp import probed_relaxation, relaxation

        self.model = (probed_relaxation(bounds, max_nonzeros=max_nonzeros) if probed
                      else relaxation(bounds, max_nonzeros=max_nonzeros))
        c, a_ub, b_ub, a_eq, b_eq, lo, hi = self.model.matrices()
        self._c, self._a_ub, self._b_ub, self._a_eq, self._b_eq = c, a_ub, b_ub, a_eq, b_eq
        self._lo, self._hi = lo, hi
        self._binary = np.asarray(self.model.binary, dtype=int)
        self.solves = 0

    def _limits(self, decided: Sequence[Decision | None]):
        lo, hi = self._lo.copy(), self._hi.copy()
        for a, d in enumerate(decided):
            if d is None:
                continue
            for letter in "ksr":
                j = self.model.decisions[(letter, a)]
                if letter == _LETTER[d]:
                    if hi[j] < 1.0:
                        return None  # the model cannot take this decision (no completion realises it)
                    lo[j] = 1.0
                else:
                    hi[j] = 0.0
        return lo, hi

    def bound(self, decided: Sequence[Decision | None]) -> float:
        """The LP's bound on the step time of every fitting completion of ``decided`` (infinite:
        none fits; 0 where HiGHS fails)."""
        from scipy.optimize import linprog

        limits = self._limits(decided)
        if limits is None:
            return math.inf
        self.solves += 1
        res = linprog(self._c, A_ub=self._a_ub, b_ub=self._b_ub, A_eq=self._a_eq, b_eq=self._b_eq,
                      bounds=list(zip(*limits)), method="highs")
        if res.status == 2:
            return math.inf
        if res.status != 0:
            log.info("fixed LP: %s; no bound", res.message)
            return 0.0
        return float(res.fun) * self.model.unit * (1 - SLACK)

    def milp(self, decided: Sequence[Decision | None], node_limit: int) -> tuple[float, list[Decision] | None]:
        """The MILP's dual bound over the completions of ``decided`` after at most ``node_limit``
        of HiGHS's nodes (a count, so the same on every machine), and the decisions of the best
        point it found (None: none). The point is the model's, not the simulator's: a plan to try."""
        import numpy as np
        from scipy.optimize import Bounds as VarBounds, LinearConstraint, milp

        limits = self._limits(decided)
        if limits is None:
            return math.inf, None
        self.solves += 1
        res = milp(self._c, constraints=[LinearConstraint(self._a_ub, -np.inf, self._b_ub),
                                         LinearConstraint(self._a_eq, self._b_eq, self._b_eq)],
                   integrality=self._binary, bounds=VarBounds(*limits), options={"node_limit": node_limit})
        if res.status == 2:
            return math.inf, None
        dual = getattr(res, "mip_dual_bound", None)
        bound = float(dual) * self.model.unit * (1 - SLACK) if dual is not None and math.isfinite(dual) else 0.0
        if res.x is None:
            return bound, None
        value = {letter: d for d, letter in _LETTER.items()}
        return bound, [value[max("ksr", key=lambda letter: res.x[self.model.decisions[(letter, a)]])]
                       for a in range(len(decided))]
