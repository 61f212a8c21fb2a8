"""Beyond PoocH's heuristic: local search over the simulator, and an exact optimum for small graphs.

``local`` starts from PoocH's plan and applies single-activation changes (keep / swap /
recompute) that make the simulated step faster while the peak stays under the limit, until no
change helps or the time budget is spent; it is never slower than ``pooch``. ``exact``
enumerates every decision vector (3^n) for graphs of at most ``SearchOptions.max_exact``
activations, which measures how far the heuristics are from the optimum.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from ..schedule import Decision
from . import register
from .common import Candidate, Evaluator, Problem, require_fit
from .pooch import plan_pooch

log = logging.getLogger("fxpooch.planner.search")


@dataclass(frozen=True)
class SearchOptions:
    #: wall-clock seconds the local search may spend after PoocH's plan
    time_budget: float = 20.0
    #: largest number of activations the exhaustive search accepts (3**n simulations)
    max_exact: int = 9


def lower_bound(ev: Evaluator) -> float:
    """No plan is faster than running every op once with nothing to wait for: the in-core time."""
    return ev.evaluate(ev.all_keep()).step_time


def local_search(ev: Evaluator, seed: Candidate, options: SearchOptions) -> Candidate:
    """First-improvement descent over single-activation changes, largest activations first."""
    deadline = time.perf_counter() + options.time_budget
    floor = lower_bound(ev)
    best = seed
    order = sorted(range(len(seed.decisions)), key=lambda a: -ev.graph.buffers[ev.graph.activations[a].buffer].nbytes)
    improved = True
    while improved and best.step_time > floor and time.perf_counter() < deadline:
        improved = False
        for a in order:
            for d in Decision:
                if d is best.decisions[a] or (d is Decision.SWAP and not ev.graph.activations[a].swappable):
                    continue
                trial = list(best.decisions)
                trial[a] = d
                c = ev.evaluate(trial)
                if c is not None and c.fits and c.step_time < best.step_time * (1 - 1e-9):
                    best, improved = c, True
                    break
            if time.perf_counter() >= deadline:
                break
    log.info("local search: %.4g s -> %.4g s (%d evaluations)", seed.step_time, best.step_time, ev.evaluations)
    return best


def plan_local(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    seed = plan_pooch(problem, name="local")
    return local_search(Evaluator(problem), seed, options)


def plan_exact(problem: Problem, options: SearchOptions = SearchOptions()) -> Candidate:
    """The fastest fitting plan among all 3^n decision vectors (prefetch as early as memory allows)."""
    ev = Evaluator(problem)
    n = len(problem.graph.activations)
    if n > options.max_exact:
        raise ValueError(f"exact search over {n} activations is 3**{n} simulations; it accepts at most "
                         f"{options.max_exact} (SearchOptions.max_exact)")
    best: Candidate | None = None
    for decisions in itertools.product(tuple(Decision), repeat=n):
        if any(d is Decision.SWAP and not act.swappable for d, act in zip(decisions, problem.graph.activations)):
            continue
        c = ev.evaluate(decisions)
        if c is not None and c.fits and (best is None or c.step_time < best.step_time):
            best = c
    return require_fit(ev, best, "exact")


@register("local")
def local(problem: Problem) -> Candidate:
    """PoocH's plan improved by local search on the simulator (never slower than ``pooch``)."""
    return plan_local(problem)


@register("exact")
def exact(problem: Problem) -> Candidate:
    """Exhaustive search: the optimum for small graphs (a reference for the heuristics' gap)."""
    return plan_exact(problem)
