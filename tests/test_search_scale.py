"""The default planner at scale: budgets counted in simulations (never in seconds), plans that do
not depend on the clock, group moves over repeated blocks, and never a plan slower than the
reference plans it starts from.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from types import SimpleNamespace

import pytest
from test_search import problem

from stepgraphs import CONV, RELU, chain
from fxpooch.errors import InfeasibleMemoryLimit
from fxpooch.planners import Evaluator, Problem, get_planner
from fxpooch.planners.common import simulation_budget
from fxpooch.planners.groups import (group_descent, group_search, group_trades, link_trades,
                                     repeated_groups, sides, tails)
from fxpooch.planners.search import SearchOptions, plan_local
from fxpooch.schedule import Decision
from fxpooch.simulator import in_core_peak_bytes

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


def deep_chain(blocks: int, xfer: float):
    """``blocks`` repeats of (conv 2 s, relu 0.5 s), 2 MiB each, then a loss; each copy ``xfer`` s."""
    n = 2 * blocks
    return chain([2.0, 0.5] * blocks, [0.5, 4.0] * blocks, [2] * n, [(xfer, xfer)] * n, loss=0.5,
                 targets=[CONV, RELU] * blocks)


@pytest.mark.parametrize("ops, work, at_most, at_least, expected", [
    (1_000, 500_000, 50_000, 200, 500),  # work / ops
    (10, 500_000, 50_000, 200, 50_000),  # capped on tiny graphs
    (8_000, 500_000, 50_000, 200, 200),  # the floor on large graphs: time grows linearly from here
    (2_500, 500_000, 50_000, 200, 200),
    (8_000, 500_000, 50_000, 1, 62),  # without a floor the budget shrinks as the graph grows
    (10**9, 1, 1, 1, 1),  # always at least one
])
def test_simulation_budget(ops, work, at_most, at_least, expected):
    sized = SimpleNamespace(ops=range(ops))  # all the budget reads of a graph: its number of ops
    assert simulation_budget(sized, work, at_most, at_least) == expected


def test_repeated_groups_and_sides():
    graph, costs = deep_chain(4, 1.0)
    ev = Evaluator(Problem(graph, costs, in_core_peak_bytes(graph)))
    acts = graph.activations
    groups = repeated_groups(ev)
    # the convolutions' outputs, then the relus' (same bytes: the earlier first member first)
    assert [[acts[a].name for a in g] for g in groups] == [["a1", "a3", "a5", "a7"], ["a2", "a4", "a6", "a8"]]
    # cut after one, two and three of four members (parts of one member left out)
    assert [[acts[a].name for a in g] for g in sides(groups)] == [
        ["a3", "a5", "a7"], ["a1", "a3"], ["a5", "a7"], ["a1", "a3", "a5"],
        ["a4", "a6", "a8"], ["a2", "a4"], ["a6", "a8"], ["a2", "a4", "a6"]]


def test_group_search_keeps_the_last_block():
    """Four blocks at 0.4 of the in-core peak, everything swapped to start (44.0 s). The whole
    groups and their sides reach 33.5 s: every ReLU output recomputed from its swapped convolution
    output, in core 28.5 s plus 4 x 0.5 s, and 3 s at the backward's start waiting for the last
    convolution output (its 2 s offload ends 1 s after the forward, then 2 s back). Keeping the
    last block's two outputs (:func:`tails`) waits for nothing and recomputes three ReLUs: 30.0 s."""
    graph, costs = deep_chain(4, 2.0)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * 0.4)))
    acts = graph.activations
    groups = repeated_groups(ev)
    assert [[acts[a].name for a in t] for t in tails(groups)] == [["a7"], ["a8"]]
    seed = ev.evaluate(ev.all_swap())
    assert seed.step_time == pytest.approx(44.0, abs=1e-9)
    plan = "".join(d.value[0] for d in group_descent(ev, seed, groups + sides(groups), 10**6).decisions)
    assert plan == "srsrsrsr" and ev.evaluate([{"s": S, "r": R}[c] for c in plan]).step_time == pytest.approx(33.5)
    found = group_search(ev, seed, 10**6)
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert "".join(d.value[0] for d in found.decisions) == "srsrsrkk"
    assert found.step_time == pytest.approx(28.5 + 3 * 0.5, abs=1e-9)


