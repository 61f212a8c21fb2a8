"""Reference planners: keep everything, or swap everything."""
from __future__ import annotations

from . import register
from .common import Candidate, Evaluator, Problem, require_fit


@register("in-core")
def in_core(problem: Problem) -> Candidate:
    """Keep every activation on the device (no out-of-core)."""
    ev = Evaluator(problem)
    return require_fit(ev, ev.evaluate(ev.all_keep()), "in-core")


@register("swap-all")
def swap_all(problem: Problem) -> Candidate:
    """Swap every activation; each swap-in issued as early as memory allows (section 4.3)."""
    ev = Evaluator(problem)
    return require_fit(ev, ev.evaluate(ev.all_swap()), "swap-all")


@register("checkpoint-all")
def checkpoint_all(problem: Problem) -> Candidate:
    """Recompute every activation that can be recomputed; swap the rest."""
    ev = Evaluator(problem)
    return require_fit(ev, ev.evaluate(ev.all_recompute()), "checkpoint-all")
