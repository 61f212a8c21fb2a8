"""Probing (``fxpooch.planners.probing``): a decision it rules out is taken by no fitting plan
(brute force over every decision vector is the oracle), and ruling it out lifts the LP."""
from __future__ import annotations

import math

import pytest

from fxpooch.planners import Evaluator, Problem
from fxpooch.planners.bounds import Bounds
from fxpooch.schedule import Decision
from stepgraphs import DROPOUT, build, dropout_drawn_only
from test_search import FRACTIONS, GRAPHS, at_fraction, brute_force, problem

pytest.importorskip("scipy")
from fxpooch.planners.lp import CORE, CUT_CHAINS, LARGE, PROBING, Families, lp_lower_bound, probed_relaxation, relaxation, solve  # noqa: E402
from fxpooch.planners.lpmodel import ModelTooLarge  # noqa: E402
from fxpooch.planners.probing import probe  # noqa: E402


def _ruled_out(prob, families: Families = PROBING) -> list[int]:
    """The activations whose recompute probing rules out (on ``families``' model)."""
    bounds = Bounds(Evaluator(prob))
    model = relaxation(bounds, families)
    fixed = set(probe(model, bounds))
    return sorted(a for (_, a), j in model.decisions.items() if j in fixed)


def _rows():
    for name in sorted(GRAPHS):
        for fraction in FRACTIONS:
            yield name, fraction, lambda name=name, fraction=fraction: at_fraction(*GRAPHS[name](), fraction)
    for hardware in ("v100-pcie3", "h100-pcie5"):
        for point in (0.0, 0.5):
            yield f"mlp {hardware}", point, lambda hardware=hardware, point=point: problem("mlp", point, hardware)


#: the recomputes probing rules out where it rules out any
RULED_OUT = {
    ("branchy", 0.75): [0, 1, 2, 3],  # no plan fits
    ("chain6-mixed", 0.45): [1, 2],
    ("mlp v100-pcie3", 0.0): [0, 1, 2],
    ("mlp h100-pcie5", 0.0): [0, 1, 2],
}


@pytest.mark.parametrize("name, fraction, make", list(_rows()), ids=lambda v: str(v) if not callable(v) else "")
def test_no_fitting_plan_takes_a_ruled_out_decision(name, fraction, make):
    prob = make()
    fitting = brute_force(prob)
    if Bounds(Evaluator(prob)).bound() == math.inf:  # the cut bound already says none fits
        assert not fitting
        return
    ruled_out = _ruled_out(prob)
    for decisions in fitting:
        assert not [a for a in ruled_out if decisions[a] is Decision.RECOMPUTE], decisions
    assert ruled_out == RULED_OUT.get((name, fraction), [])


#: the rows where the cut bound rises once probing's recomputes are ruled out (``Bounds(not_recomputed=...)``)
CUT_LIFTED = {("branchy", 0.75), ("mlp v100-pcie3", 0.0), ("mlp h100-pcie5", 0.0)}


@pytest.mark.parametrize("name, fraction, make", list(_rows()), ids=lambda v: str(v) if not callable(v) else "")
def test_the_cut_bound_without_the_ruled_out_recomputes_stays_below_the_optimum(name, fraction, make):
    """The cut bound with probing's ruled-out recomputes taken as not recomputable: no lower than
    the cut bound, no higher than the fastest fitting plan (infinite where none fits: branchy at
    0.75, where the cut bound alone says 11.75), and what ``lp_lower_bound`` never goes under."""
    prob = make()
    optimum = min(brute_force(prob).values(), default=math.inf)
    cut = Bounds(Evaluator(prob)).bound()
    probed = Bounds(Evaluator(prob), frozenset(_ruled_out(prob))).bound()
    assert cut <= probed <= optimum * (1 + 1e-12)
    assert (probed > cut) == ((name, fraction) in CUT_LIFTED)
    lp = lp_lower_bound(Evaluator(prob))
    assert probed <= lp * (1 + 1e-9) and lp <= optimum * (1 + 1e-9)


def _attention():
    """An attention head in miniature: the query and key (drawn by dropouts: not recomputable), the
    scores made from them (not saved), the softmax ``p`` and the dropout output ``o`` made from the
    scores. The backward reads ``o`` first, then ``p`` (the softmax's backward), then the query and
    key (the scores' matmul backward). A chain that rebuilds ``p`` or ``o`` reads the query and key,
    which then stay on the device through ``p``'s backward, where the limit has no room for them."""
    graph, costs = build([("q", ["x"], 1, 1, DROPOUT), ("k", ["x"], 1, 1, DROPOUT), ("s", ["q", "k"], 1, 1),
                          ("p", ["s"], 1, 4), ("o", ["s"], 1, 4), ("loss", ["o", "p"], 0.5, 0)],
                         [("go", ["o"], 1), ("gp", ["p"], 1), ("gs", ["q", "k"], 1)],
                         {"q": (2, 2), "k": (2, 2), "p": (4, 4), "o": (4, 4)}, grad_mib=4)
    graph = dropout_drawn_only(graph)
    ev = Evaluator(Problem(graph, costs, 2**40))
    return graph, costs, ev.floor().timeline.static_peak_bytes, ev.evaluate(ev.all_keep()).timeline.peak_bytes