def test_group_descent_repeats_a_pass_only_above_its_reserve():
    """Eight blocks at 0.4 of the in-core peak from swap-all. The descent's first pass ends at
    its plan; a second one only checks it. With ``reserve`` simulations kept for what comes after
    (single changes), the second pass runs only while more than that many are left."""
    graph, costs = deep_chain(8, 2.0)

    def descend(reserve: int) -> tuple[str, int]:
        ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * 0.4)))
        groups = repeated_groups(ev)
        seed = ev.evaluate(ev.all_swap())
        start = ev.simulations
        found = group_descent(ev, seed, groups + sides(groups), start + 1000, reserve)
        return "".join(d.value[0] for d in found.decisions), ev.simulations - start

    plan, repeated = descend(0)
    one_plan, one = descend(1000)
    assert plan == one_plan == "sssssssskrkrkkkk" and one < repeated
    assert descend(1000 - one - 1) == (plan, repeated)  # more than the reserve left: a second pass
    assert descend(1000 - one) == (plan, one)  # exactly the reserve left: none


@pytest.mark.parametrize("blocks", [4, 8, 16])
@pytest.mark.parametrize("xfer", [0.2, 1.0, 3.0])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_local_beats_every_plan_uniform_over_repeated_blocks(blocks, xfer, fraction):
    """With only its floor of simulations, local is at least as fast as each plan that gives every
    member of a repeated group the same decision (the plans its group moves reach)."""
    graph, costs = deep_chain(blocks, xfer)
    prob = Problem(graph, costs, int(in_core_peak_bytes(graph) * fraction))
    ev = Evaluator(prob)
    groups = repeated_groups(ev)
    uniform = []
    for choice in itertools.product(Decision, repeat=len(groups)):
        decisions = [K] * len(graph.activations)
        for group, d in zip(groups, choice):
            for a in group:
                decisions[a] = d
        c = ev.evaluate(decisions)
        if c is not None and c.fits:
            uniform.append(c.step_time)
    assert uniform  # every case here has a fitting uniform plan
    local = plan_local(prob, SearchOptions(work=1, min_simulations=60))
    assert local.fits and local.timeline.peak_bytes <= prob.mem_limit
    assert local.step_time <= min(uniform) * (1 + 1e-12)


def random_chain(blocks: int, fw: tuple[float, float], xfer: float, mib: tuple[int, int] = (2, 2)):
    """``blocks`` repeats of (conv, a random op: dropout, say, so never recomputed) of ``mib``,
    forward times ``fw``, backward 0.5 s and 4 s, then a 0.5 s loss; each copy ``xfer`` s."""
    graph, costs = chain(list(fw) * blocks, [0.5, 4.0] * blocks, list(mib) * blocks, [(xfer, xfer)] * (2 * blocks),
                         loss=0.5, targets=[CONV, RELU] * blocks)
    ops = tuple(dataclasses.replace(op, recomputable=False) if op.target == RELU else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops), costs


