"""The search planners and the bounds: exact is the 3^n optimum, bounds never exceed it,
local search never loses to PoocH.

Brute force over every decision vector is the oracle (graphs of at most 6 activations here).
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

import fxpooch
from fxpooch.errors import InfeasibleMemoryLimit
from fxpooch.planners import Evaluator, Problem, get_planner
from fxpooch.planners.bounds import Bounds, lower_bound
from fxpooch.planners.cutbound import split_bound
from fxpooch.planners.lp import lp_lower_bound
from stepgraphs import dropout_drawn_only
from fxpooch.planners.search import ExactSearchTooLarge, SearchOptions, plan_exact
from fxpooch.schedule import Decision, build_schedule
from fxpooch.simulator import simulate
from stepgraphs import CONV, RELU, build, chain
from zoo import ZOO

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


def problem(name: str, fraction: float, hardware: str = "v100-pcie3") -> Problem:
    """A zoo model's problem at ``fraction`` of the way from its floor to its in-core peak."""
    model, x = ZOO[name]()
    base = fxpooch.plan(model, x, "1TiB", planner="in-core", profile="analytic", hardware=hardware)
    graph, costs = base.graph, base.profile.costs(base.graph)
    floor = Evaluator(Problem(graph, costs, 1)).floor().timeline.static_peak_bytes
    return Problem(graph, costs, int(floor + fraction * (base.in_core_peak_bytes - floor)))


def brute_force(prob: Problem) -> dict[tuple[Decision, ...], float]:
    """Every realisable decision vector that fits -> its simulated step time."""
    ev, acts = Evaluator(prob), prob.graph.activations
    out = {}
    for d in itertools.product(tuple(Decision), repeat=len(acts)):
        if any(x is S and not a.swappable for x, a in zip(d, acts)):
            continue
        c = ev.evaluate(d)
        if c is not None and c.fits:
            out[d] = c.step_time
    return out


def at_fraction(graph, costs, fraction: float) -> Problem:
    peak = simulate(graph, build_schedule(graph, [K] * len(graph.activations)), costs).peak_bytes
    return Problem(graph, costs, int(peak * fraction))


def _branchy():
    """A skip connection, a backward op reading two activations, a loss."""
    return build([("a1", ["x"], 1, 4, CONV), ("a2", ["a1"], 0.5, 2), ("a3", ["a2"], 2, 6, CONV),
                  ("a4", ["a3", "a1"], 0.5, 3), ("loss", ["a4"], 0.5, 0)],
                 [("g4", ["a4"], 1), ("g3", ["a3", "a1"], 3), ("g2", ["a2"], 1), ("g1", ["a1"], 2)],
                 {"a1": (2, 2), "a2": (0.5, 1), "a3": (3, 3), "a4": (1, 0.5)})


