"""``Evaluator.time_bound`` is below the simulated step time of every schedule of a plan, so a search
may skip the plans it shows no faster (``Evaluator.cannot_beat``)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from test_footprint import _vectors
from test_search import _two_graphs, problem

from fxpooch.planners import Evaluator
from fxpooch.planners.common import Problem
from fxpooch.schedule import Decision
from fxpooch.segments import plan_recomputes


def _problems():
    for name in ("cnn_bn", "resnet_small", "transformer_block"):
        for hardware in ("v100-pcie3", "cpu"):  # copies overlapped, and made by the compute thread
            yield f"{name}-{hardware}", problem(name, 0.25, hardware)
    graph, costs = _two_graphs("v100-pcie3")
    yield "two_graphs", Problem(graph, costs, 1 << 40)


@pytest.mark.parametrize("name, prob", list(_problems()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_time_bound_is_below_every_schedule_of_the_plan(name, prob):
    ev = Evaluator(prob)
    tight = 0
    for decisions in _vectors(prob.graph, 40, seed=3):
        bound = ev.time_bound(decisions)
        for share in (True, False, None):  # None: shared in part where that is what fits
            for early in (True, False):
                c = ev.evaluate(decisions, early_prefetch=early, share=share)
                assert bound <= c.step_time * (1 + 1e-12)
                tight += bound >= 0.9 * c.step_time
    assert tight > 0  # the bound is not trivially low


@pytest.mark.parametrize("name, prob", list(_problems())[::2], ids=lambda v: v if isinstance(v, str) else "")
def test_shared_chains_run_no_op_more_often_than_unshared_ones(name, prob):
    """Why the bound may count the chains shared: a schedule with some chains apart reruns every
    op they run, and the unshared one (all apart) as often again."""
    rng = random.Random(5)
    for decisions in _vectors(prob.graph, 60, seed=5):
        recomputed = [a for a, d in enumerate(decisions) if d is Decision.RECOMPUTE]
        apart = rng.sample(recomputed, len(recomputed) // 2)
        runs = [Counter(o for b, chain in r.chains.items() if b in r.first_use for o in chain)
                for r in (plan_recomputes(prob.graph, decisions, True), plan_recomputes(prob.graph, decisions, True, apart),
                          plan_recomputes(prob.graph, decisions, False))]
        assert all(runs[0][o] <= runs[1][o] <= runs[2][o] for o in runs[0])


def test_cannot_beat_skips_plans_the_bound_shows_slower_and_counts_them_cheaply():
    prob = problem("transformer_block", 0.5)
    ev = Evaluator(prob)
    recompute_all = ev.all_recompute()
    bound = ev.time_bound(recompute_all)
    assert ev.cannot_beat(recompute_all, bound) and not ev.cannot_beat(recompute_all, bound * 1.001)
    assert ev.evaluations == 0 and ev.outrun == 1  # nothing judged; one plan skipped
    c = ev.evaluate(recompute_all)  # once judged, its own step time decides
    assert ev.cannot_beat(recompute_all, c.step_time) and not ev.cannot_beat(recompute_all, c.step_time * 1.001)
    assert ev.outrun == 1
    tight = Evaluator(dataclasses.replace(prob, mem_limit=prob.graph.resident_bytes + 1))
    # the shared schedule alone known not to fit says nothing: the unshared one may
    assert not tight.evaluate(recompute_all, share=True).fits and not tight.cannot_beat(recompute_all, 1e9)
    assert not tight.cannot_beat(recompute_all, 1e9)  # the bound says nothing of memory
    assert not tight.evaluate(recompute_all).fits and tight.cannot_beat(recompute_all, 1e9)  # judged: over
