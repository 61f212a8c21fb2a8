"""Near the floor, a second basin for ``local``: swap the input side, recompute the output side.

An activation made early in the forward has the whole rest of the forward to leave over the link
and the whole backward but its tail to come back; one made late has neither, and its recompute
chain runs just before it is read. So a plan that swaps the first activations of the forward and
recomputes the rest uses the link where it overlaps compute and recomputes where it would not.
Near the floor such a plan rarely fits as it stands (a few MiB over), and every single change
that :func:`~.search.local_search` or the group moves try from the plans ``local`` starts from
(PoocH's and the reference plans, most of them swap-heavy there) misses the limit or is slower:
the descent stays in the swap-heavy basin. :func:`split_seed` makes the split plans for a few
fractions of the forward and brings each under the limit one change at a time (:func:`fit_by_peak`:
the change among the activations live at the peak that lowers it most); ``local`` starts its
descent from the fastest of them where that beats PoocH's plan and the reference plans. GPT-2 at
12 layers over PCIe3 at its floor: 3.374x in-core from those, 2.454x from the split plan.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from ..schedule import Decision, Kind
from .baselines import separators
from .common import Candidate, Evaluator, instances_at_peak

log = logging.getLogger("fxpooch.planner.split")


def split_plan(ev: Evaluator, fraction: float, ends: Collection[int] = ()) -> tuple[Decision, ...]:
    """The first ``fraction`` of the activations, in the order the forward makes them, swapped
    (kept where they cannot be), the others recomputed (swapped where they cannot be, as
    ``Evaluator.all_recompute`` does) but those in ``ends`` (block outputs,
    :func:`~.baselines.separators`), swapped too: each chain then stops at the block before it
    instead of running back to the first swapped activation."""
    acts = ev.graph.activations
    order = sorted(range(len(acts)), key=lambda a: (acts[a].producer, a))
    early = set(order[:int(fraction * len(order))]) | set(ends)
    swap, recompute = ev.all_swap(), ev.all_recompute()
    return tuple(swap[a] if a in early else recompute[a] for a in range(len(acts)))


def program_peak(candidate: Candidate) -> int:
    """The candidate's device bytes at its program-order peak (copies instantaneous), resident
    excluded: read from its layout, without simulating it."""
    mem = candidate.program_memory
    return int(mem.max()) if len(mem) else 0


def overage(candidate: Candidate, budget: int) -> int:
    """Bytes over ``budget`` in program order, summed over the instructions: what a change that
    lowers one of several equal peaks (one per repeated layer) lowers, where the peak stays."""
    mem = candidate.program_memory
    return int((mem - budget).clip(min=0).sum())


def peak_candidates(candidate: Candidate, ev: Evaluator) -> list[int]:
    """The activations whose storage (or a copy of it) is on the device at the candidate's
    program-order peak, and where a recompute chain runs there, those it rebuilds (its buffers
    are not theirs yet): in id order."""
    sched = candidate.layout
    at, live = instances_at_peak(sched)
    if at < 0:
        return []
    buffers = {sched.instance_buffer[x] for x in live}
    instr = sched.instrs[at]
    rebuilt = set(sched.materialises.get(instr.act, ())) if instr.kind is Kind.RECOMPUTE else set()
    return [a for a, act in enumerate(ev.graph.activations) if act.buffer in buffers or a in rebuilt]


def fit_by_peak(ev: Evaluator, candidate: Candidate, stop_at: int) -> Candidate | None:
    """``candidate`` brought under the limit by single changes: each time, of every change of a
    :func:`peak_candidates` activation, the one whose plan fits and is fastest, else the
    one with the least :func:`overage`; None when a change lowers that no more or
    ``ev.simulations`` reaches ``stop_at`` first, or would before the peak can reach the limit
    (a change lowers it by one activation's bytes at most). Plans over the limit are ranked
    without simulating them: most are over in program order already."""
    acts = ev.graph.activations
    nbytes = [ev.graph.buffers[act.buffer].nbytes for act in acts]
    while not candidate.fits:
        peak, over = program_peak(candidate), overage(candidate, ev.budget)
        live = peak_candidates(candidate, ev)
        steps = (stop_at - ev.simulations) // max(1, 2 * len(live))  # each tries two changes per activation
        if peak - ev.budget > steps * max((nbytes[a] for a in live), default=0):
            return None
        best, score = None, None
        for a in live:
            for d in Decision:
                if d is candidate.decisions[a] or (d is Decision.SWAP and not acts[a].swappable):
                    continue
                if ev.simulations >= stop_at:
                    return None
                trial = [*candidate.decisions[:a], d, *candidate.decisions[a + 1:]]
                c = ev.evaluate(trial)
                if c is None:
                    continue
                key = (0, c.step_time) if c.fits else (1, overage(c, ev.budget))
                if score is None or key < score:
                    best, score = c, key
        if best is None or (not best.fits and score[1] >= over):
            return None
        candidate = best
    return candidate


def split_seed(ev: Evaluator, fractions: Sequence[float], stop_at: int) -> Candidate | None:
    """The fastest of the split plans for ``fractions`` brought under the limit
    (:func:`fit_by_peak`, each within an equal share of the simulations left before ``stop_at``);
    None when none fits."""
    best = None
    ends = separators(ev.graph)
    for i, fraction in enumerate(fractions):
        share = (stop_at - ev.simulations) // (len(fractions) - i)
        start = ev.evaluate(split_plan(ev, fraction, ends), share=True)  # shared only; the repair tries both
        c = None if start is None else fit_by_peak(ev, start, ev.simulations + share)
        log.debug("split at %.3g of the forward: %s", fraction, "no fit" if c is None else f"{c.step_time:.4g} s")
        if c is not None and (best is None or c.step_time < best.step_time):
            best = c
    return best
