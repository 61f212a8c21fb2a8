"""Branch and bound over keep / swap / recompute on the simulator: the engine of ``exact`` and of
``local``'s last step (see ``search.py``).

Activations are decided largest first (input side first among equals), so a recompute chain
through earlier recomputes is known when it is priced. Each node is a partial plan; its children
decide the next activation, each with a bound on its completions: ``Bounds.bound``, the keep
completion where it is a bound (see ``bounds.py``), and, with ``FixedBound``, the LP of ``lp.py``
with the decided activations fixed (solved only where the cheaper bounds do not already cut
the child). A child whose bound is no better than the best plan found is cut.

Two orders: depth first (the children best bound first, which finds better plans soonest) or
best first (the open node of least bound, which raises the proved bound soonest). Budgets count
work, not seconds: plans simulated (with or without the limit), bounds evaluated and LPs solved,
so a search's time is bounded by its budget (most children are cut by a bound without a
simulation, and on GPT-2 a bound costs a few simulations' time). When the budget
runs out, every fitting plan is either in an explored or cut subtree (no faster than the best
plan found) or in an open one (no faster than its bound), so the least of the best plan's step
time and the open nodes' bounds is a proved bound on the optimum.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass

from ..schedule import Decision
from .bounds import Bounds
from .common import Candidate, Evaluator
from .fixed import FixedBound

log = logging.getLogger("fxpooch.planner.branch")


@dataclass(frozen=True)
class ExactResult:
    """What a budgeted exact search proved: the best plan found and a bound no plan beats.

    ``bound`` is the least of the best plan's step time and the bounds of the subtrees left open
    when the budget ran out (or the bound on every plan, where larger); ``proved``: nothing was
    left open, so ``best`` is an optimum and ``bound`` its step time (infinite: none fits)."""

    best: Candidate | None
    bound: float
    proved: bool
    nodes: int  # partial plans expanded (leaves included)
    work: int  # plans simulated (with or without the limit), bounds and LPs: what the budget counts

    @property
    def gap(self) -> float:
        """How much slower the best plan may be than the optimum (0 when proved; inf: none found)."""
        if self.best is None:
            return 0.0 if self.proved else math.inf
        return self.best.step_time / self.bound - 1.0 if self.bound > 0 else math.inf


@dataclass
class BranchAndBound:
    """One search: the evaluator, the bounds, the best plan so far and the work done."""

    ev: Evaluator
    bounds: Bounds
    best: Candidate | None
    fixed: FixedBound | None = None  # the LP with the decided activations fixed (None: not used)
    nodes: int = 0
    #: units of work a bound counts: 1 (the exact search's), or as many simulations as take its
    #: time (``local``'s: ``SearchOptions.cuts_per_simulation``)
    bound_work: int = 1

    @property
    def work(self) -> int:
        return (self.ev.simulations + self.bound_work * self.bounds.evaluations
                + (0 if self.fixed is None else self.fixed.solves))

    @property
    def incumbent(self) -> float:
        return math.inf if self.best is None else self.best.step_time

    def improve(self, candidate: Candidate | None) -> None:
        if candidate is not None and candidate.fits and candidate.step_time < self.incumbent:
            self.best = candidate

    def child_bound(self, decided: list[Decision | None]) -> float:
        """A bound on every completion of ``decided``; infinite when none can be realised or fit."""
        keep = [Decision.KEEP if d is None else d for d in decided]
        if not all(self.ev.recomputable_alone[a] for a, d in enumerate(decided) if d is Decision.RECOMPUTE):
            return math.inf  # chains only grow as more is recomputed
        out = self.bounds.bound(decided)
        if out < math.inf and self.bounds.keep_completion_is_bound(decided):
            out = max(out, self.ev.unconstrained_time(keep))
        if self.fixed is not None and out < self.incumbent:
            out = max(out, self.fixed.bound(decided))
        return out

    def run(self, stop_at: float = math.inf, best_first: bool = False, root_bound: float = 0.0) -> ExactResult:
        """Search until every node is explored or cut, or ``self.work`` reaches ``stop_at``."""
        acts = self.ev.graph.activations
        nbytes = [self.ev.graph.buffers[act.buffer].nbytes for act in acts]
        order = sorted(range(len(acts)), key=lambda a: (-nbytes[a], max(acts[a].members)))
        seq = itertools.count()
        # (bound, -depth, sequence, decisions): best first takes the least bound, deepest first
        frontier: list[tuple[float, int, int, tuple[Decision | None, ...]]] = [(root_bound, 0, next(seq), (None,) * len(acts))]
        while frontier:
            node = heapq.heappop(frontier) if best_first else frontier.pop()
            lb, depth = node[0], -node[1]
            if lb >= self.incumbent:
                if best_first:  # every open node is bounded no better
                    frontier.clear()
                continue
            if self.work >= stop_at:
                frontier.append(node)
                break
            self.nodes += 1
            decided = list(node[3])
            if depth == len(order):
                self.improve(self.ev.evaluate(decided))
                continue
            a = order[depth]
            children = []
            for d in Decision:
                if d is Decision.SWAP and not acts[a].swappable:
                    continue
                decided[a] = d
                children.append((self.child_bound(decided), d is not Decision.KEEP, d))
            for bound, _, d in sorted(children, reverse=not best_first):  # a stack pops the best last pushed
                if bound < self.incumbent:
                    decided[a] = d
                    entry = (bound, -(depth + 1), next(seq), tuple(decided))
                    heapq.heappush(frontier, entry) if best_first else frontier.append(entry)
        open_bound = min((node[0] for node in frontier), default=math.inf)
        proved = open_bound >= self.incumbent
        bound = self.incumbent if proved else max(root_bound, min(self.incumbent, open_bound))
        return ExactResult(self.best, bound, proved, self.nodes, self.work)

