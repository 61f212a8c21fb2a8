"""The split plans of ``planners/split.py``: input side swapped, output side recomputed, brought
under the limit one change at a time; ``local`` starts from the fastest where it beats its other
starts. Chain a1..a4 of 4, 2, 2, 4 MiB (1 MiB gradients, 1 s per copy): in-core peak 13 MiB, 13 s."""
from __future__ import annotations

import dataclasses

import pytest

from fxpooch.planners.common import Evaluator, Problem, Unjudged
from fxpooch.planners.search import SearchOptions, plan_local
from fxpooch.planners.baselines import separators
from fxpooch.planners.split import fit_by_peak, peak_candidates, overage, program_peak, split_plan, split_seed
from fxpooch.schedule import Decision, build_schedule
from fxpooch.simulator import static_memory
from stepgraphs import MiB, chain
from test_search import problem

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


def _chain(limit_mib: int) -> Evaluator:
    graph, costs = chain([1, 1, 1, 1], [2, 2, 2, 2], [4, 2, 2, 4], [(1, 1)] * 4, loss=1)
    return Evaluator(Problem(graph, costs, limit_mib * MiB))


@pytest.mark.parametrize("fraction, expected", [
    (0.0, (R, R, R, R)),
    (0.25, (S, R, R, R)),
    (0.5, (S, S, R, R)),
    (0.6, (S, S, R, R)),  # whole activations: the first int(0.6 * 4) = 2
    (1.0, (S, S, S, S)),
])
def test_split_plan_swaps_the_first_fraction_and_recomputes_the_rest(fraction, expected):
    assert split_plan(_chain(13), fraction) == expected


def test_split_plan_swaps_the_block_outputs_it_is_given():
    """Each chain then stops at the block output before it: on this chain, where every activation
    is one, a4's chain is f4 alone (op 4; op 0 is the input) instead of f2, f3 and f4."""
    ev = _chain(13)
    assert split_plan(ev, 0.25, ends={2}) == (S, R, S, R)
    assert ev.evaluate(split_plan(ev, 0.25)).schedule.chains[3] == (2, 3, 4)
    assert ev.evaluate(split_plan(ev, 0.25, ends={2})).schedule.chains == {1: (2,), 3: (4,)}


def test_split_plan_keeps_what_cannot_be_swapped():
    ev = _chain(13)
    acts = list(ev.graph.activations)
    acts[0] = dataclasses.replace(acts[0], swappable=False)
    ev = Evaluator(Problem(dataclasses.replace(ev.graph, activations=tuple(acts)), ev.problem.costs, 13 * MiB))
    assert split_plan(ev, 0.5) == (K, S, R, R)


def test_an_unjudged_plan_shows_its_program_order_layout_without_being_simulated():
    ev = _chain(9)
    c = ev.evaluate([K] * 4)  # 13 MiB in program order, over 9 MiB
    assert isinstance(c, Unjudged) and not c.fits
    assert c.layout.decisions == (K, K, K, K)
    assert program_peak(c) == 13 * MiB == int(static_memory(build_schedule(ev.graph, [K] * 4)).max())
    assert peak_candidates(c, ev) == [0, 1, 2, 3]  # every activation, at g4 (with its 1 MiB gradient)
    assert "judged" not in c.__dict__  # nothing was simulated


def test_overage_sums_the_bytes_over_the_limit_in_program_order():
    ev = _chain(9)
    # all kept, MiB per instruction: x 0, a1..a4 4 6 8 12, loss 12, g4 13, g3 10, g2 8, g1 6
    assert overage(ev.evaluate([K] * 4), ev.budget) == (3 + 3 + 4 + 1) * MiB
    assert overage(ev.evaluate([K] * 4), 13 * MiB) == 0


def test_a_recompute_chain_at_the_peak_makes_what_it_rebuilds_a_candidate():
    """All recomputed, each chain alone: the peak (7 MiB) is g3's chain running a2 again (a1 and
    a2 rebuilt, a3 next); a3's storage is not allocated yet, but recomputing it makes that peak."""
    ev = _chain(13)
    c = ev.evaluate([R] * 4, share=False)
    mem = static_memory(c.layout)
    at = int(mem.argmax())
    assert mem[at] == 7 * MiB and c.layout.instrs[at].kind.value == "recompute" and c.layout.instrs[at].act == 2
    assert peak_candidates(c, ev) == [0, 1, 2]


@pytest.mark.parametrize("limit_mib, expected, seconds", [
    (13, (K, K, K, K), 13.0),  # fits already
    (9, (S, K, K, K), 13.0),  # a1's 4 MiB leave while a2..a4 run, and are back long before g1
    (7, (S, S, K, K), 14.0),  # 6 MiB: a1 and a2; a2's copy back ends 1 s after g3 starts waiting
])
def test_fit_by_peak_brings_the_plan_under_the_limit(limit_mib, expected, seconds):
    ev = _chain(limit_mib)
    c = fit_by_peak(ev, ev.evaluate([K] * 4), stop_at=10_000)
    assert c is not None and c.fits and c.decisions == expected
    assert c.timeline.peak_bytes <= limit_mib * MiB
    assert c.step_time == pytest.approx(seconds)


def test_fit_by_peak_gives_up_below_the_floor_and_within_its_budget():
    floor = Evaluator(_chain(13).problem).floor().timeline.static_peak_bytes
    ev = Evaluator(dataclasses.replace(_chain(13).problem, mem_limit=floor - 1))
    assert fit_by_peak(ev, ev.evaluate([K] * 4), stop_at=10_000) is None
    ev = _chain(7)  # two changes needed; a budget of four trials is not enough for both rounds
    assert fit_by_peak(ev, ev.evaluate([K] * 4), stop_at=4) is None
    assert ev.simulations <= 4


def test_split_seed_is_the_fastest_split_plan_that_fits():
    fractions = (0.25, 0.5)
    repaired = []
    for f in fractions:
        ev = _chain(7)
        repaired.append(fit_by_peak(ev, ev.evaluate(split_plan(ev, f, separators(ev.graph))), 10_000))
    assert all(c is not None and c.fits for c in repaired)
    got = split_seed(_chain(7), fractions, stop_at=10_000)
    assert got is not None and got.fits
    assert got.step_time == pytest.approx(min(c.step_time for c in repaired))


@pytest.mark.parametrize("name, point", [("transformer_block", 0.05), ("cnn_bn", 0.0)])
def test_local_is_never_slower_than_the_split_seed(name, point):
    """With the exact search off (``max_exact=0``) the split plans take part on any graph:
    ``local``'s plan fits and is at least as fast as the fastest of them (one fits at cnn_bn's floor
    and 5% of the way from the block's floor to its in-core peak; at the block's floor, lowered since
    its dropout outputs are recomputed from their masks, none does)."""
    prob = problem(name, point)
    options = SearchOptions(max_exact=0)
    seed = split_seed(Evaluator(prob), options.splits, stop_at=10_000)
    plan = plan_local(prob, options)
    assert seed is not None and seed.fits
    assert plan.fits and plan.step_time <= seed.step_time * (1 + 1e-9)
