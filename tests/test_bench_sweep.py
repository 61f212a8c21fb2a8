"""benchmarks/planners_sweep.py's bookkeeping: the bound and best plan of a sweep row, with what the
gap table proved for the same problem (hand-written rows; nothing is planned here)."""
from __future__ import annotations

import json

import pytest

from planners_sweep import EXACT, LONG, LONGER, commands_after, gap_table_columns, gaps, summary, with_gap_table

KEY = {"model": "m", "hardware": "h", "point": 0.0, "ops": 90, "activations": 12, "fraction": 0.4}


def sweep_row(local: float, bound: float | None, kind: str = "lp", **others) -> dict:
    row = {**KEY, "local": local, "pooch": None, "swap-all": None, "checkpoint": None, "checkpoint-all": None,
           LONG: None, "bound": bound, "bound_kind": kind, "worse_than_reference": [], **others}
    return row


def gap_row(**values) -> dict:
    return {**KEY, "cut": 1.0, "lp": 1.1, "milp": None, "exact_bound": None, "exact_best": None, **values}


@pytest.mark.parametrize("gap, expected", [
    (gap_row(milp=1.3), (1.3, "milp", None)),  # the highest proved bound, and which one
    (gap_row(milp=1.3, exact_bound=1.35, exact_best=1.4), (1.35, EXACT, 1.4)),
    (gap_row(), (1.1, "lp", None)),
    (gap_row(milp=1.3, fraction=0.41), (None, None, None)),  # another limit: another problem
    (gap_row(milp=1.3, ops=91), (None, None, None)),  # another graph
])
def test_gap_table_columns_only_from_the_same_problem(gap, expected):
    got = gap_table_columns(sweep_row(1.5, 1.2), [gap])
    assert (got["gap_table_bound"], got["gap_table_bound_kind"], got[EXACT]) == expected


@pytest.mark.parametrize("row, best, bound, kind, gap_to_best, gap_to_bound", [
    # the sweep's own bound where the gap table has none
    (sweep_row(1.5, 1.2, gap_table_bound=None, gap_table_bound_kind=None), 1.5, 1.2, "lp", 0.0, 0.25),
    # the gap table's where higher; its exact plan is the best
    (sweep_row(1.5, 1.2, gap_table_bound=1.25, gap_table_bound_kind="milp", **{EXACT: 1.25}),
     1.25, 1.25, "milp", 0.2, 0.2),
    # the sweep's own where the gap table's is lower
    (sweep_row(1.5, 1.2, gap_table_bound=1.1, gap_table_bound_kind="cut"), 1.5, 1.2, "lp", 0.0, 0.25),
    # the longer searches' plans count among the best, each where it ran
    (sweep_row(1.5, 1.2, **{LONG: 1.44}), 1.44, 1.2, "lp", 1.5 / 1.44 - 1, 0.25),
    (sweep_row(1.5, 1.2, **{LONG: 1.44, LONGER: 1.35}), 1.35, 1.2, "lp", 1.5 / 1.35 - 1, 0.25),
    (sweep_row(1.5, 1.2, **{LONG: 1.44, LONGER: None}), 1.44, 1.2, "lp", 1.5 / 1.44 - 1, 0.25),
])
def test_gaps_to_the_best_plan_and_the_best_bound(row, best, bound, kind, gap_to_best, gap_to_bound):
    got = gaps(row)
    assert (got["best"], got["best_bound"], got["best_bound_kind"]) == (best, bound, kind)
    assert got["gap_to_best"] == pytest.approx(gap_to_best) and got["gap_to_bound"] == pytest.approx(gap_to_bound)


def test_with_gap_table_makes_a_bound_tight(tmp_path):
    """A row whose own bound is 25% below its best plan (not tight) is tight once the gap table's
    MILP, 1.4, is read; the sweep's own bound stays in the row."""
    path = tmp_path / "planners.json"
    path.write_text(json.dumps({"rows": [gap_row(milp=1.4)]}))
    rows = [sweep_row(1.5, 1.2)]
    rows[0].update(gaps(rows[0]))
    assert summary(rows)["rows_with_tight_bound"] == 0
    rows = with_gap_table(rows, str(path))
    assert rows[0]["bound"] == 1.2 and rows[0]["best_bound"] == 1.4
    s = summary(rows)
    assert s["rows_with_tight_bound"] == 1 and s["worst_gap_to_tight_bound"] == pytest.approx(1.5 / 1.4 - 1)
    assert with_gap_table(rows, str(tmp_path / "missing.json"))[0]["best_bound"] == 1.2  # no gap table: its own


def gap_table_row(**values) -> dict:
    return {"pooch": 1.3, "superneurons": None, "local": 1.2, "cut": 1.0, "lp": None, "milp": None,
            "exact_bound": None, "exact_best": None, "optimum": None, "optimum_from": None, **values}


@pytest.mark.parametrize("row, optimum, best_known", [
    (gap_table_row(milp=1.2), 1.2, 1.2),  # local's plan meets the MILP's bound
    (gap_table_row(milp=1.1, exact_best=1.1), 1.1, 1.1),  # so does the exact search's, faster
    (gap_table_row(milp=1.1, exact_best=1.15), None, 1.15),  # none does: open
    (gap_table_row(milp=1.1, exact_best=1.1, optimum=1.1, optimum_from="exact"), 1.1, 1.1),
])
def test_the_gap_tables_optimum_is_a_plan_meeting_a_proved_bound(row, optimum, best_known):
    """benchmarks/planners.py's gap table: a plan, a planner's or the exact search's, that meets
    the highest proved bound is the optimum."""
    from planners import gaps as gap_table_gaps
    gap_table_gaps(row, ("pooch", "superneurons", "local"))
    assert (row["optimum"], row["best_known"]) == (optimum, best_known)
    assert row["local_gap"] == (None if optimum is None else pytest.approx(100 * (1.2 / optimum - 1)))


@pytest.mark.parametrize("saved, command, whole, expected", [
    (["sweep", "sweep-long"], "sweep", True, ["sweep"]),  # a whole sweep makes every row again
    (["sweep", "sweep-long"], "sweep --models a", False, ["sweep", "sweep-long", "sweep --models a"]),
    (["sweep", "sweep-long", "sweep --models a"], "sweep-long", False, ["sweep", "sweep --models a", "sweep-long"]),
    ([], "sweep-summary", False, ["sweep-summary"]),
])
def test_the_commands_that_made_the_rows_in_the_order_they_ran(saved, command, whole, expected):
    assert commands_after(saved, command, whole) == expected
