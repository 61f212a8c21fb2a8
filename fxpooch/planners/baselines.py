"""Reference planners: keep, swap or recompute everything, and the paper's comparison points.

Every planner here returns a plan whose simulated peak fits ``mem_limit`` or raises
:class:`~fxpooch.errors.InfeasibleMemoryLimit`. Its ``min_feasible_bytes`` is the peak of
the most frugal plan *that planner* makes (the smallest limit it can meet), so a planner
that fails where PoocH fits (SuperNeurons, section 5.2) still reports a limit above the
one it was given.

* ``in-core``, ``swap-all``, ``checkpoint-all``: keep / swap / recompute everything.
* ``swap-all-nosched``: swap-all whose swap-ins start with the previous layer's backward
  (section 5.1, "swap-all (w/o scheduling)"; Fig. 7 and Fig. 10 left).
* ``superneurons``: the static hybrid of SuperNeurons as the paper reimplements it (5.2).
* ``checkpoint``: Chen et al. 2016, sqrt(n) byte-balanced segments, smaller or larger ones where
  those do not fit (the paper's reference [15]).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from ..errors import InfeasibleMemoryLimit
from ..graph import StepGraph
from ..schedule import Decision, build_schedule, move_prefetches
from ..segments import NotRecomputable
from ..simulator import simulate
from .registry import register
from .common import Candidate, Evaluator, Problem, live_at_peak

log = logging.getLogger("fxpooch.planner.baselines")

#: ``checkpoint``'s segment sizes tried where sqrt(n) segments do not fit, as multiples of theirs
SEGMENT_SCALES = (1 / 64, 64.0)
#: op id -> the backward op before which a swap-in is issued, given its first use
PrefetchRule = Callable[[StepGraph, int, int], int]


# -- helpers -------------------------------------------------------------------------------
def _fail(ev: Evaluator, planner: str, frugal: Sequence[Candidate | None]) -> InfeasibleMemoryLimit:
    """The error for a planner whose most memory-frugal plans (``frugal``) exceed the limit."""
    options = [c for c in frugal if c is not None]
    if not options:
        return ev.infeasible(planner)
    best = min(options, key=lambda c: c.timeline.static_peak_bytes)
    return InfeasibleMemoryLimit(ev.problem.mem_limit, best.timeline.static_peak_bytes,
                                 live_at_peak(ev.graph, best), planner)


def _fit_or_raise(ev: Evaluator, planner: str, candidate: Candidate | None,
                  frugal: Sequence[Candidate | None] = ()) -> Candidate:
    if candidate is not None and candidate.fits:
        return candidate
    raise _fail(ev, planner, [candidate, *frugal])


def _jit(ev: Evaluator, decisions: Sequence[Decision]) -> Candidate | None:
    """The just-in-time, unshared schedule of ``decisions``: the least memory they can need."""
    return ev.evaluate(decisions, early_prefetch=False, share=False)


def simulate_with_prefetch(ev: Evaluator, decisions: Sequence[Decision], rule: PrefetchRule) -> Candidate | None:
    """Simulate ``decisions`` with each swap-in issued where ``rule(graph, first_use, graph_index)`` says.

    None when a recompute decision cannot be realised.
    """
    graph = ev.graph
    try:
        jit = build_schedule(graph, decisions)
    except NotRecomputable:
        return None
    positions = list(jit.prefetch_before)
    for a, use in jit.first_use.items():
        if decisions[a] is Decision.SWAP:
            positions[a] = rule(graph, use, graph.activations[a].graph)
    schedule = move_prefetches(jit, positions)
    timeline = simulate(graph, schedule, ev.problem.costs, ev.problem.mem_limit)
    return Candidate(schedule, timeline, timeline.peak_bytes <= ev.problem.mem_limit)


def previous_backward_op(graph: StepGraph, use: int, g: int, match: Callable[[int], bool]) -> int | None:
    """The last backward op of graph ``g`` before ``use`` that satisfies ``match`` (None if none)."""
    start, _ = graph.backward_range[g]
    for i in range(use - 1, start - 1, -1):
        if match(i):
            return i
    return None


def previous_kernel(graph: StepGraph, use: int, g: int) -> int:
    """Fig. 7 / Fig. 10 left: the backward kernel just before ``use`` (``use`` itself if none)."""
    found = previous_backward_op(graph, use, g, lambda i: graph.ops[i].kernel)
    return use if found is None else found


def is_convolution(graph: StepGraph, op: int) -> bool:
    """The op type, read from its aten target (e.g. ``aten.convolution.default``)."""
    return "convolution" in graph.ops[op].target


def previous_convolution(graph: StepGraph, use: int, g: int) -> int:
    """Section 5.2: the backward of the convolution that runs just before ``use``.

    Falls back to the start of the backward when no convolution's backward precedes ``use``.
    """
    found = previous_backward_op(graph, use, g, lambda i: graph.ops[i].kernel and is_convolution(graph, i))
    return graph.backward_range[g][0] if found is None else found


def recompute_where_possible(ev: Evaluator, decisions: Sequence[Decision], targets: Sequence[int],
                             otherwise: Callable[[int], Decision]) -> list[Decision]:
    """``decisions`` (keep or swap) with ``targets`` recomputed where that is realisable
    (``Evaluator.recomputable_alone``: then also with the other targets recomputed), else
    ``otherwise(a)``."""
    assert Decision.RECOMPUTE not in decisions, "recompute_where_possible starts from keep and swap decisions"
    out = list(decisions)
    for a in targets:
        out[a] = Decision.RECOMPUTE if ev.recomputable_alone[a] else otherwise(a)
    return out


def _swap_or_keep(ev: Evaluator) -> Callable[[int], Decision]:
    return lambda a: Decision.SWAP if ev.graph.activations[a].swappable else Decision.KEEP


# -- the paper's references ----------------------------------------------------------------
@register("in-core")
def in_core(problem: Problem) -> Candidate:
    """Keep every activation on the device (section 5.2, "in-core")."""
    ev = Evaluator(problem)
    return _fit_or_raise(ev, "in-core", ev.evaluate(ev.all_keep()))


@register("swap-all")
def swap_all(problem: Problem) -> Candidate:
    """Swap every activation; each swap-in issued as early as memory allows (sections 4.3, 5.1)."""
    ev = Evaluator(problem)
    decisions = ev.all_swap()
    return _fit_or_raise(ev, "swap-all", ev.evaluate(decisions), [_jit(ev, decisions)])


@register("checkpoint-all")
def checkpoint_all(problem: Problem) -> Candidate:
    """Recompute every activation that can be recomputed; swap the rest (section 3.2)."""
    ev = Evaluator(problem)
    decisions = ev.all_recompute()
    return _fit_or_raise(ev, "checkpoint-all", ev.evaluate(decisions), [_jit(ev, decisions)])


@register("swap-all-nosched")
def swap_all_nosched(problem: Problem) -> Candidate:
    """Section 5.1 "swap-all (w/o scheduling)": swap everything; each swap-in starts together with
    the previous backward layer's compute (Fig. 7; Fig. 10 left), whatever memory is free."""
    ev = Evaluator(problem)
    return _fit_or_raise(ev, "swap-all-nosched", simulate_with_prefetch(ev, ev.all_swap(), previous_kernel))


