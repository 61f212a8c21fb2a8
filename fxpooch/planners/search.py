"""Beyond PoocH's heuristic: local search over the simulator, and an exact optimum for small graphs.

``local`` starts from the best of PoocH's plan, the reference plans (swap-all, sqrt(n)
checkpointing, recompute everything) and, on graphs too large for the exact search, the split plans
(``split.py``: the forward's first activations swapped, the rest recomputed), applies changes to
groups of activations that repeat across blocks (``groups.py``: a layer's attention scores in
every layer, say) and trades between two such groups (one kept, the other freed; or one swapped, the other
recomputed), then clusters of kept activations that read one another, then single-activation
changes (keep / swap / recompute) that make the simulated step faster while the peak stays under
the limit, until no change helps or its budget (op-simulations, so the plan does not depend on the
machine) is spent (where the budget left is short of one pass of single changes, those first, and
clusters and single changes again only if no change helps before it ends); on graphs small enough
it then runs the exact search's branch and bound from that plan, or from the MILP's point
improved the same way where that is faster (with scipy), with the budget left. It is never
slower than ``pooch`` nor than any reference plan that fits. ``exact`` finds the optimum over
every decision vector (3^n) by branch and bound on the simulator (``branch.py``), for graphs of
at most ``SearchOptions.max_exact`` activations; ``exact_search`` runs it on any graph within a
budget and returns the best plan found with a proved bound on the optimum, which measures how far
the heuristics are from it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..errors import FxpoochError, InfeasibleMemoryLimit
from ..schedule import Decision
from .registry import register
from .baselines import checkpoint_plan
from .bounds import Bounds
from .branch import BranchAndBound, ExactResult
from .fixed import FixedBound
from .lpmodel import MAX_NONZEROS, ModelTooLarge
from .common import Candidate, Evaluator, Problem, require_fit, simulation_budget
from .groups import group_search
from .moves import clusters, exchange, faster, followups, linked
from .pooch import PoochOptions, plan_pooch
from .split import split_seed

log = logging.getLogger("fxpooch.planner.search")


@dataclass(frozen=True)
class SearchOptions:
    #: work for the whole ``local`` planner, its seeds included, in op-simulations (a simulation
    #: of a step of n ops counts n; see ``PoochOptions.step_work``): deterministic, and a planning
    #: time linear in the graph's size. On this project's 2-core machine HF GPT-2 at 12 layers
    #: (2,239 ops) plans in 4.7 and 2.7 s and at 48 layers (8,683 ops) in 21.2 and 26.2 s at its
    #: floor and half way to in-core over PCIe5 (``benchmarks/plan_time.py``, which also times the
    #: machine's Python; its speed varies: benchmarks/PLANNERS.md, "Planning time"). A plan over
    #: the limit in program order, or no faster by its step-time bound, counts
    #: an eighth (``common.REJECTIONS_PER_SIMULATION``).
    work: int = 500_000
    #: fewest simulations the search gets however large the graph (PoocH's seed included): its
    #: group moves need about as many as a block has kinds of activation times a few, whatever
    #: the depth, so past ``work / min_simulations`` ops the planning time grows linearly. 300
    #: since plans over the limit cost an eighth: GPT-2 48L's PCIe3 floor planned 1.869x in-core
    #: with 200, 1.695x with 300 (what 8x the work finds), 24L's 1.766x -> 1.727x
    min_simulations: int = 300
    #: most simulations the search runs however small the graph
    max_simulations: int = 50_000
    #: largest number of activations the exact search accepts: its worst case is 3**n
    #: simulations; up to 16 it usually proves the optimum within a minute, but a limit at the
    #: floor with a fast link (many plans within a few percent) can take minutes from 13 on
    max_exact: int = 20
    #: the exact search's evaluator shares recompute chains in part wherever the shared schedule
    #: is over the limit, not only where the unshared one fits (``Evaluator.share_in_part_always``),
    #: so plans the MILP's bound counts are among those it finds: test:resnet_small's PCIe5 floor
    #: (29 activations) 1.900x in-core -> 1.894x, the bound. On a graph it cannot search whole the
    #: trials take budget from the search: GPT-2 at 2 layers (49 activations) over PCIe3 at its
    #: floor, its best plan 1.480x -> 1.634x with the same work
    exact_shares_in_part: bool = True
    #: the exact search also prunes with the LP of ``lp.py`` with the decided activations fixed,
    #: after probing (``fixed.py``; where scipy is installed; probing's LPs, once, are not counted
    #: as work): one solve per child not cut by the cheaper bounds.
    #: Off by default: a solve costs several simulations' time, and away from the floor the cut
    #: bounds alone prove the zoo's 13-16 activation graphs sooner. At a floor only the LP lifts the
    #: bound (test:cnn_bn's PCIe5 floor: proved in 24k units of work with it, left 19% open after
    #: 32k without); ``benchmarks/planners.py`` turns it on up to ``max_exact`` activations
    lp_bounds: bool = False
    #: HiGHS's node limit on the root MILP (its bound and its point, a seed; 0: none) of the exact
    #: search and of ``local``'s branch and bound (graphs of at most ``max_exact`` activations, where
    #: scipy is installed): about 8 CPU seconds on GPT-2 at 2 layers (49 activations), 0.5 to 5 s
    #: on the test zoo's 3 to 16. Its point lies in another basin than the descent's: on
    #: test:transformer_block half way to in-core over PCIe3, the optimum (1.062x in-core, not 1.097x)
    milp_nodes: int = 200
    #: the cut bounds that cost about one simulation's time on the graphs ``local``'s branch and
    #: bound runs on (at most ``max_exact`` activations, a few hundred ops): its bounds count as
    #: that many simulations of its budget. test:cnn_bn (93 ops, 11 cuts): a bound 1.7 to 2.2 ms, a
    #: simulation 0.5 to 0.7 ms; counted as one, its bounds took most of up to 18 CPU s of planning
    cuts_per_simulation: int = 3
    #: ``local`` also starts from the plans that swap these fractions of the forward's activations
    #: and recompute the rest, brought under the limit within this share of its budget more
    #: (``split.py``; graphs of more than ``max_exact`` activations); ``()``: not. Near the floor
    #: the descent from PoocH's plan and the reference plans stays swap-heavy: GPT-2 at 12 layers
    #: over PCIe3 at its floor planned 3.374x in-core from them, 2.454x from a split plan
    splits: tuple[float, ...] = (0.125, 0.25, 0.375)
    split_work: float = 1 / 3
    #: work of each of the two steps of PoocH's plan, ``local``'s first seed (``PoochOptions.step_work``;
    #: its own default is 150,000): past the test zoo's graphs, the descent after it uses that work
    #: better (GPT-2 at 12 layers and ResNet-50 at their floors and half way to in-core, over PCIe3
    #: and PCIe5: 0.3-1.8% faster plans on 5 of those 8 rows with 50,000, the others the same)
    seed_work: int = 50_000


#: changes :func:`local_search` tries per activation in one pass (the two other decisions)
SINGLE_CHANGES = len(Decision) - 1


def local_search(ev: Evaluator, seed: Candidate, simulations: int) -> Candidate:
    """First-improvement descent over single-activation changes, largest activations first, then
    (where none helps) trades between two activations of the same bytes (:func:`exchange`), then
    changes of two linked activations (:func:`linked`), then a change with a follow-up near it
    (:func:`followups`), until no change helps or
    ``simulations`` more plans have been judged."""
    stop_at = ev.simulations + simulations
    floor = ev.evaluate(ev.all_keep()).step_time  # nothing beats in-core (cheaper than lower_bound)
    best = seed
    order = sorted(range(len(seed.decisions)), key=lambda a: -ev.graph.buffers[ev.graph.activations[a].buffer].nbytes)
    improved = True
    while improved and best.step_time > floor and ev.simulations < stop_at:
        improved = False
        for a in order:
            for d in Decision:
                if d is best.decisions[a] or (d is Decision.SWAP and not ev.graph.activations[a].swappable):
                    continue
                if ev.simulations >= stop_at:
                    break
                trial = list(best.decisions)
                trial[a] = d
                if (c := faster(ev, best, trial)) is not None:
                    best, improved = c, True
                    break
            if ev.simulations >= stop_at:
                break
        for move in (exchange, linked, followups):
            if not improved and ev.simulations < stop_at:
                found = move(ev, best, order, stop_at)
                best, improved = (found, True) if found is not None else (best, False)
    log.info("local search: %.4g s -> %.4g s (%d evaluations)", seed.step_time, best.step_time, ev.evaluations)
    return best


def seeds(ev: Evaluator, name: str, pooch: PoochOptions = PoochOptions()) -> Candidate:
    """The fastest fitting plan of PoocH (with ``pooch``) and the reference plans (swap-all, sqrt(n)
    checkpointing, recompute everything): the search starts no worse than any of them. A
    reference plan whose time bound (:meth:`~.Evaluator.cannot_beat`) is no better than the best
    so far is not judged: it could not be chosen (recomputing everything on GPT-2 at 48 layers,
    half way to in-core, is 1.48x in-core by its bound against PoocH's 1.37x, and judging it, its
    chains rebuilt alone, took 40% of the planning time)."""
    best = None
    try:
        best = plan_pooch(ev.problem, pooch, name=name, ev=ev)
    except InfeasibleMemoryLimit:
        pass

    def better(c: Candidate | None) -> None:
        nonlocal best
        if c is not None and c.fits and (best is None or c.step_time < best.step_time):
            best = c

    def judged(decisions: tuple[Decision, ...]) -> Candidate | None:
        return None if best is not None and ev.cannot_beat(decisions, best.step_time) else ev.evaluate(decisions)

    better(judged(ev.all_swap()))
    better(checkpoint_plan(ev)[0])
    better(judged(ev.all_recompute()))
    return require_fit(ev, best, name)


def plan_local(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    """The best of PoocH's plan, the reference plans and the split plans (``split.py``), then the
    moves of repeated groups, of clusters (:func:`~fxpooch.planners.moves.clusters`, at most half
    the simulations left) and local search. Where the simulations left do not cover one pass of
    single changes (:data:`SINGLE_CHANGES` per activation), local search comes first and clusters
    only if it ends before the budget: on deep models the budget ends inside the first descent,
    and single changes are what it buys most of (GPT-2 at 48 layers at its PCIe3 floor: 6 of
    them, each an attention-sized activation recomputed instead of swapped, 1.853x -> 1.697x
    in-core in 12 simulations, after clusters had spent 11 finding nothing; with local search
    first, 1.679x). Where they do, clusters first: on GPT-2 at 2 layers returning its logits, at
    its floor, a cluster move is 9.6% faster than where local search alone ends. For the same
    reason the group moves' last descent keeps those simulations in reserve
    (:func:`~.groups.group_search`). On graphs
    small enough for the exact search, the MILP's point improved the same way (:func:`milp_seed`)
    and branch and bound from the better plan with the simulations left and the MILP's bound at
    its root (the optimum when it finishes)."""
    ev = Evaluator(problem)
    stop_at = simulation_budget(problem.graph, options.work, options.max_simulations, options.min_simulations)
    best = seeds(ev, "local", PoochOptions(step_work=options.seed_work))
    if options.splits and len(problem.graph.activations) > options.max_exact:  # smaller: the exact search's
        spent = ev.simulations
        split = split_seed(ev, options.splits, ev.simulations + int(options.split_work * stop_at))
        best = split if split is not None and split.step_time < best.step_time else best
        stop_at += ev.simulations - spent  # more work, not less for the descent
    single_pass = SINGLE_CHANGES * len(problem.graph.activations)
    best = group_search(ev, best, max(0, stop_at - ev.simulations), single_pass)
    clusters_first = stop_at - ev.simulations >= single_pass
    if clusters_first:
        best = clusters(ev, best, ev.simulations + (stop_at - ev.simulations) // 2)
    best = local_search(ev, best, max(0, stop_at - ev.simulations))
    if not clusters_first and ev.simulations < stop_at:  # the descent ended before the budget
        best = clusters(ev, best, ev.simulations + (stop_at - ev.simulations) // 2)
        best = local_search(ev, best, max(0, stop_at - ev.simulations))
    if len(problem.graph.activations) <= options.max_exact and ev.simulations < stop_at:
        bounds = Bounds(ev)
        root = bounds.bound()
        fixed = fixed_bound(bounds) if options.milp_nodes else None
        if fixed is not None:
            milp_bound, point = milp_seed(ev, fixed, options.milp_nodes, max(0, stop_at - ev.simulations))
            root = max(root, milp_bound)
            if point is not None and point.step_time < best.step_time:
                best = point
        bound_work = max(1, -(-len(bounds.cuts) // options.cuts_per_simulation))
        search = BranchAndBound(ev, bounds, best, bound_work=bound_work).run(stop_at, root_bound=root)  # depth first
        log.info("local: branch and bound %s after %d nodes", "proved the optimum" if search.proved
                 else "stopped at the budget", search.nodes)
        best = search.best
    return best


def fixed_bound(bounds: Bounds, probed: bool = False) -> FixedBound | None:
    """The LP / MILP of ``fixed.py`` for ``bounds``' problem (``probed``: after probing); None
    without scipy, or where its model would pass :data:`.lp.MAX_NONZEROS` (GPT-2 6L's, 10M
    nonzeros: its root MILP ran half an hour at 9.6 GB, outside any budget of work)."""
    try:
        return FixedBound(bounds, probed, MAX_NONZEROS)
    except ImportError:
        log.info("scipy is not installed: no LP / MILP bound or seed")
        return None
    except ModelTooLarge as e:
        log.info("LP / MILP bound and seed: %s (%d activations); none", e, len(bounds.ev.graph.activations))
        return None


def milp_seed(ev: Evaluator, fixed: FixedBound, nodes: int, simulations: int) -> tuple[float, Candidate | None]:
    """The MILP's dual bound after ``nodes`` of HiGHS's nodes and its point, :func:`repair`-ed and
    improved by ``simulations`` more of local search (None: none fits): a plan in another basin
    than the descent's, and a bound for a branch and bound's root."""
    bound, decisions = fixed.milp([None] * len(ev.graph.activations), nodes)
    start = None if decisions is None else repair(ev, decisions)
    return bound, None if start is None else local_search(ev, start, simulations)


class ExactSearchTooLarge(FxpoochError, ValueError):
    """The graph has more activations than the exact search accepts."""


def repair(ev: Evaluator, decisions: list[Decision]) -> Candidate | None:
    """The plan of ``decisions`` where it fits, else the fastest fitting plan one change away
    (None: none). The MILP's point often misses the limit by a few bytes its model does not
    see (a buffer of a chain, an op's scratch); a neighbour fits and keeps its structure."""
    c = ev.evaluate(decisions)
    if c is not None and c.fits:
        return c
    best = None
    for a, act in enumerate(ev.graph.activations):
        for d in Decision:
            if d is decisions[a] or (d is Decision.SWAP and not act.swappable):
                continue
            c = ev.evaluate([*decisions[:a], d, *decisions[a + 1:]])
            if c is not None and c.fits and (best is None or c.step_time < best.step_time):
                best = c
    return best


def exact_search(problem: Problem, options: SearchOptions = SearchOptions(), work: float = math.inf) -> ExactResult:
    """Branch and bound as ``plan_exact``, on a graph of any size, stopped once ``work`` plans have
    been simulated, bounds evaluated and LPs solved (its seeds included): the best plan found and
    a proved bound.

    Seeds: PoocH's plan and the reference plans improved by local search, and (with
    ``options.milp_nodes``) the MILP's point, :func:`repair`-ed where it does not fit, improved the
    same way; the MILP's dual bound joins the root's. Best first, so the proved bound rises as
    fast as the bounds allow. Deterministic, and its time bounded by ``work``: the budget counts
    simulations, bounds and solves, not seconds. Where it runs out the result is not an optimum
    (``proved`` is False) but ``bound`` is still a lower bound on every fitting plan's step time,
    so ``best`` is within ``gap`` of the optimum. ``options.exact_shares_in_part``: its evaluator
    shares recompute chains in part wherever the shared schedule is over the limit."""
    ev = Evaluator(problem, share_in_part_always=options.exact_shares_in_part)
    local_budget = simulation_budget(problem.graph, options.work, options.max_simulations)
    try:
        seed = local_search(ev, seeds(ev, "exact"), local_budget)
    except InfeasibleMemoryLimit:
        seed = None
    bounds = Bounds(ev)
    root = bounds.bound()
    search = BranchAndBound(ev, bounds, seed)
    fixed = fixed_bound(bounds, options.lp_bounds) if (options.lp_bounds or options.milp_nodes) and root < math.inf else None
    if fixed is not None and options.milp_nodes:
        milp_bound, point = milp_seed(ev, fixed, options.milp_nodes, local_budget)
        root = max(root, milp_bound)
        search.improve(point)
    search.fixed = fixed if options.lp_bounds else None
    out = search.run(work, best_first=True, root_bound=root)
    log.info("exact: %d activations, %d nodes, work %d, step %.4g s, bound %.4g s%s",
             len(problem.graph.activations), out.nodes, out.work,
             math.inf if out.best is None else out.best.step_time, out.bound, "" if out.proved else " (stopped)")
    return out


def plan_exact(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    """The fastest fitting plan over all 3^n decision vectors (prefetch as early as memory allows).

    Branch and bound: activations are decided largest first (input side first among equals),
    so a recompute chain through earlier recomputes is known when it is priced; a subtree is cut when the
    bound on its completions (``Bounds.bound``, and the keep completion where it is a bound,
    see fxpooch.planners.bounds) is no better than the best plan found, which starts as the
    plan of PoocH improved by local search. Ties keep the first plan found, so the result is an optimum, not
    necessarily the same vector as exhaustive enumeration would return. Larger graphs:
    :func:`exact_search` with a budget.
    """
    n = len(problem.graph.activations)
    if n > options.max_exact:
        raise ExactSearchTooLarge(
            f"exact search over {n} activations may need up to 3**{n} simulations; it accepts at most "
            f"{options.max_exact} (SearchOptions.max_exact). Use the 'local' planner, and "
            f"fxpooch.planners.search.exact_search with a budget (a plan and a proved bound) or "
            f"fxpooch.planners.bounds.lower_bound for how far it can be from the optimum.")
    out = exact_search(problem, options)
    return require_fit(Evaluator(problem), out.best, "exact")


@register("local")
def local(problem: Problem) -> Candidate:
    """PoocH's plan improved by local search on the simulator (never slower than ``pooch``)."""
    return plan_local(problem)


@register("exact")
def exact(problem: Problem) -> Candidate:
    """Exhaustive search: the optimum for small graphs (a reference for the heuristics' gap)."""
    return plan_exact(problem)
