"""The LP / MILP with the inequalities near the floor (``lp.Families``): on every small graph of
the tests, from the floor to in-core, they stay below the brute-force optimum, never below the
model without them, and at the floor they close the gap the model without them left."""
from __future__ import annotations

import math

import pytest

from fxpooch.planners import Evaluator
from fxpooch.planners.bounds import Bounds
from test_search import GRAPHS, at_fraction, brute_force, problem

pytest.importorskip("scipy")
from fxpooch.planners.lp import Families, relaxation, solve  # noqa: E402

WITHOUT = Families(cut_ends=False, streams=False, chain_reads=False, head_reads=False)
#: HiGHS stops a MILP within a relative gap of 1e-4: its dual bound may lie that far below its optimum
MIP_GAP = 1e-4
FRACTIONS = (0.3, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 1.0)  # of the in-core peak
POINTS = (0.0, 0.25, 0.5, 1.0)  # from the floor (0) to in-core (1)


def _rows():
    for name in sorted(GRAPHS):
        for fraction in FRACTIONS:
            yield name, fraction, lambda name=name, fraction=fraction: at_fraction(*GRAPHS[name](), fraction)
    for hardware in ("v100-pcie3", "v100-nvlink2", "h100-pcie5"):
        for point in POINTS:
            yield f"mlp {hardware}", point, lambda hardware=hardware, point=point: problem("mlp", point, hardware)


def _bounds(prob, families: Families) -> tuple[float, float]:
    """(LP, MILP dual bound) of the model with ``families``, in seconds (infinite: none fits)."""
    bounds = Bounds(Evaluator(prob))
    if bounds.bound() == math.inf:
        return math.inf, math.inf
    model = relaxation(bounds, families)
    out = []
    for integral in (False, True):
        res = solve(model, integral=integral)
        out.append(math.inf if res.status == 2 else (res.mip_dual_bound if integral else res.fun) * model.unit)
    return out[0], out[1]


#: the lowest limit of each graph above where a plan fits: the MILP without the new inequalities,
#: as a fraction of the optimum (with them: the optimum)
FLOOR = {
    ("branchy", 0.85): 0.9615,
    ("chain4-slow", 0.5): 0.9130,
    ("chain5-fast", 0.45): 0.9524,
    ("chain6-mixed", 0.45): 0.8913,
    ("mlp v100-pcie3", 0.0): 0.9740,
    ("mlp h100-pcie5", 0.0): 0.9536,
}


@pytest.mark.parametrize("name, fraction, make", list(_rows()), ids=lambda v: str(v) if not callable(v) else "")
def test_bounds_below_the_optimum_and_tighter(name, fraction, make):
    prob = make()
    optimum = min(brute_force(prob).values(), default=math.inf)
    old_lp, old_milp = _bounds(prob, WITHOUT)
    lp, milp = _bounds(prob, Families())
    assert lp >= old_lp * (1 - 1e-9) and milp >= old_milp * (1 - MIP_GAP)  # only rows added
    if optimum == math.inf:
        return
    assert lp <= milp * (1 + 1e-9) and milp <= optimum * (1 + 1e-9)
    # on every row here the MILP now meets the optimum (within HiGHS's gap)
    assert milp >= optimum * (1 - MIP_GAP)
    if (name, fraction) in FLOOR:
        assert old_milp / optimum == pytest.approx(FLOOR[(name, fraction)], abs=1e-4)
