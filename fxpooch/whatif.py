"""What-if simulations of a plan: the step with one activation's decision changed, the others fixed.

:class:`WhatIfs` answers for one :class:`~fxpooch.plan.Plan`: what keeping, swapping or recomputing
activation ``a`` would cost (:meth:`WhatIfs.overheads`, PoocH's r(X) among them) and the in-core
timeline (every activation kept, same costs). It simulates lazily, once per activation, and keeps
the results; ``plan.what_ifs`` is the one the plan's table and explanations share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from .planners.common import Evaluator, Problem
from .schedule import Decision, build_schedule
from .segments import NotRecomputable, recompute_chain
from .simulator import Timeline, simulate

if TYPE_CHECKING:
    from .plan import Plan


@dataclass(frozen=True)
class WhatIf:
    """The simulated step with one activation's decision changed, the others fixed."""

    step_time: float
    peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class Overheads:
    """What keeping, swapping and recomputing one activation would give (None: impossible)."""

    keep: WhatIf
    swap: WhatIf | None
    recompute: WhatIf | None
    why_not_swap: str = ""
    why_not_recompute: str = ""

    def of(self, decision: str) -> WhatIf | None:
        return {"keep": self.keep, "swap": self.swap, "recompute": self.recompute}[decision]

    @property
    def swap_overhead(self) -> float | None:
        """Step time added by swapping instead of keeping."""
        return None if self.swap is None else self.swap.step_time - self.keep.step_time

    @property
    def recompute_overhead(self) -> float | None:
        return None if self.recompute is None else self.recompute.step_time - self.keep.step_time

    @property
    def r(self) -> float | None:
        """PoocH's r(X) = recompute_overhead / swap_overhead (< 1: recomputing is cheaper)."""
        s, c = self.swap_overhead, self.recompute_overhead
        if s is None or c is None:
            return None
        if s <= 0:  # swapping costs nothing: infinitely cheaper, unless recomputing is free too
            return math.inf if c > 0 else math.nan
        return max(c, 0.0) / s  # recomputing faster than keeping is free (0), not a negative ratio


class WhatIfs:
    """The what-if simulations of ``plan``, made on demand and kept (the plan itself never changes)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._overheads: dict[int, Overheads] = {}

    @cached_property
    def evaluator(self) -> Evaluator:
        """Simulates decision lists on the plan's graph and costs, under the limit it was planned for."""
        p = self.plan
        return Evaluator(Problem(p.graph, p.profile.costs(p.graph), p.mem_limit - p.margin_bytes))

    @cached_property
    def in_core_timeline(self) -> Timeline:
        """The all-keep schedule simulated with the plan's costs (the in-core reference)."""
        graph = self.plan.graph
        keep = [Decision.KEEP] * len(graph.activations)
        return simulate(graph, build_schedule(graph, keep), self.evaluator.problem.costs)

    def overheads(self, index: int) -> Overheads:
        """Keep / swap / recompute what-ifs for activation ``index`` (others as planned)."""
        if index not in self._overheads:
            self._overheads[index] = self._compute(index)
        return self._overheads[index]

    def _compute(self, a: int) -> Overheads:
        plan, ev = self.plan, self.evaluator
        act = plan.graph.activations[a]
        results: dict[Decision, WhatIf | None] = {}
        why_not_swap = "" if act.swappable else "not a dense tensor, cannot be copied as is"
        why_not_recompute = ""
        for d in Decision:
            if d is Decision.SWAP and not act.swappable:
                results[d] = None
                continue
            trial = list(plan.schedule.decisions)
            trial[a] = d
            if d is Decision.RECOMPUTE:
                try:
                    recompute_chain(plan.graph, a, trial)
                except NotRecomputable as e:
                    why_not_recompute = str(e).split(": ", 1)[-1]
            c = ev.evaluate(trial)
            results[d] = None if c is None else WhatIf(c.step_time, c.timeline.peak_bytes, c.fits)
            if c is None and d is Decision.RECOMPUTE and not why_not_recompute:
                why_not_recompute = "another recompute chain cannot be built then"
        keep = results[Decision.KEEP]
        assert keep is not None  # keeping is always possible
        return Overheads(keep, results[Decision.SWAP], results[Decision.RECOMPUTE], why_not_swap,
                         why_not_recompute)
