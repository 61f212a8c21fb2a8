"""Beyond PoocH's heuristic: local search over the simulator, and an exact optimum for small graphs.

``local`` starts from the best of PoocH's plan and the reference plans (swap-all, sqrt(n)
checkpointing, recompute everything), applies changes to groups of activations that repeat
across blocks (a layer's attention scores in every layer, say), then single-activation changes
(keep / swap / recompute) that make the simulated step faster while the peak stays under the limit, until no
change helps or its budget (op-simulations, so the plan does not depend on the machine) is
spent; on graphs small enough it then runs the exact search's branch and bound from that plan
with the budget left. It is never slower than ``pooch`` nor than any reference plan that fits. ``exact`` finds
the optimum over every decision vector (3^n) by branch and bound on the simulator, for graphs
of at most ``SearchOptions.max_exact`` activations; with ``bounds.lower_bound`` on larger ones
it measures how far the heuristics are from the optimum.
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
from .common import Candidate, Evaluator, Problem, require_fit, simulation_budget
from .pooch import plan_pooch

log = logging.getLogger("fxpooch.planner.search")


@dataclass(frozen=True)
class SearchOptions:
    #: work for the whole ``local`` planner, its seeds included, in op-simulations (a simulation
    #: of a step of n ops counts n; see ``PoochOptions.step_work``): deterministic, and a planning
    #: time linear in the graph's size. On this project's 2-core machine a 2,000-op step plans in
    #: at most about 5 s, GPT-2 at 48 layers (8,683 ops) in 10 to 24 s (both under load).
    work: int = 500_000
    #: fewest simulations the search gets however large the graph (PoocH's seed included): its
    #: group moves need about as many as a block has kinds of activation times a few, whatever
    #: the depth, so past ``work / min_simulations`` ops the planning time grows linearly
    min_simulations: int = 200
    #: most simulations the search runs however small the graph
    max_simulations: int = 50_000
    #: largest number of activations the exact search accepts: its worst case is 3**n
    #: simulations; up to 16 it usually proves the optimum within a minute, but a limit at the
    #: floor with a fast link (many plans within a few percent) can take minutes from 13 on
    max_exact: int = 20


def local_search(ev: Evaluator, seed: Candidate, simulations: int) -> Candidate:
    """First-improvement descent over single-activation changes, largest activations first,
    until no change helps or ``simulations`` more plans have been judged."""
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
                c = ev.evaluate(trial)
                if c is not None and c.fits and c.step_time < best.step_time * (1 - 1e-9):
                    best, improved = c, True
                    break
            if ev.simulations >= stop_at:
                break
    log.info("local search: %.4g s -> %.4g s (%d evaluations)", seed.step_time, best.step_time, ev.evaluations)
    return best


def repeated_groups(ev: Evaluator) -> list[list[int]]:
    """Activations that play the same part in repeated blocks (transformer layers, residual
    stages): same producing op target, bytes and member count; groups of two or more, largest
    total bytes first, each in program order."""
    graph = ev.graph
    by_kind: dict[tuple, list[int]] = {}
    for a, act in enumerate(graph.activations):
        key = (graph.ops[act.producer].target, graph.buffers[act.buffer].nbytes, len(act.members))
        by_kind.setdefault(key, []).append(a)
    return sorted((g for g in by_kind.values() if len(g) > 1),
                  key=lambda g: (-len(g) * graph.buffers[graph.activations[g[0]].buffer].nbytes, g[0]))


def halves(groups: list[list[int]]) -> list[list[int]]:
    """Each group's input-side and output-side halves (those of two or more members)."""
    return [part for g in groups for part in (g[:len(g) // 2], g[len(g) // 2:]) if len(part) > 1]


def group_descent(ev: Evaluator, seed: Candidate, groups: list[list[int]], stop_at: int) -> Candidate:
    """First-improvement descent where each move sets a whole group to keep, swap or recompute,
    until no move helps or ``ev.simulations`` reaches ``stop_at``."""
    best = seed
    acts = ev.graph.activations
    improved = True
    while improved and ev.simulations < stop_at:
        improved = False
        for group in groups:
            for d in Decision:
                if ev.simulations >= stop_at:
                    break
                members = [a for a in group if d is not Decision.SWAP or acts[a].swappable]
                if all(best.decisions[a] is d for a in members):
                    continue
                trial = list(best.decisions)
                for a in members:
                    trial[a] = d
                c = ev.evaluate(trial)
                if c is not None and c.fits and c.step_time < best.step_time * (1 - 1e-9):
                    best, improved = c, True
    return best


def group_search(ev: Evaluator, seed: Candidate, simulations: int) -> Candidate:
    """Like :func:`local_search`, but each move sets a whole :func:`repeated_groups` group to
    keep, swap or recompute: a few simulations cover every layer of a deep model, however deep.
    Whole groups first until no move helps, then their halves as well (a plan that differs
    between the input-side and output-side layers)."""
    stop_at = ev.simulations + simulations
    groups = repeated_groups(ev)
    best = group_descent(ev, seed, groups, stop_at)
    best = group_descent(ev, best, groups + halves(groups), stop_at)
    log.info("group search: %.4g s -> %.4g s (%d kinds, %d simulations)", seed.step_time, best.step_time,
             len(groups), ev.simulations - stop_at + simulations)
    return best


def seeds(ev: Evaluator, name: str) -> Candidate:
    """The fastest fitting plan of PoocH and the reference plans (swap-all, sqrt(n) checkpointing,
    recompute everything): the search starts no worse than any of them."""
    best = None
    try:
        best = plan_pooch(ev.problem, name=name, ev=ev)
    except InfeasibleMemoryLimit:
        pass
    for c in (ev.evaluate(ev.all_swap()), checkpoint_plan(ev)[0], ev.evaluate(ev.all_recompute())):
        if c is not None and c.fits and (best is None or c.step_time < best.step_time):
            best = c
    return require_fit(ev, best, name)


def plan_local(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    """The best of PoocH's plan and the reference plans, then local search; on graphs small
    enough for the exact search, branch and bound from there with the simulations left (the
    optimum when it finishes)."""
    ev = Evaluator(problem)
    stop_at = simulation_budget(problem.graph, options.work, options.max_simulations, options.min_simulations)
    best = seeds(ev, "local")
    best = group_search(ev, best, max(0, stop_at - ev.simulations))
    best = local_search(ev, best, max(0, stop_at - ev.simulations))
    if len(problem.graph.activations) <= options.max_exact and ev.simulations < stop_at:
        search = _branch_and_bound(ev, best, stop_at)
        log.info("local: branch and bound %s after %d nodes", "stopped at the budget" if search.stopped
                 else "proved the optimum", search.nodes)
        best = search.best
    return best


class ExactSearchTooLarge(FxpoochError, ValueError):
    """The graph has more activations than the exact search accepts."""


@dataclass
class _Search:
    """Depth-first branch and bound over decisions in ``order`` (see ``plan_exact``)."""

    ev: Evaluator
    bounds: Bounds
    order: list[int]
    best: Candidate | None
    stop_at: float = math.inf  # ``ev.simulations`` at which the search gives up
    nodes: int = 0
    stopped: bool = False

    def improve(self, candidate: Candidate | None) -> None:
        if candidate is not None and candidate.fits and (self.best is None or candidate.step_time < self.best.step_time):
            self.best = candidate

    def child_bound(self, decided: list[Decision | None]) -> float:
        """A bound on every completion of ``decided``; infinite when none can be realised or fit."""
        keep = [Decision.KEEP if d is None else d for d in decided]
        if not all(self.ev.can_recompute(a, keep) for a, d in enumerate(decided) if d is Decision.RECOMPUTE):
            return math.inf  # chains only grow as more is recomputed
        out = self.bounds.bound(decided)
        if out < math.inf and self.bounds.keep_completion_is_bound(decided):
            out = max(out, self.ev.unconstrained_time(keep))
        return out

    def visit(self, decided: list[Decision | None], depth: int) -> None:
        self.nodes += 1
        if self.stopped or self.ev.simulations >= self.stop_at:
            self.stopped = True
            return
        if depth == len(self.order):
            self.improve(self.ev.evaluate(decided))
            return
        a = self.order[depth]
        children = []
        for d in Decision:
            if d is Decision.SWAP and not self.ev.graph.activations[a].swappable:
                continue
            decided[a] = d
            children.append((self.child_bound(decided), d is not Decision.KEEP, d))
        for lb, _, d in sorted(children):
            if lb == math.inf or (self.best is not None and lb >= self.best.step_time):
                break
            decided[a] = d
            self.visit(decided, depth + 1)
        decided[a] = None


def plan_exact(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    """The fastest fitting plan over all 3^n decision vectors (prefetch as early as memory allows).

    Branch and bound: activations are decided largest first (input side first among equals),
    so a recompute chain through earlier recomputes is known when it is priced; a subtree is cut when the
    bound on its completions (``Bounds.bound``, and the keep completion where it is a bound,
    see fxpooch.planners.bounds) is no better than the best plan found, which starts as the
    plan of PoocH improved by local search. Ties keep the first plan found, so the result is an optimum, not
    necessarily the same vector as exhaustive enumeration would return.
    """
    n = len(problem.graph.activations)
    if n > options.max_exact:
        raise ExactSearchTooLarge(
            f"exact search over {n} activations may need up to 3**{n} simulations; it accepts at most "
            f"{options.max_exact} (SearchOptions.max_exact). Use the 'local' planner, and "
            f"fxpooch.planners.bounds.lower_bound for how far it can be from the optimum.")
    ev = Evaluator(problem)
    try:
        seed = local_search(ev, seeds(ev, "exact"),
                            simulation_budget(problem.graph, options.work, options.max_simulations))
    except InfeasibleMemoryLimit:
        seed = None
    search = _branch_and_bound(ev, seed)
    log.info("exact: %d activations, %d nodes, %d evaluations, step %.4g s", n, search.nodes, ev.evaluations,
             math.inf if search.best is None else search.best.step_time)
    return require_fit(ev, search.best, "exact")


def _branch_and_bound(ev: Evaluator, seed: Candidate | None, stop_at: float = math.inf) -> _Search:
    acts = ev.graph.activations
    nbytes = [ev.graph.buffers[act.buffer].nbytes for act in acts]
    order = sorted(range(len(acts)), key=lambda a: (-nbytes[a], max(acts[a].members)))
    search = _Search(ev, Bounds(ev), order, seed, stop_at)
    search.visit([None] * len(acts), 0)
    return search


@register("local")
def local(problem: Problem) -> Candidate:
    """PoocH's plan improved by local search on the simulator (never slower than ``pooch``)."""
    return plan_local(problem)


@register("exact")
def exact(problem: Problem) -> Candidate:
    """Exhaustive search: the optimum for small graphs (a reference for the heuristics' gap)."""
    return plan_exact(problem)
