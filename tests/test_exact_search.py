"""The budgeted exact search and the LP with fixed decisions it prunes with: on every small graph
of test_search (brute force over every decision vector is the oracle) the search returns the
optimum and proves it, and, stopped at any budget, its proved bound never exceeds the optimum."""
from __future__ import annotations

import math
import random

import pytest

from fxpooch.planners import Evaluator
from fxpooch.planners.bounds import Bounds
from fxpooch.planners.search import SearchOptions, exact_search
from fxpooch.schedule import Decision
from test_search import FRACTIONS, GRAPHS, at_fraction, brute_force

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE
OPTIONS = {  # the cut bounds only; the LP at each node and the MILP's point as a seed
    "cuts": SearchOptions(lp_bounds=False, milp_nodes=0),
    "lp": SearchOptions(lp_bounds=True),
}


def _instances(name: str):
    graph, costs = GRAPHS[name]()
    for fraction in (*FRACTIONS, 0.5):
        prob = at_fraction(graph, costs, fraction)
        yield fraction, prob, min(brute_force(prob).values(), default=math.inf)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_exact_search_proves_the_brute_force_optimum(name, options):
    if options == "lp":
        pytest.importorskip("scipy")
    for fraction, prob, optimum in _instances(name):
        full = exact_search(prob, OPTIONS[options])
        assert full.proved, fraction
        if optimum == math.inf:
            assert full.best is None and full.bound == math.inf
            continue
        assert full.best.fits and full.best.timeline.peak_bytes <= prob.mem_limit
        assert full.best.step_time == pytest.approx(optimum, rel=1e-12), fraction
        assert full.bound == full.best.step_time and full.gap == 0.0
        for work in sorted({1, full.work // 3, 2 * full.work // 3, full.work - 1}):
            part = exact_search(prob, OPTIONS[options], work=work)
            assert part.bound <= optimum * (1 + 1e-12), (fraction, work)
            assert part.best is not None and part.best.step_time >= optimum * (1 - 1e-12)
            assert part.best.step_time >= part.bound
            if part.proved:
                assert part.best.step_time == pytest.approx(optimum, rel=1e-12)


@pytest.mark.parametrize("probed", [False, True], ids=["", "probed"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_fixed_lp_bound_stays_below_every_completion(name, probed):
    pytest.importorskip("scipy")
    from fxpooch.planners.fixed import FixedBound

    rng = random.Random(0)
    graph, costs = GRAPHS[name]()
    for fraction in FRACTIONS:
        prob = at_fraction(graph, costs, fraction)
        times = brute_force(prob)
        bounds = Bounds(Evaluator(prob))
        if bounds.bound() == math.inf:
            continue
        fixed = FixedBound(bounds, probed)
        for _ in range(30):
            partial = [rng.choice([None, K, S, R]) for _ in graph.activations]
            partial = [None if d is S and not a.swappable else d for d, a in zip(partial, graph.activations)]
            best = min((t for d, t in times.items() if all(p is None or p is x for p, x in zip(partial, d))),
                       default=math.inf)
            assert fixed.bound(partial) <= best * (1 + 1e-12), partial
        milp_bound, point = fixed.milp([None] * len(graph.activations), node_limit=100)
        assert milp_bound <= min(times.values(), default=math.inf) * (1 + 1e-12)
        assert point is None or len(point) == len(graph.activations)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_budget_counts_every_bound_so_it_bounds_the_time(name, monkeypatch):
    """Most children are cut by a bound without a simulation, so a budget of simulations alone
    leaves the time unbounded: every bound evaluated is work, and a stopped search overshoots its
    budget by at most one node's children (a bound, a keep completion and an LP each)."""
    import fxpooch.planners.search as search

    calls = []

    class Counted(Bounds):
        def bound(self, decided=None):
            calls.append(1)
            return super().bound(decided)

    monkeypatch.setattr(search, "Bounds", Counted)
    graph, costs = GRAPHS[name]()
    for fraction in FRACTIONS:
        prob = at_fraction(graph, costs, fraction)
        seeded = exact_search(prob, OPTIONS["cuts"], work=0).work  # the seeds and the root's bound
        full = exact_search(prob, OPTIONS["cuts"])
        for work in sorted({full.work // 2, full.work - 1}):
            calls.clear()
            part = exact_search(prob, OPTIONS["cuts"], work=work)
            assert part.work >= len(calls), (fraction, work)
            assert part.work <= max(work, seeded) + 3 * len(Decision), (fraction, work)


@pytest.mark.parametrize("bound_work", [1, 4])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_a_bound_counts_bound_work_units(name, bound_work):
    """``local`` counts a bound as the simulations that take its time: the search's work is its
    simulations plus ``bound_work`` per bound, and a stopped search overshoots by one node's
    children at most."""
    from fxpooch.planners.branch import BranchAndBound

    graph, costs = GRAPHS[name]()
    for fraction in FRACTIONS:
        ev = Evaluator(at_fraction(graph, costs, fraction))
        bounds = Bounds(ev)
        search = BranchAndBound(ev, bounds, None, bound_work=bound_work)
        out = search.run(stop_at=60)
        assert out.work == ev.simulations + bound_work * bounds.evaluations, fraction
        assert out.proved or out.work <= 60 + len(Decision) * (bound_work + 1), fraction
