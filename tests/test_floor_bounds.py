"""The LP / MILP with the inequalities near the floor (``lp.Families``): on every small graph of
the tests, from the floor to in-core, they stay below the brute-force optimum, never below the
model without them, and at the floor they close the gap the model without them left. The model
a large graph falls back to (``lp.LARGE``: fewer families and points; ``lp.CUT_CHAINS``, LARGE's
with the chains' work) is never above them."""
from __future__ import annotations

import math

import pytest

from fxpooch.planners import Evaluator, Problem
from fxpooch.planners.bounds import Bounds, Cut, _new_highs
from fxpooch.schedule import Decision
from stepgraphs import CONV, MiB, build
from test_search import GRAPHS, at_fraction, brute_force, problem

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE

pytest.importorskip("scipy")
from fxpooch.planners.lp import CUT_CHAINS, LARGE, Families, relaxation, solve  # noqa: E402

WITHOUT = Families(cut_ends=False, streams=False, chain_reads=False, head_reads=False, chain_work=False)
#: HiGHS stops a MILP within a relative gap (``lp.MIP_REL_GAP``) and an absolute one: its dual
#: bound may lie below its optimum, by less than this
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
    large_lp, large_milp = _bounds(prob, LARGE)
    assert large_lp <= lp * (1 + 1e-9) and large_milp <= milp * (1 + MIP_GAP)  # rows and points left out
    chains_lp, chains_milp = _bounds(prob, CUT_CHAINS)  # LARGE's with rows added
    assert large_lp <= chains_lp * (1 + 1e-9) <= lp * (1 + 1e-9) ** 2
    assert large_milp <= chains_milp * (1 + MIP_GAP) and chains_milp <= milp * (1 + MIP_GAP)
    if optimum == math.inf:
        return
    assert lp <= milp * (1 + 1e-9) and milp <= optimum * (1 + 1e-9)
    # on every row here the MILP now meets the optimum (within HiGHS's gap)
    assert milp >= optimum * (1 - MIP_GAP)
    if (name, fraction) in FLOOR:
        assert old_milp / optimum == pytest.approx(FLOOR[(name, fraction)], abs=1e-4)