@pytest.mark.parametrize("fw, xfer, fraction, traded, conv_plan", [
    # in core 8 x (0.5 + 0.5) + 0.5 + 8 x 4.5 = 44.5 s, and the 8 convolutions again: 8 x 0.5 s
    ((0.5, 0.5), 6.0, 0.7, 44.5 + 8 * 0.5, "kkrrrrrk"),
    ((0.5, 0.5), 3.0, 0.65, 44.5 + 8 * 0.5, "ssrrrrkk"),
    # in core 8 x 0.7 + 0.5 + 36 = 42.1 s, and 8 x 0.2 s
    ((0.2, 0.5), 6.0, 0.65, 42.1 + 8 * 0.2, "rrrrrrkk"),
])
def test_group_search_trades_two_groups(fw, xfer, fraction, traded, conv_plan):
    """From the plan that keeps the convolutions and swaps the random outputs, no single group
    move helps: keeping the random outputs too misses the limit, recomputing the convolutions
    too only adds time. Trading the two groups (recompute every convolution, keep every random
    output: the same bytes freed, no copy to wait for) helps; then the groups' sides and tails do
    more: convolutions kept where memory allows (the first two, and with :func:`tails` the last
    one), or swapped where their copies hide behind the forward. The step takes in-core time and
    0.5 s (0.2 s) for each convolution still recomputed."""
    graph, costs = random_chain(8, fw, xfer)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * fraction)))
    convs, randoms = repeated_groups(ev)
    assert [graph.ops[graph.activations[g[0]].producer].target for g in (convs, randoms)] == [CONV, RELU]
    decisions = [K] * len(graph.activations)
    for a in randoms:
        decisions[a] = S
    seed = ev.evaluate(decisions)
    assert seed.fits and seed.step_time > traded
    assert group_descent(ev, seed, [convs, randoms], 10**6) is seed  # no single group move helps
    swap_trade = [R if a in convs else K for a in range(len(decisions))]
    assert ev.evaluate(swap_trade).step_time == pytest.approx(traded, abs=1e-9)
    found = group_search(ev, seed, 10**6)
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert "".join(found.decisions[a].value[0] for a in convs) == conv_plan
    assert all(found.decisions[a] is K for a in randoms)
    in_core = traded - 8 * fw[0]
    assert found.step_time == pytest.approx(in_core + conv_plan.count("r") * fw[0], abs=1e-9)


@pytest.mark.parametrize("xfer, fraction, simulations, swapped", [
    (0.8, 0.6, 25, ["a1", "a2", "a3", "a4"]),
    (1.5, 0.6, 25, ["a1", "a2", "a3", "a4"]),
    (2.0, 0.6, 25, ["a1", "a2", "a3", "a4"]),
    (1.5, 0.8, 15, ["a1", "a3"]),
])
def test_group_search_leaves_the_sides_a_share_of_the_budget(xfer, fraction, simulations, swapped):
    """Four blocks, everything swapped to start. Swapping activations of the input-side blocks
    only hides every copy behind compute: the step takes in-core time, 4 x 2.5 + 0.5 + 4 x 4.5 = 28.5 s, which
    nothing beats. Only the sides' moves reach that plan; trades that find nothing may take at
    most half the simulations left, so the sides' descent still runs (it got none, and the
    step took 29.5 s, when the trades could take them all)."""
    graph, costs = deep_chain(4, xfer)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * fraction)))
    seed = ev.evaluate(ev.all_swap())
    assert seed.fits and seed.step_time > 28.5
    found = group_search(ev, seed, simulations)
    assert ev.simulations <= simulations + 1  # the seed's simulation, and the budget
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert found.step_time == pytest.approx(28.5, abs=1e-9)
    assert [act.name for act, d in zip(graph.activations, found.decisions) if d is S] == swapped
    assert all(d is K for act, d in zip(graph.activations, found.decisions) if act.name not in swapped)


def _halves(groups: list[list[int]]) -> list[list[int]]:
    """Each group's input-side and output-side halves: the sides a trade of these tests takes."""
    return sides(groups, (0.5,))


@pytest.mark.parametrize("xfer, mib, fraction", [(6.0, (3, 2), 0.75), (3.0, (2, 1), 0.8), (6.0, (2, 1), 0.8)])
def test_group_search_trades_groups_of_different_shapes(xfer, mib, fraction):
    """Convolution outputs larger than the random outputs: no two groups have the same shape and
    no single group or half group move helps the plan that swaps every random output. Keeping
    those and recomputing the first half of the convolutions (freeing as many bytes) does:
    in core 44.5 s plus 4 convolutions again, 0.5 s each. Group search, with finer sides as
    well, finds that plan or a faster one."""
    graph, costs = random_chain(8, (0.5, 0.5), xfer, mib)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * fraction)))
    groups = repeated_groups(ev)
    convs, randoms = sorted(groups, key=lambda g: graph.ops[graph.activations[g[0]].producer].target != CONV)
    decisions = [K] * len(graph.activations)
    for a in randoms:
        decisions[a] = S
    seed = ev.evaluate(decisions)
    assert seed.fits and seed.step_time > 44.5 + 4 * 0.5
    parts = groups + _halves(groups)
    assert group_descent(ev, seed, parts, 10**6) is seed  # no single group move helps
    plan = [K] * len(graph.activations)
    for a in convs[:4]:
        plan[a] = R
    traded = ev.evaluate(plan)
    assert traded.fits and traded.step_time == pytest.approx(44.5 + 4 * 0.5, abs=1e-9)
    found = group_search(ev, seed, 10**6)
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert found.step_time <= traded.step_time


