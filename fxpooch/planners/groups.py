"""The moves of ``local`` over repeated blocks: activations that play the same part in every
layer of a deep model (:func:`repeated_groups`) changed together, so a few simulations cover
every layer however deep; trades between two such groups; each group's input and output sides
(:func:`sides`) and its last member (:func:`tails`). :func:`group_search` runs them within a budget
of simulations."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from ..schedule import Decision
from .common import Candidate, Evaluator
from .moves import faster, with_group

log = logging.getLogger("fxpooch.planner.groups")


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


#: where :func:`group_search`'s last descent cuts each group in two (fractions of its members)
CUTS = (0.25, 0.5, 0.75)


def sides(groups: list[list[int]], cuts: tuple[float, ...] = CUTS) -> list[list[int]]:
    """Each group's input side and output side, cut at each fraction of its members in ``cuts``
    (those of two or more members, each once). Deep models often want a plan that changes
    between layers: GPT-2 at 12 layers at its floor over PCIe3 swaps its MLPs' first matmul outputs
    from the second layer on and keeps the last layer's; with halves only, ``local`` planned
    1.831x in-core, with :data:`CUTS` 1.780x."""
    out: list[list[int]] = []
    for g in groups:
        for k in sorted({int(c * len(g)) for c in cuts}):
            out.extend(part for part in (g[:k], g[k:]) if len(part) > 1 and part not in out)
    return out


def tails(groups: list[list[int]]) -> list[list[int]]:
    """Each group's last member alone: the output side's last block, whose activations the
    backward reads first, so a swapped one has the least time to go out and come back before it
    is needed. Near the floor a plan that keeps them and evicts more elsewhere can be faster: GPT-2 at 12 layers at its floor over PCIe3, ``local``'s plan keeping the last
    layer's MLP matmul output, dropout output and residual sum went from 1.780x to 1.736x in-core."""
    return [[g[-1]] for g in groups]


def group_descent(ev: Evaluator, seed: Candidate, groups: list[list[int]], stop_at: int,
                  reserve: int = 0) -> Candidate:
    """First-improvement descent where each move sets a whole group to keep, swap or recompute,
    until no move helps or ``ev.simulations`` reaches ``stop_at``; a pass after the first only
    while more than ``reserve`` simulations are left."""
    best = seed
    improved, first = True, True
    while improved and ev.simulations < stop_at and (first or stop_at - ev.simulations > reserve):
        improved, first = False, False
        for group in groups:
            for d in Decision:
                if ev.simulations >= stop_at:
                    break
                trial = with_group(best.decisions, ev.graph.activations, group, d)
                if trial == list(best.decisions):
                    continue
                if (c := faster(ev, best, trial)) is not None:
                    best, improved = c, True
    return best


def group_trades(ev: Evaluator, best: Candidate, parts: list[list[int]], stop_at: int,
                 touching: set[int] | None = None) -> Candidate | None:
    """The first faster fitting plan that keeps one group or group side whole and swaps or
    recomputes another, disjoint one that keeps at least as many bytes now; the trades that free
    the fewest bytes more than they keep first; or None. No single group move makes a trade
    where either change alone misses the limit or is slower: keep every layer's attention
    dropout output and recompute the softmax of the same bytes instead; keep a ResNet stage's
    twelve 1x1-convolution outputs and recompute two of a larger stage's."""
    acts, buffers = ev.graph.activations, ev.graph.buffers
    nbytes = [buffers[act.buffer].nbytes for act in acts]
    kept = [sum(nbytes[a] for a in p if best.decisions[a] is Decision.KEEP) for p in parts]
    freed = [sum(nbytes[a] for a in p if best.decisions[a] is not Decision.KEEP) for p in parts]
    trades = sorted((kept[j] - freed[i], i, j, d) for i in range(len(parts)) if freed[i]
                    for j in range(len(parts)) if kept[j] >= freed[i] and not set(parts[i]) & set(parts[j])
                    and _touches(touching, parts[i], parts[j]) for d in (Decision.RECOMPUTE, Decision.SWAP))
    return first_faster(ev, best, ((parts[i], Decision.KEEP, parts[j], d) for _, i, j, d in trades), stop_at)


def link_trades(ev: Evaluator, best: Candidate, parts: list[list[int]], rebuild: Sequence[float],
                stop_at: int, touching: set[int] | None = None) -> Candidate | None:
    """The first faster fitting plan that swaps one group or group side it recomputes now and
    recomputes another, disjoint one that now sends at least as many bytes over the link; the
    trades that save the most seconds of recompute chains (``rebuild``: per activation, its
    shortest chain's) first; or None. Where the link is the bottleneck, offloads queue behind
    one another and the last ones end after the forward, too late to free memory for the peak:
    its bytes are best spent on the activations that cost most to rebuild. Neither change alone
    helps (the swaps overload the link, the recomputes only add time): GPT-2 at 6 layers over
    PCIe3, a quarter of the way from its floor to in-core, swaps every MLP's first matmul
    output and recomputes half of the GELU's products instead (1.209x in-core -> 1.102x)."""
    acts = ev.graph.activations
    xfer = [act.transfer_bytes for act in acts]
    now_recomputed = [[a for a in p if best.decisions[a] is Decision.RECOMPUTE and acts[a].swappable] for p in parts]
    recomputable = {a for a, d in enumerate(best.decisions) if d is Decision.SWAP and ev.recomputable_alone[a]}
    now_swapped = [[a for a in p if a in recomputable] for p in parts]
    sent = [sum(xfer[a] for a in p) for p in now_recomputed]  # what swapping those sends
    saved = [sum(rebuild[a] for a in p) for p in now_recomputed]  # and the chains it no longer runs
    freed = [sum(xfer[a] for a in p) for p in now_swapped]  # what recomputing those takes off the link
    spent = [sum(rebuild[a] for a in p) for p in now_swapped]  # and the chains it runs
    trades = sorted((spent[j] - saved[i], i, j) for i in range(len(parts)) if now_recomputed[i]
                    for j in range(len(parts)) if now_swapped[j] and freed[j] >= sent[i] and spent[j] < saved[i]
                    and not set(parts[i]) & set(parts[j]) and _touches(touching, parts[i], parts[j]))
    return first_faster(ev, best, ((parts[i], Decision.SWAP, parts[j], Decision.RECOMPUTE) for _, i, j in trades),
                        stop_at)