class TwoGraphs(nn.Module):
    """A graph break: two forward/backward pairs in one step."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.c(torch.relu(self.b(h)))


def _two_graphs(hardware: str):
    torch.manual_seed(0)
    base = fxpooch.plan(TwoGraphs(), torch.randn(2048, 512), "1TiB", planner="in-core", profile="analytic",
                        hardware=hardware)
    assert len(base.graph.forward_range) == 2
    return base.graph, base.profile.costs(base.graph)


SLOW, FAST = (4.0, 4.0), (0.25, 0.25)
GRAPHS = {
    "chain4-slow": lambda: chain([1, 1, 1, 1], [1, 1, 1, 1], [4, 4, 4, 4], [SLOW] * 4, loss=0.5),
    "chain5-fast": lambda: chain([1, 0.5, 2, 0.5, 1], [1, 0.5, 2, 0.5, 1], [4, 2, 6, 2, 4], [FAST] * 5,
                                 targets=[CONV, RELU, CONV, RELU, RELU]),
    "chain6-mixed": lambda: chain([0.5, 2, 0.5, 1, 1, 0.5], [1, 3, 0.5, 2, 1, 0.5], [2, 6, 2, 4, 3, 1],
                                  [(1, 1), (4, 4), (0.25, 2), (4, 1), (2, 2), (0.5, 0.5)], loss=0.5,
                                  targets=[RELU, CONV, RELU, CONV, RELU, RELU]),
    "branchy": _branchy,
    "two-graphs-pcie": lambda: _two_graphs("v100-pcie3"),
    "two-graphs-nvlink": lambda: _two_graphs("v100-nvlink2"),
}
FRACTIONS = [0.45, 0.6, 0.75, 0.9]


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def instances(request) -> list[tuple[Problem, dict[tuple[Decision, ...], float]]]:
    graph, costs = GRAPHS[request.param]()
    probs = [at_fraction(graph, costs, f) for f in FRACTIONS]
    return [(prob, brute_force(prob)) for prob in probs]


def test_exact_equals_brute_force_and_bounds_stay_below(instances):
    for prob, times in instances:
        optimum = min(times.values(), default=None)
        bound = lower_bound(Evaluator(prob))
        try:
            best = plan_exact(prob)
        except InfeasibleMemoryLimit:
            assert optimum is None  # (the bound need not see it: it is a necessary condition only)
            continue
        assert best.fits and best.timeline.peak_bytes <= prob.mem_limit
        assert best.step_time == pytest.approx(optimum, rel=1e-12)
        assert bound <= optimum * (1 + 1e-12)
        assert bound >= sum(prob.costs.op_time) * (1 - 1e-12)


def test_lp_bound_between_the_cut_bound_and_the_optimum(instances):
    pytest.importorskip("scipy")
    for prob, times in instances:
        optimum = min(times.values(), default=math.inf)
        cut = lower_bound(Evaluator(prob))
        lp = lp_lower_bound(Evaluator(prob))
        assert cut <= lp <= optimum * (1 + 1e-9)


def test_partial_bounds_stay_below_every_completion(instances):
    rng = random.Random(0)
    for prob, times in instances:
        ev = Evaluator(prob)
        bounds = Bounds(ev)
        n = len(prob.graph.activations)
        claimed = 0
        for _ in range(60):
            partial = [rng.choice([None, None, K, S, R]) for _ in range(n)]
            partial = [None if d is S and not a.swappable else d for d, a in zip(partial, prob.graph.activations)]
            best = min((t for d, t in times.items() if all(p is None or p is x for p, x in zip(partial, d))),
                       default=math.inf)
            assert bounds.bound(partial) <= best * (1 + 1e-12), partial
            keep = [K if d is None else d for d in partial]
            realisable = all(ev.can_recompute(a, keep) for a, d in enumerate(partial) if d is R)
            if realisable and bounds.keep_completion_is_bound(partial):
                claimed += 1
                assert ev.unconstrained_time(keep) <= best * (1 + 1e-12), partial
        assert claimed > 0


@pytest.mark.parametrize("args, expected", [
    # nothing to evict: the compute on either side of the cut
    ((1.0, 2.0, 3.0, 0, [], []), 6.0),
    # 2 bytes must go, recompute only at 1 s per byte: 1 + 0 + (3 + 2)
    ((1.0, 0.0, 3.0, 2, [], [(1.0, 1), (1.0, 1), (5.0, 1)]), 6.0),
    # swap only, D2H 4 s per 2 bytes: max(1, 4) + max(3, 4)
    ((1.0, 0.0, 3.0, 2, [(4.0, 4.0, 2, 10)], []), 8.0),
    # both: the best split swaps 1 byte (D2H 1 <= 1, H2D 1) and recomputes 1 (1 s): 1 + 4
    ((1.0, 0.0, 3.0, 2, [(2.0, 2.0, 2, 10)], [(1.0, 1)]), 5.0),
    # not enough candidates: nothing fits
    ((1.0, 0.0, 3.0, 5, [(2.0, 2.0, 2, 10)], [(1.0, 1)]), math.inf),
])
def test_split_bound_by_hand(args, expected):
    assert split_bound(*args) == pytest.approx(expected)


def test_split_bound_deadline_levels():
    # 2 bytes swapped at 1 s each way; first read by op 7, after which 5 s of compute remain:
    # max(0, 2) + max(1 + 0, 2 + 5) = 9 with the deadline, 2 + max(1, 2) = 4 without
    swap = [(2.0, 2.0, 2, 7)]
    assert split_bound(0.0, 0.0, 1.0, 2, swap, []) == pytest.approx(4.0)
    assert split_bound(0.0, 0.0, 1.0, 2, swap, [], [(7, 5.0)]) == pytest.approx(9.0)


@pytest.mark.parametrize("hardware", ["v100-pcie3", "v100-nvlink2"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_exact_is_optimal_and_heuristics_are_within_it(hardware, fraction):
    prob = problem("mlp", fraction, hardware)
    best = plan_exact(prob)
    assert best.step_time == pytest.approx(min(brute_force(prob).values()), rel=1e-12)
    for name in ("pooch", "swap-opt", "local"):
        c = get_planner(name)(prob)
        assert c.fits
        assert c.step_time >= best.step_time * (1 - 1e-12), name
    assert get_planner("local")(prob).step_time <= best.step_time * 1.03  # within 3% of the optimum
    assert best.step_time >= lower_bound(Evaluator(prob)) * (1 - 1e-12)


@pytest.mark.parametrize("name, hardware, fraction", [
    ("cnn_bn", "v100-pcie3", 0.5),
    ("transformer_block", "v100-pcie3", 0.25),
])
def test_exact_on_zoo_graphs_bounds_the_heuristics(name, hardware, fraction):
    prob = problem(name, fraction, hardware)
    best = plan_exact(prob)
    assert lower_bound(Evaluator(prob)) <= best.step_time * (1 + 1e-12)
    for planner in ("pooch", "local"):
        assert get_planner(planner)(prob).step_time >= best.step_time * (1 - 1e-12), planner
    assert get_planner("local")(prob).step_time <= best.step_time * 1.03  # within 3% of the optimum


def test_local_on_a_small_graph_also_starts_from_the_milp_point():
    """transformer_block half way to in-core over PCIe3: the descent settles on swapping the
    attention's inputs and recomputing the MLP (1.097x in-core); the MILP's point recomputes the
    softmax instead, and its neighbourhood holds the optimum (1.062x), which ``local`` reaches."""
    pytest.importorskip("scipy")
    from fxpooch.planners.search import plan_local

    prob = problem("transformer_block", 0.5)
    best = plan_exact(prob)
    assert plan_local(prob).step_time == pytest.approx(best.step_time, rel=1e-12)
    assert plan_local(prob, SearchOptions(milp_nodes=0)).step_time > best.step_time * 1.03


def test_exact_refuses_large_graphs():
    prob = problem("resnet_small", 0.5)
    with pytest.raises(ExactSearchTooLarge, match="max_exact") as info:
        plan_exact(prob, SearchOptions(max_exact=9))
    assert isinstance(info.value, ValueError) and "local" in str(info.value)


@pytest.mark.parametrize("name", ["cnn_bn", "resnet_small", "transformer_block"])
@pytest.mark.parametrize("hardware", ["v100-pcie3", "v100-nvlink2", "h100-pcie5"])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_bound_below_every_planner(name, hardware, fraction):
    prob = problem(name, fraction, hardware)
    bound = lower_bound(Evaluator(prob))
    fitted = 0
    for planner in ("pooch", "swap-opt", "superneurons", "checkpoint", "swap-all", "checkpoint-all"):
        try:
            c = get_planner(planner)(prob)
        except InfeasibleMemoryLimit:
            continue
        fitted += 1
        assert bound <= c.step_time * (1 + 1e-12), planner
    assert fitted


def test_bound_exceeds_in_core_time_when_the_link_is_slow():
    prob = problem("cnn_bn", 0.0, "v100-pcie3")
    in_core = Evaluator(prob).evaluate([K] * len(prob.graph.activations)).step_time
    assert lower_bound(Evaluator(prob)) > in_core * 1.05


def test_bound_is_infinite_below_the_floor():
    prob = problem("cnn_bn", 0.0)
    tight = Problem(prob.graph, prob.costs, prob.graph.resident_bytes + 1)
    assert lower_bound(Evaluator(tight)) == math.inf


def test_seeds_skip_only_reference_plans_that_cannot_win(instances):
    """``seeds`` judges a reference plan only where its time bound is under the best so far: the
    seed is the fastest fitting one of PoocH's plan and the reference plans, each judged."""
    from fxpooch.planners.baselines import checkpoint_plan
    from fxpooch.planners.pooch import plan_pooch
    from fxpooch.planners.search import seeds

    for prob, _ in instances:
        judged = Evaluator(prob)
        try:
            plans = [plan_pooch(prob, ev=judged)]
        except InfeasibleMemoryLimit:
            plans = []
        plans += [judged.evaluate(judged.all_swap()), checkpoint_plan(judged)[0], judged.evaluate(judged.all_recompute())]
        fitting = [c.step_time for c in plans if c is not None and c.fits]
        if not fitting:
            continue
        ev = Evaluator(prob)
        seed = seeds(ev, "test")
        assert seed.step_time == min(fitting)
        for decisions in (ev.all_swap(), ev.all_recompute()):
            if (tuple(decisions), True, None) not in ev._cache:
                assert ev.time_bound(decisions) >= seed.step_time