@pytest.mark.parametrize("point", [0.0, 0.5])
def test_a_recompute_whose_chain_reads_swaps_is_ruled_out_where_they_do_not_fit_after_its_reader(point):
    """Floor 12 MiB, in-core 14: at ``p``'s backward the limit holds ``p``, two 4 MiB gradients
    and at most 1 MiB more, not the query and key a chain read. The point is after the chain's
    reader: probing without the chain reads (``Families.none()``) rules nothing out."""
    graph, costs, floor, in_core = _attention()
    assert (floor, in_core) == (12 * 2**20, 14 * 2**20)
    prob = Problem(graph, costs, int(floor + point * (in_core - floor)))
    names = [act.name for act in graph.activations]
    assert names == ["q", "k", "p", "o"]
    assert [names[a] for a in _ruled_out(prob)] == ["p", "o"]
    assert _ruled_out(prob, Families.none()) == []
    fitting = brute_force(prob)
    assert fitting and not [d for d in fitting if Decision.RECOMPUTE in d]


@pytest.mark.parametrize("hardware, before", [("v100-pcie3", 0.6444), ("h100-pcie5", 0.7117)])
def test_probing_lifts_the_lp_to_the_optimum_at_the_mlp_floor(hardware, before):
    """The MLP at its floor: only swaps fit the first two ReLUs (a recompute's chain needs an extra
    4 MiB while it runs, a keep more than the limit), and the fastest plan keeps the last one.
    The LP without ``rebuild_swaps`` recomputes a part of the first ReLU, which needs only that
    part of the chain's memory; probing rules that recompute out, and the LP meets the optimum.
    With ``rebuild_swaps`` (the swap the chain reads is on the device while it runs) the LP meets
    it unprobed."""
    prob = problem("mlp", 0.0, hardware)
    optimum = min(brute_force(prob).values())
    bounds = Bounds(Evaluator(prob))
    model = relaxation(bounds, Families(rebuild_swaps=False))
    assert solve(model).fun * model.unit / optimum == pytest.approx(before, abs=1e-4)
    assert probed_relaxation(bounds, Families(rebuild_swaps=False)).hi != model.hi  # a recompute ruled out
    model = relaxation(bounds)
    assert solve(model).fun * model.unit == pytest.approx(optimum, rel=1e-9)
    assert lp_lower_bound(Evaluator(prob)) == pytest.approx(optimum, rel=1e-9)


def test_a_model_past_its_nonzeros_falls_back_to_the_families_that_scale():
    prob = problem("mlp", 0.0, "v100-pcie3")
    bounds = Bounds(Evaluator(prob))
    full, chains, core, large = (relaxation(bounds, f).nonzeros for f in (Families(), CUT_CHAINS, CORE, LARGE))
    assert large < chains < core < full
    assert [probed_relaxation(bounds, max_nonzeros=size).nonzeros for size in (full, full - 1, chains - 1)] == [
        full, chains, large]  # CORE, larger than CUT_CHAINS here, passes chains - 1 too
    with pytest.raises(ModelTooLarge, match=f"more than {large - 1} nonzeros"):
        probed_relaxation(bounds, max_nonzeros=large - 1)


def test_the_fallback_for_large_graphs_keeps_only_the_cuts():
    """:data:`LARGE`'s points are ``bounds``' cuts alone: no timing cut, no rebuild point."""
    bounds = Bounds(Evaluator(problem("mlp", 0.0, "v100-pcie3")))
    cuts = {c.op for c in bounds.cuts}
    assert _point_ops(bounds, LARGE) == cuts
    assert _point_ops(bounds, CORE) - cuts  # the points it leaves out


def _point_ops(bounds, families) -> set[int]:
    """The ops of the points of the model with ``families`` (each point's rows carry its op)."""
    return {op for op in relaxation(bounds, families).row_ops if op is not None}


def test_the_exact_search_lp_after_probing_bounds_the_undecided_at_the_optimum():
    """``FixedBound(probed=True)``, what the exact search prunes with: at the MLP's floor, nothing
    decided, it meets the optimum, as the LP without probing now does too (it was 36% below
    before ``rebuild_swaps``); a ruled-out recompute decided is infeasible either way: probing's
    model is a relaxation of the LP's."""
    from fxpooch.planners.fixed import FixedBound

    prob = problem("mlp", 0.0, "v100-pcie3")
    optimum = min(brute_force(prob).values())
    bounds = Bounds(Evaluator(prob))
    probed, bare = FixedBound(bounds, probed=True), FixedBound(bounds)
    assert probed.bound([None] * 3) == pytest.approx(optimum, rel=1e-5)
    assert bare.bound([None] * 3) == pytest.approx(optimum, rel=1e-5)
    assert probed.bound([Decision.RECOMPUTE, None, None]) == bare.bound([Decision.RECOMPUTE, None, None]) == math.inf


def test_the_exact_search_builds_no_lp_past_its_nonzeros(monkeypatch):
    """Past ``lp.MAX_NONZEROS`` the exact search has no LP / MILP bound or seed (its root MILP is
    outside any budget of work there), and still ends at the optimum on the MLP's floor, by the
    simulator and the cut bounds alone."""
    from fxpooch.planners import search
    from fxpooch.planners.search import SearchOptions, exact_search, fixed_bound

    prob = problem("mlp", 0.0, "v100-pcie3")
    optimum = min(brute_force(prob).values())
    assert fixed_bound(Bounds(Evaluator(prob))) is not None
    monkeypatch.setattr(search, "MAX_NONZEROS", 1)
    assert fixed_bound(Bounds(Evaluator(prob))) is None
    out = exact_search(prob, SearchOptions(lp_bounds=True))
    assert out.proved and out.best.step_time == pytest.approx(optimum, rel=1e-12)