def _touches(touching: set[int] | None, part: list[int], other: list[int]) -> bool:
    """Whether a trade of ``part`` and ``other`` changes an activation of ``touching`` (None: all do)."""
    return touching is None or not touching.isdisjoint(part) or not touching.isdisjoint(other)


def first_faster(ev: Evaluator, best: Candidate, trades, stop_at: int) -> Candidate | None:
    """The first of ``trades`` (``(part, decision, other part, other decision)``, applied in that
    order) whose plan fits and is faster than ``best``; None when none is or once
    ``ev.simulations`` reaches ``stop_at``."""
    acts = ev.graph.activations
    for part, d, other, e in trades:
        trial = with_group(with_group(best.decisions, acts, part, d), acts, other, e)
        if trial == list(best.decisions):
            continue
        if ev.simulations >= stop_at:
            return None
        if (c := faster(ev, best, trial)) is not None:
            return c
    return None


def group_search(ev: Evaluator, seed: Candidate, simulations: int, reserve: int = 0) -> Candidate:
    """Like :func:`local_search`, but each move sets a whole :func:`repeated_groups` group to
    keep, swap or recompute: a few simulations cover every layer of a deep model, however deep.
    Whole groups until no move helps; then trades, one group or group side kept and another
    freed (:func:`group_trades`), or where none helps one swapped and another recomputed
    (:func:`link_trades`), each followed by the whole groups' moves again, a scan that finds no
    trade taking at most half the simulations left when it starts (trades of whole groups and
    their halves); then the moves of their sides as well (:func:`sides`, cut at each of
    :data:`CUTS`: a plan that differs between the input-side and output-side layers) with the
    rest. Near the floor most trades miss the limit: without that share a fruitless scan took
    every simulation left and the sides' descent none (GPT-2 at 24 layers planned 4.9% slower
    at its floor). Last, trades again, only those that change an activation the sides' descent
    changed (and after each, what that trade changed): a trade scan rejected everything else
    before it, and a part changed may now be worth trading. GPT-2 at 24 layers, 3/4 of the way
    from its floor to in-core over PCIe3: the sides' descent recomputes the first quarter of
    the attention softmaxes; keeping every softmax and recomputing the output-side half of the
    MLP's GELU products (the same bytes) instead took the plan from 1.021x to 1.011x in-core.
    Restricted so, at 48 layers (where single-activation moves still find most) the scan took
    13 simulations, not 36 when every trade was scanned again, followed by the descent.

    The sides' descent repeats a pass only while more than ``reserve`` simulations are left
    (what the single changes after it need): passes after the first find little and cost as much.
    GPT-2 at 24 layers at its PCIe3 floor: the first pass reaches 1.747x in-core in 104
    simulations, more passes 1.738x in the 138 left of its 300; single changes with them (after a
    trade scan) 1.693x. At 12 layers the second pass finds nothing."""
    stop_at = ev.simulations + simulations
    groups = repeated_groups(ev)
    best = group_descent(ev, seed, groups, stop_at)
    parts = groups + sides(groups, (0.5,))  # trades between halves
    rebuild = ev.rebuild_times
    while (traded := _trade(ev, best, parts, rebuild, stop_at)) is not None:
        best = group_descent(ev, traded, groups, stop_at)
    before = best.decisions
    best = group_descent(ev, best, groups + sides(groups) + tails(groups), stop_at, reserve)
    touching = _changed(before, best.decisions)
    while touching and (traded := _trade(ev, best, parts, rebuild, stop_at, touching)) is not None:
        best, touching = traded, _changed(best.decisions, traded.decisions)
    log.info("group search: %.4g s -> %.4g s (%d kinds, %d simulations)", seed.step_time, best.step_time,
             len(groups), ev.simulations - stop_at + simulations)
    return best


def _trade(ev: Evaluator, best: Candidate, parts: list[list[int]], rebuild: Sequence[float], stop_at: int,
           touching: set[int] | None = None) -> Candidate | None:
    """The first faster plan of :func:`group_trades`, else of :func:`link_trades` (``touching``:
    only trades that change one of these activations), scanning at most half the simulations
    left; or None."""
    scan_until = ev.simulations + (stop_at - ev.simulations) // 2
    traded = group_trades(ev, best, parts, scan_until, touching)
    return traded if traded is not None else link_trades(ev, best, parts, rebuild, scan_until, touching)


def _changed(before: Sequence[Decision], after: Sequence[Decision]) -> set[int]:
    """The activations whose decision differs between ``before`` and ``after``."""
    return {a for a, (d, e) in enumerate(zip(before, after)) if d is not e}