@pytest.mark.parametrize("name", ["transformer_block", "resnet_small"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_local_search_never_slower_than_pooch(name, fraction):
    prob = problem(name, fraction)
    pooch, local = get_planner("pooch")(prob), get_planner("local")(prob)
    assert local.fits and local.timeline.peak_bytes <= prob.mem_limit
    assert local.step_time <= pooch.step_time


def test_local_trades_decisions_between_activations_of_the_same_bytes():
    """cnn_bn near its floor: recomputing the second convolution's output and keeping the first's
    frees the same bytes by a shorter chain than the reverse, a trade no single change reaches
    (keeping the first alone does not fit). ``local`` finds it: it is no slower than the exact
    search's seeds (PoocH and the reference plans, the MILP's point, each improved by local search)."""
    pytest.importorskip("scipy")
    from fxpooch.planners.search import exact_search

    prob = problem("cnn_bn", 0.25, "v100-pcie3")
    seeded = exact_search(prob, work=1)  # its seeds only (the MILP's bound proves them optimal)
    assert seeded.bound <= seeded.best.step_time
    assert get_planner("local")(prob).step_time <= seeded.best.step_time * (1 + 1e-12)


def test_local_recomputes_a_convolution_with_the_relu_it_reads():
    """resnet_small at its floor over PCIe3: recomputing the stem's ReLU output (3) and the
    convolution that reads it (4) together, as one chain, with the first batch norm's statistics
    (2) swapped rather than recomputed to fit, is 18% faster than swapping both; no single change
    nor trade of two reaches it (each of the two alone does not fit or is slower)."""
    from fxpooch.planners.moves import exchange, linked

    prob = problem("resnet_small", 0.0, "v100-pcie3")
    ev = Evaluator(prob)
    letter = {"k": K, "s": S, "r": R}
    stuck = ev.evaluate([letter[c] for c in "rsrsskksrkksskksrkksskkkrkkkk"])
    assert stuck.fits
    order = sorted(range(len(stuck.decisions)), key=lambda a: -ev.graph.buffers[ev.graph.activations[a].buffer].nbytes)
    moved = linked(ev, stuck, order, stop_at=10**9)
    assert moved is not None and moved.fits and moved.timeline.peak_bytes <= prob.mem_limit
    assert (moved.decisions[2], moved.decisions[3], moved.decisions[4]) == (S, R, R)
    assert moved.step_time < 0.85 * stuck.step_time
    # no single change nor trade helps: without the move local search stops at the stuck plan
    for a, act in enumerate(ev.graph.activations):
        for d in Decision:
            if d is not stuck.decisions[a] and (d is not S or act.swappable):
                c = ev.evaluate([*stuck.decisions[:a], d, *stuck.decisions[a + 1:]])
                assert c is None or not c.fits or c.step_time >= stuck.step_time * (1 - 1e-9)
    assert exchange(ev, stuck, order, stop_at=10**9) is None
    assert get_planner("local")(prob).step_time <= moved.step_time


def test_local_swaps_the_outputs_of_one_op_together():
    """resnet_small at its floor over PCIe5, from the plan ``local`` stopped at before: recompute
    the stem's ReLU output (3) and the convolution that reads it (4) as one chain, and swap both
    saved statistics of the batch norm between them (1, 2) instead of rebuilding them. With only
    one of the two swapped the plan misses the limit, shared or not (it fits with the pair's
    chains apart: the MILP's optimum, test_milp); with both it is 7.8% faster, the fastest plan
    with every chain shared or none (1.900x in-core)."""
    from fxpooch.planners.moves import exchange, linked

    prob = problem("resnet_small", 0.0, "h100-pcie5")
    ev = Evaluator(prob)
    letter = {"k": K, "s": S, "r": R}
    tail = "srkksskksrkksskkkrkkkk"
    stuck = ev.evaluate([letter[c] for c in "rrrsskk" + tail])
    assert stuck.fits
    for one in ("rsrrrkk", "rrsrrkk"):  # the pair with one statistic swapped: over the limit
        c = ev.evaluate([letter[c] for c in one + tail])
        assert c is not None and not c.fits
    order = sorted(range(len(stuck.decisions)), key=lambda a: -ev.graph.buffers[ev.graph.activations[a].buffer].nbytes)
    assert exchange(ev, stuck, order, stop_at=10**9) is None
    moved = linked(ev, stuck, order, stop_at=10**9)
    assert moved is not None and moved.fits and moved.timeline.peak_bytes <= prob.mem_limit
    assert moved.decisions == ev.evaluate([letter[c] for c in "rssrrkk" + tail]).decisions
    assert moved.step_time < 0.93 * stuck.step_time
    assert get_planner("local")(prob).step_time <= moved.step_time


def _stuck_at_floor(name: str, batch: int, hardware: str, plan: str, labels: bool = True):
    """The gap table's problem at the floor of ``name`` on ``hardware`` (``labels=False``: a
    model called without its ``labels``, which returns its logits), its evaluator, the plan of
    the letters ``plan`` (one per activation: k, s or r) and the activations largest first. The
    plans were found with dropouts drawn only in the forward (:func:`stepgraphs.dropout_drawn_only`),
    and are pinned on such a graph."""
    import planners as bench  # benchmarks/planners.py: the gap table's models

    model, x = bench.build(name, batch)
    if not labels:
        x = {k: v for k, v in x.items() if k != "labels"}
    base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hardware)
    graph = dropout_drawn_only(base.graph)
    costs = base.profile.costs(graph)
    floor = Evaluator(Problem(graph, costs, base.in_core_peak_bytes)).floor().timeline.static_peak_bytes
    prob = Problem(graph, costs, floor)
    ev = Evaluator(prob)
    letter = {"k": K, "s": S, "r": R}
    stuck = ev.evaluate([letter[c] for c in plan])
    assert stuck.fits
    order = sorted(range(len(stuck.decisions)), key=lambda a: -ev.graph.buffers[ev.graph.activations[a].buffer].nbytes)
    return prob, ev, stuck, order


def _assert_no_single_trade_or_linked_move_helps(ev, stuck, order) -> None:
    from fxpooch.planners.moves import exchange, linked

    for a, act in enumerate(ev.graph.activations):
        for d in Decision:
            if d is not stuck.decisions[a] and (d is not S or act.swappable):
                c = ev.evaluate([*stuck.decisions[:a], d, *stuck.decisions[a + 1:]])
                assert c is None or not c.fits or c.step_time >= stuck.step_time * (1 - 1e-9)
    assert exchange(ev, stuck, order, stop_at=10**9) is None
    assert linked(ev, stuck, order, stop_at=10**9) is None


def test_local_recomputes_a_cluster_of_a_gelus_intermediates():
    """GPT-2 at 2 layers returning its logits, at its floor over PCIe3, from the plan local search
    alone ends at (1.685x the in-core step). A GELU's intermediates read the MLP's first output and
    one another: recomputing kept activations that read one another together (one short chain) is
    9.6% faster. No single change, trade of two (``exchange``) nor linked pair, with any budget, helps."""
    pytest.importorskip("transformers")
    from fxpooch.planners.moves import clusters

    prob, ev, stuck, order = _stuck_at_floor("gpt2-2L", 8, "v100-pcie3", "sssssrrsssssrssrrrrrrrrskrrrrrskkkkskkkkkkkkkskkkk",
                                             labels=False)
    moved = clusters(ev, stuck, stop_at=ev.simulations + 100)
    assert "".join(d.value[0] for d in moved.decisions) == "sssssrrsssssrssrrrrrrrrskrrrrrskkkkskkkkrrrrkskkkk"
    assert moved.fits and moved.step_time < 0.92 * stuck.step_time
    _assert_no_single_trade_or_linked_move_helps(ev, stuck, order)
    assert get_planner("local")(prob).step_time <= moved.step_time


def test_local_follows_a_change_with_one_near_it():
    """test:transformer_block at its floor over PCIe3, from the plan ``local`` stopped at before it
    had follow-up moves (1.398x the in-core step). Swapping the 1 MiB clone it recomputes fits but
    is slower alone (1.414x); the chain through the clone then no longer runs, and the dropout mask
    two chain links away can stay on the device: 1.338x, the optimum the exact search proves
    (benchmarks/results/planners.json). No single change, trade of two nor linked pair helps."""
    from fxpooch.planners.moves import followups

    prob, ev, stuck, order = _stuck_at_floor("test:transformer_block", 0, "v100-pcie3", "ssrrrrrsskssrrkk")
    clone, mask = 6, 8
    assert (ev.graph.ops[ev.graph.activations[clone].producer].target,
            ev.graph.ops[ev.graph.activations[mask].producer].target) == ("aten.clone.default", "aten.native_dropout.default")
    alone = ev.evaluate([*stuck.decisions[:clone], S, *stuck.decisions[clone + 1:]])
    assert alone.fits and alone.step_time > stuck.step_time
    moved = followups(ev, stuck, order, stop_at=ev.simulations + 200)
    assert "".join(d.value[0] for d in moved.decisions) == "ssrrrrsskkssrrkk"
    assert moved.fits and moved.step_time < 0.96 * stuck.step_time
    _assert_no_single_trade_or_linked_move_helps(ev, stuck, order)
    assert get_planner("local")(prob).step_time <= moved.step_time * (1 + 1e-9)


def test_a_trial_over_the_limit_by_one_kept_activation_is_tried_with_it_recomputed():
    """Four 1 MiB activations in a chain (every op 1 s, every copy 1 s) under a 4 MiB limit (5 in
    core). "krrr" fits with each chain rerun alone: 8 s of ops + 3 + 2 + 1 s of chains = 14 s
    (shared, 11 s, it holds a2 and a3 over the limit). Keeping a2 as well ("kkrr") is over by
    1 MiB in program order, chains apart or not: at g3, a1 and a2 kept, a3 rebuilt, g4's gradient
    and g3's own. a1 and a2 are held there unread, each 1 MiB with a 1 s chain; a1 first:
    "rkrr" fits with its chains shared, 8 + 2 (f3, f4, holding a3) + 1 (f1) = 11 s, then "krrr"."""
    from fxpooch.planners.common import Unjudged
    from fxpooch.planners.moves import faster, repairs
    from zoo import MiB

    graph, costs = chain([1.0] * 4, [1.0] * 4, [1] * 4, [(1.0, 1.0)] * 4)
    plan = {p: [{"k": K, "s": S, "r": R}[c] for c in p] for p in ("krrr", "kkrr", "rkrr")}

    def evaluator(limit_mib: int = 4) -> Evaluator:
        return Evaluator(Problem(graph, costs, limit_mib * MiB))

    ev = evaluator()
    best = ev.evaluate(plan["krrr"])
    assert best.fits and best.step_time == 14.0 and not best.shared
    assert repairs(ev, plan["kkrr"], 4) == []  # not judged yet: nothing known of its schedule
    assert faster(ev, best, plan["kkrr"], repairs_tried=0) is None
    alone = ev.known(plan["kkrr"], share=False)
    assert isinstance(alone, Unjudged) and alone.program_memory.max() == 5 * MiB
    assert graph.ops[alone.layout.instrs[int(alone.program_memory.argmax())].op].name == "g3"
    assert repairs(ev, plan["kkrr"], 4) == [plan["rkrr"], plan["krrr"]]
    assert repairs(ev, plan["kkrr"], 1) == [plan["rkrr"]]

    ev = evaluator()
    found = faster(ev, ev.evaluate(plan["krrr"]), plan["kkrr"])
    assert found.decisions == tuple(plan["rkrr"]) and found.fits and found.step_time == 11.0 and found.shared

    ev = evaluator(3)  # over by 2 MiB there: no one kept activation covers it
    ev.evaluate(plan["kkrr"])
    assert repairs(ev, plan["kkrr"], 4) == []


def test_a_plan_of_another_graphs_length_is_refused_saying_what_to_give():
    from fxpooch.errors import InvalidOption

    graph, costs = chain([1.0] * 4, [1.0] * 4, [1] * 4, [(1.0, 1.0)] * 4)
    ev = Evaluator(Problem(graph, costs, 4 * 2**20))
    with pytest.raises(InvalidOption, match="3 decisions for a graph of 4 activations: give one per activation"):
        ev.evaluate([Decision.KEEP] * 3)