def test_cuts_apart_by_phase_and_at_each_new_high():
    """a1, a2 saved (4 MiB each), then t1..t4 (1, 1, 3, 5 MiB, not saved; each freed after its
    reader), an 8 MiB limit. In MiB over the limit: t1 1 (a1 a candidate), t2 2, t3 4, t4 8,
    the loss 5 (both), g2 1 (a1, first read later). g2 and t1 have the same candidates but are
    cut apart (the backward's deadline is not the forward's); the worst cut of {a1, a2} is t4,
    its timing cuts t2 (first), t3 (a new high: 4 MiB evicted two ops, 3 s, before t4's 8)
    and the loss (last)."""
    graph, costs = build([("a1", ["x"], 2, 4, CONV), ("a2", ["a1"], 2, 4, CONV), ("t1", ["a2"], 0, 1),
                          ("t2", ["t1"], 0, 1), ("t3", ["t2"], 3, 3), ("t4", ["t3"], 0, 5), ("loss", ["t4"], 0.5, 0)],
                         [("g2", ["a2"], 1), ("g1", ["a1"], 1)], {"a1": (2, 2), "a2": (2, 2)})
    bounds = Bounds(Evaluator(Problem(graph, costs, 8 * MiB)))
    t1, t2, t3, t4, loss, g2 = 3, 4, 5, 6, 7, 8
    assert [(c.op, c.backward, c.candidates, c.excess // MiB) for c in bounds.cuts] == [
        (t1, False, (0,), 1), (t4, False, (0, 1), 8), (g2, True, (0,), 1)]
    assert [(c.op, c.excess // MiB) for c in bounds.timing_cuts] == [(t2, 2), (t3, 4), (loss, 5)]


def test_prefetches_wait_for_the_last_op_at_each_level():
    """a1 (2 MiB, 6 s to compute, a 3 s prefetch), b (1 MiB), a2 (1 MiB, read by g2, g2b, g2d), a
    4 MiB limit. g2..g2c have the same candidates {a1, b}; in MiB over the limit 1, 2, 2, 1: a1
    must be away through g2d, where the excess last stands at 2 (b alone is too little). Swap a1,
    recompute b: forward 8.5 s, g2 g2b g2d to 11.5, a1's prefetch to 14.5 (g2c runs meanwhile),
    g1 to 15.5, b again to 16.5, g0 to 17.5, the optimum. With the worst cut (g2b) and the last
    (g2c) alone the prefetch seemed to start at 10.5: the MILP's bound was 16.5."""
    graph, costs = build([("a1", ["x"], 6, 2, CONV), ("b", ["x"], 1, 1, CONV), ("a2", ["b"], 1, 1, CONV),
                          ("loss", ["a2"], 0.5, 0)],
                         [("g2", ["a2"], 1), ("g2b", ["a2"], 1), ("g2d", ["a2"], 1), ("g2c", [], 1),
                          ("g1", ["a1"], 1), ("g0", ["b"], 1)], {"a1": (1, 3), "b": (1, 1), "a2": (1, 1)})
    prob = Problem(graph, costs, 4 * MiB)
    g2, g2b, g2d, g2c = 5, 6, 7, 8
    bounds = Bounds(Evaluator(prob))
    assert [(c.op, c.excess // MiB) for c in bounds.cuts if c.candidates == (0, 1)] == [(g2b, 2)]
    assert [(c.op, c.excess // MiB) for c in bounds.timing_cuts] == [(g2, 1), (g2d, 2), (g2c, 1)]
    times = brute_force(prob)
    assert min(times.values()) == times[(S, R, K)] == 17.5
    assert _bounds(prob, Families())[1] == pytest.approx(17.5)


@pytest.mark.parametrize("excess, last", [
    ((1, 2, 2, 1), (3, 2)),  # the last at 1 and the last at 2
    ((3, 2, 1), (2, 1, 0)),  # falling: every one
    ((1, 2, 3), (2,)),  # rising: the last alone
    ((2, 2, 2), (2,)),
])
def test_the_last_cut_at_each_level(excess, last):
    cuts = [Cut(op, True, 0.0, 0.0, 0.0, e, (0,)) for op, e in enumerate(excess)]
    assert tuple(cut.op for cut in _new_highs(cuts[::-1])) == last


def test_an_evicted_swap_waits_for_the_offloads_before_it():
    """a1 (3 MiB, an 8 s offload) and a2 (4 MiB, 1 s), 5 s each to compute: t1, right after a2,
    needs a2 evicted. Alone its offload would end at 11 s, but it queues behind a1's (5 to 13 s)
    and ends at 14 s: 3 s the model without ``fifo_cuts`` does not see. With it the MILP meets
    the brute-force optimum (swap both)."""
    graph, costs = build([("a1", ["x"], 5, 3, CONV), ("a2", ["a1"], 5, 4, CONV), ("t1", ["a2"], 0, 4),
                          ("t2", ["t1"], 3, 4), ("t3", ["t2"], 0, 6), ("loss", ["t3"], 0.5, 0)],
                         [("g2", ["a2"], 1), ("g1", ["a1"], 1)], {"a1": (8, 1), "a2": (1, 1)})
    prob = at_fraction(graph, costs, 0.65)
    times = brute_force(prob)
    assert min(times.values()) == times[(S, S)] == 20.5
    assert _bounds(prob, Families(fifo_cuts=False))[1] == pytest.approx(17.5)
    assert _bounds(prob, Families())[1] == pytest.approx(20.5)


def test_a_recompute_pays_for_the_ops_its_chain_shares():
    """t (3 s, 2 MiB, not saved) feeds s (a batch norm's statistics: 0 MiB, saved) and big (1 s,
    4 MiB); u (1 s, 4 MiB) reads big. In-core needs 9 MiB; under 8 one of big and u leaves, and
    the fastest plan recomputes big, which runs t again: 7.5 s of compute + 4 s. The model without
    ``chain_work`` charges t to s (the lowest-numbered activation whose chain has it, though s
    is kept) and bounds 8.5 s; with it the MILP meets the optimum."""
    graph, costs = build([("t", ["x"], 3, 2, CONV), ("s", ["t"], 0, 0), ("big", ["t"], 1, 4),
                          ("u", ["big"], 1, 4, CONV), ("loss", ["u"], 0.5, 0)],
                         [("gu", ["u"], 1), ("gb", ["big", "s"], 1)], {"s": (0, 0), "big": (6, 6), "u": (6, 6)})
    prob = Problem(graph, costs, 8 * MiB)
    times = brute_force(prob)
    assert min(times.values()) == times[(K, R, K)] == times[(S, R, K)] == 11.5
    assert Bounds(Evaluator(prob)).recompute_costs([None] * 3) == [3.0, 1.0, 1.0]
    assert _bounds(prob, Families(chain_work=False))[1] == pytest.approx(8.5)
    assert _bounds(prob, Families())[1] == pytest.approx(11.5)


def test_the_floor_of_a_net_with_batch_norm_is_closed():
    """cnn_bn at its PCIe5 floor. The optimum (the exact search proved it) recomputes four
    conv / batch norm / ReLU outputs and swaps one. Only the unshared schedule fits, so each
    chain runs the chains of the recomputed activations it reads again, and the swap's prefetch
    stalls compute before them all. The model without ``chain_work`` misses both (its bound is 16%
    low); with it the MILP proves the plan's step time."""
    prob = problem("cnn_bn", 0.0, "h100-pcie5")
    code = {"k": K, "s": S, "r": R}
    plan = Evaluator(prob).evaluate([code[c] for c in "rkkrrkkrskkkk"])
    assert plan.fits and not plan.shared
    assert _bounds(prob, Families())[1] == pytest.approx(plan.step_time, rel=MIP_GAP)
    assert _bounds(prob, Families(chain_work=False))[1] / plan.step_time == pytest.approx(0.842, abs=1e-3)


@pytest.mark.parametrize("c_reads, step", [(["r"], 15.5), (["r", "s"], 12.5)], ids=["two chains", "one chain"])
def test_an_op_two_chains_share_runs_in_each(c_reads, step):
    """t (a batch norm: 3 s, its output not saved) feeds s (its statistics, 1 MiB) and r (its
    ReLU, 4 MiB), which c (a conv) reads; the backward reads c, then r and s. With all three
    recomputed, c's chain (at gc) rebuilds r whole. Where c does not read s, s's chain (at gr)
    runs t again: 5.5 s forward, 2 s backward, 5 + 3 s of chains, 15.5 s. The model that counted
    each op of the chains once bounded 12.5 s. Where c reads s, one chain rebuilds all three and
    t runs once: 12.5 s, and the bound stays below it. With the decisions fixed the MILP meets
    the simulated step in both."""
    from fxpooch.planners.fixed import FixedBound

    graph, costs = build([("t", ["x"], 3, 2, CONV), ("s", ["t"], 0, 1), ("r", ["t"], 1, 4),
                          ("c", c_reads, 1, 4, CONV), ("loss", ["c", "s"], 0.5, 0)],
                         [("gc", ["c"], 1), ("gr", ["r", "s"], 1)], {})
    ev = Evaluator(Problem(graph, costs, 64 * MiB))
    plan = ev.evaluate([Decision.RECOMPUTE] * 3)
    assert plan.fits and plan.step_time == step
    assert len(plan.schedule.chains) == (2 if step == 15.5 else 1)
    bound, _ = FixedBound(Bounds(ev)).milp(plan.decisions, 1000)
    assert bound == pytest.approx(step, rel=MIP_GAP)


@pytest.mark.parametrize("plan, without, now", [("rkkssskrrsskrkkkrkkkrkkkrkkkk", 0.9397, 0.9841),
                                                ("rkkrrkksrkksrkkkrkkkrkkkkkskk", 0.9636, 1.0)])
def test_prefetches_leave_in_the_order_they_are_needed(plan, without, now):
    """resnet_small a quarter of the way from its PCIe3 floor. First plan: the stem's conv output
    (4, 1 MiB) is needed first by the chain of the recomputed conv after it, with two batch
    norms' statistics (9, 10, swapped) needed there too and one more (5); their prefetches queue
    behind 4's, issued where memory first allows, and the stem's ReLU output (3) queues behind
    them all: compute waits for it. Second: the ReLU output 7, needed by the chain of the conv
    after it, queues behind 11's copy, and the chain that rebuilds 3 and the stem conv runs after
    that wait; at the backward cut before it those two are absent (no reader of theirs is
    recomputed), so the model counts their chain after the cut. ``without``: the MILP's bound
    over the simulated step before ``issue_order`` and the absent recomputes; ``now``: with
    them (2% below the first plan, the second's step)."""
    from fxpooch.planners.fixed import FixedBound

    prob = problem("resnet_small", 0.25, "v100-pcie3")
    ev = Evaluator(prob)
    code = {"k": K, "s": S, "r": R}
    candidate = ev.evaluate([code[c] for c in plan])
    assert candidate.fits
    bound, _ = FixedBound(Bounds(ev)).milp(candidate.decisions, 10_000)
    assert bound <= candidate.step_time * (1 + MIP_GAP)
    assert bound / candidate.step_time == pytest.approx(now, abs=MIP_GAP) and now > without + 0.02


def test_a_swap_a_recompute_chain_reads_is_back_before_the_chain():
    """a1 (a 4 s conv, 4 MiB; offload 1 s, prefetch 3 s) feeds c (0.5 s, 4 MiB), which t reads;
    the backward reads t, c, then a1. Under 10 MiB (in-core needs 13) the optimum swaps a1 and
    recomputes c, whose chain reads a1: a1's prefetch, issued when the forward ends at 7.5 s,
    must end (10.5 s) before c's chain runs, not before g1 reads a1, so compute waits 1 s after
    gt and the step takes 14 s. Without ``chain_deadlines`` the MILP bounds 13 s; with them 14."""
    graph, costs = build([("a1", ["x"], 4, 4, CONV), ("c", ["a1"], 0.5, 4), ("t", ["c"], 2, 4, CONV),
                          ("loss", ["t"], 0.5, 0)],
                         [("gt", ["t"], 2), ("gc", ["c"], 1), ("g1", ["a1"], 2)],
                         {"a1": (1, 3), "c": (8, 8), "t": (8, 8)})
    prob = Problem(graph, costs, 10 * MiB)
    times = brute_force(prob)
    assert min(times.values()) == times[(S, R, K)] == 14.0
    assert _bounds(prob, Families(chain_deadlines=False))[1] == pytest.approx(13.0)
    assert _bounds(prob, Families())[1] == pytest.approx(14.0)


def test_a_swap_read_through_two_recomputed_links_is_back_before_the_first():
    """cnn_bn a quarter of the way from its PCIe5 floor, a plan that recomputes c (first read
    first), whose chain reads b, recomputed too and first read later, whose chain reads the
    swapped d (read last). Only the unshared schedule fits, so c's chain runs b's again and reads
    d: d's prefetch must end before c's first reader, and compute waits for it. With the decisions
    fixed the MILP meets the simulated step; a deadline through c's own chain only (d is no input
    of it) left it 12% low, at the step without the wait."""
    from fxpooch.planners.fixed import FixedBound

    prob = problem("cnn_bn", 0.25, "h100-pcie5")
    ev = Evaluator(prob)
    code = {"k": K, "s": S, "r": R}
    plan = ev.evaluate([code[c] for c in "rsssrkkrkkkkk"])
    c, b, d = 7, 4, 3
    assert plan.fits and not plan.shared
    assert set(plan.schedule.chains[c]) >= set(plan.schedule.chains[b]) and d not in plan.schedule.chains
    bound, _ = FixedBound(Bounds(ev)).milp(plan.decisions, 10_000)
    assert bound == pytest.approx(plan.step_time, rel=MIP_GAP)


def test_a_swap_a_chain_reads_before_its_peak_is_back_while_it_runs():
    """a1 (a 4 s conv, 4 MiB; offload 1 s, prefetch 3 s) feeds m (not saved), which c reads;
    the backward reads t, c, then a1. c's chain runs m (reading a1) and c: at c, where its
    bytes are most (m and c), it reads no saved input, but a swapped a1 was prefetched before
    the chain and stays until g1 reads it. Under 8 MiB both a1 and c must be evicted and only
    swapping them fits (29.5 s). The LP, which splits a1 and c between swapped and recomputed,
    bounded 17.19 s with a1's swap counted as absent at c's rebuild point, and 18.25 s with it on
    the device there. The MILP meets the optimum either way."""
    graph, costs = build([("a1", ["x"], 4, 4, CONV), ("m", ["a1"], 0.5, 4), ("c", ["m"], 0.5, 4),
                          ("t", ["c"], 2, 4, CONV), ("loss", ["t"], 0.5, 0)],
                         [("gt", ["t"], 2), ("gc", ["c"], 1), ("g1", ["a1"], 2)],
                         {"a1": (1, 3), "c": (8, 8), "t": (8, 8)})
    prob = Problem(graph, costs, 8 * MiB)
    times = brute_force(prob)
    assert min(times.values()) == times[(S, S, K)] == 29.5
    without, now = _bounds(prob, Families(rebuild_swaps=False)), _bounds(prob, Families())
    assert without[0] == pytest.approx(17.1897, abs=1e-4) and now[0] == pytest.approx(18.25)
    assert without[1] == pytest.approx(29.5) and now[1] == pytest.approx(29.5)
