"""PoocH's classification (section 4.4): keep/swap search, then swap -> recompute by r(X).

Step 1 starts from swap-all, reads the simulated timeline for L_O (swap-outs that end after
the forward) and L_I (swap-ins the compute stream waits for), keeps L_O greedily from the
output side and searches L_I exhaustively (greedily beyond ``PoochOptions.max_exhaustive``),
keeping at each leaf the longest prefix of L_O \\ L_I that fits (a binary search). Step 2
turns swaps into recomputes while r(X) = recompute_overhead / swap_overhead < 1, smallest r
first.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..graph import StepGraph
from ..schedule import Decision
from ..segments import NotRecomputable, recompute_chain
from ..simulator import Timeline
from .registry import register
from .common import Candidate, Evaluator, Problem, require_fit, simulation_budget

log = logging.getLogger("fxpooch.planner.pooch")


@dataclass(frozen=True)
class PoochOptions:
    #: |L_I| up to which the keep/swap search is exhaustive (2**n leaves); beyond it, greedy
    max_exhaustive: int = 10
    #: run step 2 (swap -> recompute); False gives the paper's "swap-opt"
    recompute: bool = True
    #: work each of the two search steps may do, in op-simulations (a simulation of a step of
    #: n ops counts n): past it the best plan so far is kept (the exhaustive part of step 1 is
    #: exponential in |L_I|). A count, not a time, so a plan does not depend on the machine or its
    #: load, and the planning time grows linearly with the graph: a 2,000-op step gets 75
    #: simulations per step, a 30-op one the cap below.
    step_work: int = 150_000
    #: most simulations a step runs however small the graph (an exhaustive step 1 with
    #: |L_I| = 10 needs about 10,000; step 2 on the test zoo's graphs about 1,000)
    step_simulations: int = 20000
    #: when swap-all does not fit: activations smaller than this fraction of the limit are
    #: tried as one group before the one-by-one pass (each pass step costs a simulation)
    small_fraction: float = 1e-3


@dataclass
class _Budget:
    """What one search step may still spend, in simulations (see ``PoochOptions.step_work``)."""

    ev: Evaluator
    simulations: int

    def __post_init__(self) -> None:
        self.stop_at = self.ev.simulations + self.simulations

    @classmethod
    def of_step(cls, ev: Evaluator, options: PoochOptions) -> _Budget:
        return cls(ev, simulation_budget(ev.graph, options.step_work, options.step_simulations))

    def spent(self) -> bool:
        return self.ev.simulations >= self.stop_at


def _better(a: Candidate | None, b: Candidate | None) -> bool:
    """Is ``a`` a better fitting plan than ``b``?"""
    if a is None or not a.fits:
        return False
    return b is None or not b.fits or a.step_time < b.step_time


def overhead_sets(graph: StepGraph, timeline: Timeline,
                  decisions: Sequence[Decision]) -> tuple[list[int], list[int]]:
    """Section 4.4.2 (Fig. 11): the swapped activations whose transfers computation does not hide.

    ``L_O``: swap-outs that end after the forward's last op; ``L_I``: swap-ins the compute
    stream waits for. Both list activation ids output side first (latest producer first).
    """
    swapped = [a for a, d in enumerate(decisions) if d is Decision.SWAP]
    output_first = sorted(swapped, key=lambda a: -max(graph.activations[a].members))
    l_o = [a for a in output_first if timeline.d2h_end.get(a, 0.0) > timeline.forward_end]
    l_i = [a for a in output_first if timeline.stall.get(a, 0.0) > 0.0]
    return l_o, l_i


def step1_keep_or_swap(ev: Evaluator, start: Candidate, options: PoochOptions) -> Candidate:
    tl = start.timeline
    l_o, l_i = overhead_sets(ev.graph, tl, start.decisions)
    scan = [a for a in l_o if a not in set(l_i)]
    log.debug("L_O=%d L_I=%d scan=%d", len(l_o), len(l_i), len(scan))

    budget = _Budget.of_step(ev, options)

    def leaf(decisions: list[Decision]) -> Candidate | None:
        """Best of keeping the first k of ``scan`` as well, over the k that fit.

        Keeping more only needs more memory, so the fitting k form a prefix: a binary search
        finds its end, judging every fitting k it probes.
        """
        best = None

        def fits_with(k: int) -> bool:
            nonlocal best
            trial = decisions.copy()
            for a in scan[:k]:
                trial[a] = Decision.KEEP
            c = ev.evaluate(trial)
            if _better(c, best):
                best = c
            return c is not None and c.fits

        if not fits_with(0):
            return None
        lo, hi = 0, len(scan)  # k = lo fits; find the largest that does
        while lo < hi and not budget.spent():
            mid = (lo + hi + 1) // 2
            if fits_with(mid):
                lo = mid
            else:
                hi = mid - 1
        return best

    best = start
    base = list(start.decisions)
    if len(l_i) <= options.max_exhaustive:
        for bits in itertools.product((Decision.SWAP, Decision.KEEP), repeat=len(l_i)):
            if budget.spent():
                log.info("step 1 stopped at its budget")
                break
            d = base.copy()
            for a, choice in zip(l_i, bits):
                d[a] = choice
            c = leaf(d)
            if _better(c, best):
                best = c
    else:  # greedy over L_I, largest stall first; L_O \\ L_I scanned once at the end
        for a in sorted(l_i, key=lambda a: -tl.stall[a]):
            if budget.spent():
                break
            d = list(best.decisions)
            d[a] = Decision.KEEP
            c = ev.evaluate(d)
            if _better(c, best):
                best = c
        c = leaf(list(best.decisions))
        best = c if _better(c, best) else best
    return best


def estimated_ratio(ev: Evaluator, current: Candidate, a: int) -> float:
    """r(X) read off ``current``'s timeline without simulating: the compute of ``a``'s recompute
    chain over the time its swap is not hidden (the stall before its first use plus its offload's
    run past the forward's end). Infinite where the swap is hidden or ``a`` cannot be recomputed."""
    tl = current.timeline
    exposed = tl.stall.get(a, 0.0) + max(0.0, tl.d2h_end.get(a, 0.0) - tl.forward_end)
    if exposed <= 0:
        return math.inf
    trial = list(current.decisions)
    trial[a] = Decision.RECOMPUTE
    try:
        chain = recompute_chain(ev.graph, a, trial, ev.owner)
    except NotRecomputable:
        return math.inf
    return sum(ev.problem.costs.op_time[o] for o in chain) / exposed


def _convert_best_prefix(ev: Evaluator, current: Candidate, ranked: list[tuple[float, int]],
                         budget: _Budget) -> tuple[Candidate, list[tuple[float, int]]]:
    """Recompute the first k of ``ranked`` at once, for k = all, 1/2, 1/4, ... of them: the
    fastest that fits is kept (a few simulations instead of one or two per activation); returns
    it and what is left of ``ranked``."""
    best, best_k = current, 0
    k = len(ranked)
    while k >= 1 and not budget.spent():
        trial = list(current.decisions)
        for _, a in ranked[:k]:
            trial[a] = Decision.RECOMPUTE
        c = ev.evaluate(trial)
        if _better(c, best):
            best, best_k = c, k
        k //= 2
    return best, ranked[best_k:]


def step2_swap_to_recompute(ev: Evaluator, start: Candidate, options: PoochOptions = PoochOptions()) -> Candidate:
    """Convert swaps to recomputes while r(X) < 1, smallest r(X) first.

    r(X) is re-evaluated against the current plan only for the activation at the head of a
    priority queue of earlier ratios (lazy greedy): it is converted when its fresh ratio still
    heads the queue, dropped when it reaches 1, and queued again otherwise. A conversion rarely
    lowers another activation's ratio, and the full re-evaluation of every ratio after each
    conversion costs two simulations per swapped activation. When the step's budget cannot pay
    for one ratio per swapped activation, the queue starts from :func:`estimated_ratio` instead,
    and its best prefix is converted at once first (:func:`_convert_best_prefix`).
    """
    current = start
    budget = _Budget.of_step(ev, options)

    def ratio(a: int) -> float:
        rec = list(current.decisions)
        rec[a] = Decision.RECOMPUTE
        candidate = ev.evaluate(rec)
        if candidate is None or not candidate.fits:
            return math.inf
        keep = list(current.decisions)
        keep[a] = Decision.KEEP
        baseline = ev.unconstrained_time(keep)  # X costs nothing: neither copies nor recompute
        swap_overhead = current.step_time - baseline
        if swap_overhead <= 0:
            return math.inf
        return max(candidate.step_time - baseline, 0.0) / swap_overhead

    swapped = [a for a, d in enumerate(current.decisions) if d is Decision.SWAP]
    exact = 2 * len(swapped) <= budget.stop_at - ev.simulations
    if exact:
        queue = [(ratio(a), a) for a in swapped]
    else:  # too many to simulate each: rank by an estimate, convert each head whose true r(X) < 1
        queue = [(estimated_ratio(ev, current, a), a) for a in swapped]
    queue = [(r, a) for r, a in queue if r < 1.0]
    if not exact:
        current, queue = _convert_best_prefix(ev, current, sorted(queue), budget)
    heapq.heapify(queue)
    conversions = 0
    while queue and not budget.spent():
        _, a = heapq.heappop(queue)
        fresh = ratio(a)
        if fresh >= 1.0:
            continue
        if exact and queue and fresh > queue[0][0]:
            heapq.heappush(queue, (fresh, a))
            continue
        rec = list(current.decisions)
        rec[a] = Decision.RECOMPUTE
        current = ev.evaluate(rec)
        conversions += 1
    log.debug("step 2: %d swaps turned into recomputes", conversions)
    return current


def promote_from_output_side(ev: Evaluator, start: Candidate, options: PoochOptions,
                             choice: Decision = Decision.KEEP) -> Candidate:
    """Turn activations to ``choice`` (keep, or swap for recomputed ones), output side first,
    while the plan fits and gets no slower, within a step's budget.

    Keeping an activation larger than the headroom left under the limit is skipped without a
    simulation: it would hold its bytes through the forward-backward turn, where the peak of a
    tight plan lies. Tiny activations (normalisation statistics, masks) are tried together first.
    """
    best = start
    budget = _Budget.of_step(ev, options)
    acts = ev.graph.activations
    nbytes = [ev.graph.buffers[act.buffer].nbytes for act in acts]
    before = (Decision.SWAP, Decision.RECOMPUTE) if choice is Decision.KEEP else (Decision.RECOMPUTE,)
    movable = [a for a, d in enumerate(start.decisions)
               if d in before and (choice is not Decision.SWAP or acts[a].swappable)]
    small = [a for a in movable if nbytes[a] < options.small_fraction * ev.problem.mem_limit]

    def attempt(group: list[int]) -> None:
        nonlocal best
        trial = list(best.decisions)
        for a in group:
            trial[a] = choice
        c = ev.evaluate(trial)
        if c is not None and c.fits and c.step_time <= best.step_time:
            best = c

    if small:
        attempt(small)
    for a in sorted(movable, key=lambda a: -max(acts[a].members)):
        if budget.spent():
            log.info("promotion to %s stopped at its budget", choice.value)
            break
        if best.decisions[a] not in before:
            continue
        if choice is Decision.KEEP and nbytes[a] > ev.problem.mem_limit - best.timeline.peak_bytes:
            continue
        attempt([a])
    return best


def plan_pooch(problem: Problem, options: PoochOptions = PoochOptions(), name: str = "pooch",
               ev: Evaluator | None = None) -> Candidate:
    """``ev``: an evaluator of ``problem`` to share (and fill) its cache of simulated plans."""
    ev = Evaluator(problem) if ev is None else ev
    in_core = ev.evaluate(ev.all_keep())
    if in_core is not None and in_core.fits:
        return in_core
    start = ev.evaluate(ev.all_swap())
    if start is None or not start.fits:
        # swap-all does not fit (a slow link holds offloaded memory until its copy ends): start
        # from the most frugal plan, keep what fits, output side first (as step 1 does for L_O),
        # then swap recomputes where that fits and is no slower (step 2 may turn them back)
        start = promote_from_output_side(ev, require_fit(ev, ev.floor(), name), options)
        start = promote_from_output_side(ev, start, options, Decision.SWAP)
    best = step1_keep_or_swap(ev, start, options)
    if options.recompute:
        best = step2_swap_to_recompute(ev, best, options)
    log.info("%s: %d evaluations, step %.3g s (swap-all %.3g s)", name, ev.evaluations, best.step_time,
             start.step_time)
    return best


@register("pooch")
def pooch(problem: Problem) -> Candidate:
    """PoocH: keep/swap search (step 1) then swap -> recompute by r(X) (step 2)."""
    return plan_pooch(problem)


@register("swap-opt")
def swap_opt(problem: Problem) -> Candidate:
    """PoocH's step 1 alone: keep or swap, no recompute."""
    return plan_pooch(problem, PoochOptions(recompute=False), name="swap-opt")
