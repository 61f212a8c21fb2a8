"""The linear program :mod:`.lp` builds, as plain rows: ``min c·v`` over ``A_ub v <= b_ub``,
``A_eq v = b_eq``, ``lo <= v <= hi``, each row tagged with the op of the point that added it; and
:func:`solve`, HiGHS on it (through ``scipy.optimize``) as an LP or a MILP."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


#: a row with a coefficient above this (bytes, or a big-M) is divided by its largest one
BYTES = 1024.0

#: nonzeros past which :func:`.lp.lp_lower_bound` and :func:`~.milp.milp_lower_bound` build a smaller
#: model (:data:`.lp.FALLBACKS`), then keep the cut bound: HiGHS's time grows much faster than the
#: model. At GPT-2 6L's PCIe3 floor (137 activations), by the simplex: 0.71M nonzeros solved in
#: 62-87 s, 1.06M in 310 s, 1.63M in 405 s, 2.0M not after 25 minutes; by the interior-point
#: method (:data:`IPM_FROM`) 0.71M in 33 s and 2.2M in 222 s, but 12.9M not in 57 minutes, and at
#: GPT-2 12L 3.6M took 1,176 s; at 2L's (49), every family, 0.54M in 42 s; at ResNet-50 b256's
#: PCIe5 floor (211), :data:`.lp.LARGE`'s 1.8M in 277 s, 1.123x in-core against the cut bound's 1.111x.
MAX_NONZEROS = 1_000_000


class ModelTooLarge(Exception):
    """The model passed its ``max_nonzeros`` while built."""


@dataclass
class Model:
    """``min c·v`` s.t. ``A_ub v <= b_ub``, ``A_eq v = b_eq``, ``lo <= v <= hi``; ``v[0]`` is T in
    seconds / ``unit``."""

    unit: float = 1.0

    cost: list[float] = field(default_factory=lambda: [1.0])
    lo: list[float] = field(default_factory=lambda: [0.0])
    hi: list[float] = field(default_factory=lambda: [math.inf])
    binary: list[bool] = field(default_factory=lambda: [False])  # integral in the MILP
    rows: list[tuple[list[tuple[int, float]], float]] = field(default_factory=list)  # sum <= rhs
    eqs: list[tuple[list[tuple[int, float]], float]] = field(default_factory=list)
    #: (decision letter ``k``/``s``/``r``, activation) -> its binary variable
    decisions: dict[tuple[str, int], int] = field(default_factory=dict)
    #: raise :class:`ModelTooLarge` once the constraints hold more nonzeros (None: no limit)
    max_nonzeros: int | None = None
    nonzeros: int = 0
    #: per ``rows`` entry, the op of the point whose loop in :func:`relaxation` added it (None:
    #: another), and the op of the point being added
    row_ops: list[int | None] = field(default_factory=list)
    op: int | None = None

    def var(self, hi: float = math.inf, binary: bool = False) -> int:
        self.cost.append(0.0)
        self.lo.append(0.0)
        self.hi.append(hi)
        self.binary.append(binary)
        return len(self.cost) - 1

    def ge(self, terms: list[tuple[int, float]], rhs: float) -> None:
        """``sum terms >= rhs``; a row with a coefficient above ``BYTES`` is divided by its largest
        one (HiGHS's tolerances are absolute)."""
        scale = max((abs(v) for _, v in terms), default=1.0)
        scale = scale if scale > BYTES else 1.0
        row = [(j, -v / scale) for j, v in terms if v]
        rhs /= scale
        self.nonzeros += len(row)
        if self.max_nonzeros is not None and self.nonzeros > self.max_nonzeros:
            raise ModelTooLarge(f"more than {self.max_nonzeros} nonzeros")
        self.rows.append((row, -rhs))
        self.row_ops.append(self.op)

    def matrices(self):
        import numpy as np
        from scipy.sparse import coo_matrix

        def sparse(rows, m):
            r, c, v = [], [], []
            for i, (terms, _) in enumerate(rows):
                for j, x in terms:
                    r.append(i)
                    c.append(j)
                    v.append(x)
            return coo_matrix((v, (r, c)), shape=(len(rows), m)).tocsr(), np.asarray([b for _, b in rows], dtype=float)

        m = len(self.cost)
        a_ub, b_ub = sparse(self.rows, m)
        a_eq, b_eq = sparse(self.eqs, m)
        return np.asarray(self.cost), a_ub, b_ub, a_eq, b_eq, np.asarray(self.lo), np.asarray(self.hi)


#: the relative gap at which HiGHS stops a MILP (its default, 1e-4, proved test:resnet_small's
#: PCIe5 floor only to 0.0001% under `local`'s plan; at 1e-6 its bound meets the plan, in the same
#: 18 CPU s): the dual bound it returns is a bound either way
MIP_REL_GAP = 1e-6
#: nonzeros from which :func:`solve` runs an LP by HiGHS's interior-point method (with crossover:
#: the same optimum, to HiGHS's tolerances) rather than by its dual simplex: the models past
#: :data:`MAX_NONZEROS` that a caller asks for. Below it neither wins everywhere: at GPT-2 6L's
#: PCIe3 floor, :data:`.lp.LARGE`'s 0.71M nonzeros in 33 CPU s against 87, but 1/4 of the way (0.61M)
#: 25 s against 11; past it the simplex stalls (:data:`.lp.CORE` at that floor, 2.2M: 222 s by the
#: interior-point method; by the simplex, an earlier CORE of 2.0M was not solved in 25 minutes)
IPM_FROM = MAX_NONZEROS + 1


def solve(model: Model, integral: bool = False, time_limit: float | None = None, ipm_from: int = IPM_FROM):
    """HiGHS on ``model`` as an LP (by the interior-point method from ``ipm_from`` nonzeros on),
    or as a MILP with its binary variables integral (stopped within :data:`MIP_REL_GAP`)."""
    import numpy as np
    from scipy.optimize import Bounds as VarBounds, LinearConstraint, linprog, milp

    c, a_ub, b_ub, a_eq, b_eq, lo, hi = model.matrices()
    if not integral:
        method = "highs-ipm" if model.nonzeros >= ipm_from else "highs"
        return linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=list(zip(lo, hi)), method=method)
    options = {"mip_rel_gap": MIP_REL_GAP} | ({} if time_limit is None else {"time_limit": time_limit})
    return milp(c, constraints=[LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(a_eq, b_eq, b_eq)],
                integrality=np.asarray(model.binary, dtype=int), bounds=VarBounds(lo, hi), options=options)
