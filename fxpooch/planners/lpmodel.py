"""The linear program :mod:`.lp` builds, as plain rows: ``min c·v`` over ``A_ub v <= b_ub``,
``A_eq v = b_eq``, ``lo <= v <= hi``, each row tagged with the op of the point that added it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


#: a row with a coefficient above this (bytes, or a big-M) is divided by its largest one
BYTES = 1024.0


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