def superneurons_decisions(ev: Evaluator) -> list[Decision]:
    """Section 3.3 / 5.2: convolution outputs swapped, other activations recomputed (else swapped)."""
    graph = ev.graph
    decisions = [Decision.KEEP] * len(graph.activations)
    others = []
    for a, act in enumerate(graph.activations):
        if is_convolution(graph, act.producer) and act.swappable:
            decisions[a] = Decision.SWAP
        else:
            others.append(a)
    return recompute_where_possible(ev, decisions, others, _swap_or_keep(ev))


@register("superneurons")
def superneurons(problem: Problem) -> Candidate:
    """SuperNeurons (Wang et al., PPoPP 2018) as the paper reimplements it (section 5.2).

    Activations are kept from the output side while the plan fits; among the rest,
    convolution outputs are swapped and other activations recomputed (swapped when they
    cannot be). Each swap-in starts with the backward of the preceding convolution,
    regardless of free memory, so it can exceed a limit that PoocH meets: then this raises.
    """
    ev = Evaluator(problem)
    graph = ev.graph
    offloaded = superneurons_decisions(ev)
    output_first = sorted(range(len(offloaded)), key=lambda a: -max(graph.activations[a].members))
    output_first = [a for a in output_first if offloaded[a] is not Decision.KEEP]
    cache: dict[int, Candidate | None] = {}

    def plan_keeping(k: int) -> Candidate | None:
        """Keep the ``k`` offloaded activations nearest the output."""
        if k not in cache:
            d = list(offloaded)
            for a in output_first[:k]:
                d[a] = Decision.KEEP
            # a kept activation may let others' recompute chains stop earlier, never later
            cache[k] = simulate_with_prefetch(ev, d, previous_convolution)
        return cache[k]

    def fits(k: int) -> bool:
        c = plan_keeping(k)
        return c is not None and c.fits

    if fits(len(output_first)):
        return plan_keeping(len(output_first))
    if not fits(0):
        raise _fail(ev, "superneurons", [plan_keeping(0)])
    lo, hi = 0, len(output_first)  # fits(lo), not fits(hi); memory grows (nearly) with k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    log.debug("superneurons: kept %d of %d offloadable activations", lo, len(output_first))
    return plan_keeping(lo)