@pytest.mark.parametrize("fraction", [0.25, 0.3])
def test_group_search_spends_the_link_on_the_costliest_rebuilds(fraction):
    """Eight blocks of (conv 2 s, relu 0.5 s), 2 MiB each, every copy 3 s each way: the link
    carries one activation per 3 s, the forward makes one per 1.25 s, and the limit keeps none.

    Recompute every conv and swap every relu: relu8's offload ends at 2.5 + 8 x 3 = 26.5 s (the
    D2H stream busy from relu1's end), its prefetch at 29.5, its grad at 30; conv8's rebuild
    reads relu7, prefetched behind it (32.5), then 2 + 4 s; then seven blocks of 0.5 + 2 + 4 s:
    84 s. No group move helps: keeping either group misses the limit, swapping the convs too
    sends 16 copies of 3 s (102 s), recomputing the relus too rebuilds from the input (230.5 s,
    its chains shared in part: all but conv1's and relu1's set apart, so conv2's chain reruns
    them once more than with conv2's shared as well, 228 s, a set the least closures pass by).
    Swapping the convs and recomputing the relus instead (the same bytes over the link, a 0.5 s
    rebuild each instead of 2 s): conv8's offload ends at 2 + 8 x 3 = 26 s, its prefetch at 29,
    then 8 blocks of 0.5 + 0.5 + 4 s: 69 s. Group search, with finer sides than halves as well,
    finds that plan or a faster one."""
    graph, costs = chain([2.0, 0.5] * 8, [0.5, 4.0] * 8, [2] * 16, [(3.0, 3.0)] * 16, loss=0.5,
                         targets=[CONV, RELU] * 8)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * fraction)))
    groups = repeated_groups(ev)
    convs, relus = groups
    assert [graph.ops[graph.activations[g[0]].producer].target for g in groups] == [CONV, RELU]
    assert ev.rebuild_times == (2.0, 0.5) * 8

    def uniform(conv: Decision, relu: Decision):
        decisions = [K] * len(graph.activations)
        for group, d in ((convs, conv), (relus, relu)):
            for a in group:
                decisions[a] = d
        return ev.evaluate(decisions)

    seed = uniform(R, S)
    assert seed.fits and seed.step_time == 84.0
    assert [uniform(S, S).step_time, uniform(R, R).step_time] == [102.0, 230.5]
    assert not any(uniform(*ds).fits for ds in [(K, S), (K, R), (S, K), (R, K)])
    parts = groups + _halves(groups)
    assert group_descent(ev, seed, parts, 10**6) is seed  # no single group move helps
    assert group_trades(ev, seed, parts, 10**6) is None  # nor a keep traded for a free
    traded = link_trades(ev, seed, parts, ev.rebuild_times, 10**6)
    assert traded.decisions == uniform(S, R).decisions and traded.step_time == 69.0
    found = group_search(ev, seed, 10**6)
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert found.step_time <= 69.0