def separators(graph: StepGraph) -> set[int]:
    """Activations that alone carry the forward past their last member: no other forward value
    made before it is read after it (a residual block's output, not a value inside the block),
    but values no gradient flows through (``Op.differentiable`` False: HF GPT-2's causal mask, made
    once from the inputs' shapes and read by every layer). A recompute chain that starts after a
    kept separator runs no op before it but those. Such values are no separators themselves."""
    forward = [o for start, stop in graph.forward_range for o in range(start, stop)]
    position = {o: i for i, o in enumerate(forward)}
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, o in enumerate(forward):
        for b in graph.dynamic_allocs[o]:
            born.setdefault(b, i)
        for b in graph.read_buffers[o]:
            last[b] = i
    ends: dict[int, list[int]] = {}  # position -> buffers whose last forward read is there
    for b, i in last.items():
        if b in born and i > born[b]:
            ends.setdefault(i, []).append(b)
    out, live = set(), set()
    at = {max(act.members): a for a, act in enumerate(graph.activations)}
    for i, o in enumerate(forward):
        if graph.ops[o].differentiable:
            live.update(b for b in graph.dynamic_allocs[o] if last.get(b, -1) > i)
        live.difference_update(ends.get(i, ()))
        a = at.get(o)
        if (a is not None and live <= {graph.activations[a].buffer} and position[o] == i
                and graph.ops[o].differentiable):
            out.add(a)
    return out


def checkpoint_decisions(ev: Evaluator, scale: float = 1.0) -> list[Decision]:
    """Chen et al. 2016: segments of about ``scale`` x ``total / sqrt(n)`` bytes, each closed by a
    kept activation; the rest of each segment is recomputed.

    ``n`` counts the activations that can be recomputed from kept values (the others are kept);
    walking them in forward order, a :func:`separators` activation is kept once its segment
    (itself included) holds ``scale * k * total / n`` bytes, ``k = ceil(sqrt(n))``; the last one
    is kept too. On a chain of equal sizes with ``scale`` 1 that keeps every k-th one, the
    paper's sqrt(n) rule; a segment never ends inside a residual block.
    """
    graph = ev.graph
    keep_all = [Decision.KEEP] * len(graph.activations)
    order = sorted(range(len(keep_all)), key=lambda a: max(graph.activations[a].members))
    recomputable = [a for a in order if ev.recomputable_alone[a]]
    n = len(recomputable)
    if n == 0:
        return keep_all
    ends = separators(graph)
    nbytes = [graph.buffers[graph.activations[a].buffer].nbytes for a in recomputable]
    k = max(1, math.isqrt(n - 1) + 1)  # ceil(sqrt(n))
    target = scale * k * sum(nbytes) / n
    targets, held = [], 0
    for i, a in enumerate(recomputable):
        held += nbytes[i]
        if (held >= target * (1 - 1e-12) and a in ends) or i == n - 1:
            held = 0
        else:
            targets.append(a)
    return recompute_where_possible(ev, keep_all, targets, lambda a: Decision.KEEP)


def checkpoint_plan(ev: Evaluator) -> tuple[Candidate | None, list[Candidate | None]]:
    """The sqrt(n) segments of :func:`checkpoint_decisions` where they fit, each segment rebuilt
    once; otherwise the fastest such plan among segments of 2, 4, 8... times fewer or more bytes
    (more segments, each rebuilding less at once, or fewer kept activations), as Chen et al.
    search their budget; only where none fits, the fastest with activations rebuilt one by one
    (unshared chains: less memory, more compute). Returns ``(the plan or None, every plan tried)``."""
    scales = [1.0]
    for direction in (0.5, 2.0):
        scale = direction
        while SEGMENT_SCALES[0] <= scale <= SEGMENT_SCALES[1]:
            scales.append(scale)
            scale *= direction
    options = list(dict.fromkeys(tuple(checkpoint_decisions(ev, scale)) for scale in scales))
    tried: list[Candidate | None] = []
    for share in (True, None):
        found = []
        for decisions in options:
            c = ev.evaluate(decisions, share=share)
            tried.append(c)
            if c is not None and c.fits:
                if decisions == options[0]:
                    return c, tried
                found.append(c)
        if found:
            return min(found, key=lambda c: c.step_time), tried
    return None, tried


@register("checkpoint")
def checkpoint(problem: Problem) -> Candidate:
    """Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost", the paper's [15]).

    sqrt(n) byte-balanced segments, or segments of fewer or more bytes where those do not fit
    (:func:`checkpoint_plan`); activations that cannot be recomputed are kept. If no
    segmentation fits, falls back to checkpoint-all's plan. A segment is recomputed once, at the
    first reader of its last activation (the schedule shares recompute segments where that fits).
    """
    ev = Evaluator(problem)
    candidate, tried = checkpoint_plan(ev)
    if candidate is not None:
        return candidate
    every = ev.all_recompute()
    fallback = ev.evaluate(every)
    return _fit_or_raise(ev, "checkpoint", fallback, [*tried, _jit(ev, every)])