class _Clock:
    """A clock that jumps an hour each time it is read: a planner with a time guard would stop."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


@pytest.mark.parametrize("name, hardware, fraction", [
    ("mlp", "v100-pcie3", 0.0),
    ("cnn_bn", "v100-nvlink2", 0.3),
    ("resnet_small", "h100-pcie5", 0.5),
    ("transformer_block", "v100-pcie3", 0.25),
])
def test_local_plans_do_not_depend_on_the_clock(monkeypatch, name, hardware, fraction):
    prob = problem(name, fraction, hardware)
    first = get_planner("local")(prob)
    for clock in ("perf_counter", "process_time", "monotonic", "time"):
        monkeypatch.setattr(time, clock, _Clock())
    again = get_planner("local")(prob)
    assert again.decisions == first.decisions
    assert again.schedule.prefetch_before == first.schedule.prefetch_before
    assert again.step_time == first.step_time


@pytest.mark.parametrize("name", ["cnn_bn", "resnet_small", "transformer_block"])
@pytest.mark.parametrize("hardware", ["v100-pcie3", "v100-nvlink2", "h100-pcie5"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75])
def test_local_never_slower_than_the_reference_plans(name, hardware, fraction):
    prob = problem(name, fraction, hardware)
    local = get_planner("local")(prob)
    assert local.fits and local.timeline.peak_bytes <= prob.mem_limit
    for reference in ("swap-all", "checkpoint", "checkpoint-all", "pooch"):
        try:
            other = get_planner(reference)(prob)
        except InfeasibleMemoryLimit:
            continue
        assert local.step_time <= other.step_time * (1 + 1e-12), reference


def test_group_search_trades_what_the_sides_changed():
    """Four blocks of (conv 0.5 s, relu 0.5 s; 2 MiB and 1 MiB; every copy 1 s) at 0.6 of the
    in-core peak; in core 4 x 1 + 0.5 + 4 x 4.5 = 22.5 s. The whole groups reach "sksksksk"
    (every conv swapped, 24.0 s), and no trade helps. The sides and tails keep the last conv:
    "skskskkk", 23.5 s, the backward waiting 0.5 s twice for the prefetches of conv3 and conv2,
    which the limit holds back until a grad before theirs frees memory. No group, side or tail
    move helps that plan. Trading the output-side half of the convs, whose last member the
    sides just changed (kept: conv3), against the input-side half of the relus (swapped: as
    many bytes) gives "sssskkkk", 23.0 s: the prefetches come in time, and the forward waits
    0.5 s once, conv4 for conv2's offload to free its 2 MiB (3.0 -> 3.5 s). Only the trades
    scanned after the sides' descent find it."""
    graph, costs = chain([0.5, 0.5] * 4, [0.5, 4.0] * 4, [2, 1] * 4, [(1.0, 1.0)] * 8, loss=0.5,
                         targets=[CONV, RELU] * 4)
    ev = Evaluator(Problem(graph, costs, int(in_core_peak_bytes(graph) * 0.6)))
    groups = repeated_groups(ev)
    convs, relus = groups
    plan = {p: ev.evaluate([{"k": K, "s": S, "r": R}[c] for c in p])
            for p in ("kkkkkkkk", "sksksksk", "skskskkk", "sssskkkk")}
    assert [plan[p].step_time for p in plan] == [22.5, 24.0, 23.5, 23.0]
    assert [plan[p].fits for p in plan] == [False, True, True, True]
    assert plan["skskskkk"].timeline.stall == {convs[2]: 0.5, convs[1]: 0.5}
    assert plan["sssskkkk"].timeline.stall == {}
    halves = groups + sides(groups, (0.5,))
    assert group_descent(ev, ev.evaluate(ev.all_swap()), groups, 10**6).decisions == plan["sksksksk"].decisions
    assert group_trades(ev, plan["sksksksk"], halves, 10**6) is None
    assert link_trades(ev, plan["sksksksk"], halves, ev.rebuild_times, 10**6) is None
    moves = groups + sides(groups) + tails(groups)
    assert group_descent(ev, plan["skskskkk"], moves, 10**6) is plan["skskskkk"]  # no single move helps
    assert group_descent(ev, plan["sksksksk"], moves, 10**6).decisions == plan["skskskkk"].decisions
    traded = group_trades(ev, plan["skskskkk"], halves, 10**6, touching={convs[3]})
    assert traded.decisions == plan["sssskkkk"].decisions
    found = group_search(ev, ev.evaluate(ev.all_swap()), 10**6)
    assert found.fits and found.timeline.peak_bytes <= ev.problem.mem_limit
    assert "".join(d.value[0] for d in found.decisions) == "sssskkkk" and found.step_time == 23.0
