"""Moves of the local search that change several activations at once, each judged by a simulation:
two activations of the same bytes trading decisions (:func:`exchange`), an activation and one its
recompute chain reads (:func:`linked`), a change with a follow-up near it (:func:`followups`), and
clusters of kept activations that read one another (:func:`clusters`). Each returns a faster plan
that fits, or says that none of its moves gave one, within a budget of simulations (``stop_at``, a
value of ``ev.simulations``). Every move, the group moves' too, judges a trial by :func:`faster`:
a trial just over the limit is tried again with one more kept activation recomputed
(:func:`repairs`)."""
from __future__ import annotations

from collections.abc import Sequence

from ..schedule import Decision
from ..segments import chain_inputs
from .common import Candidate, Evaluator, Unjudged


def with_group(decisions: Sequence[Decision], acts, group: Sequence[int], d: Decision) -> list[Decision]:
    """``decisions`` with every member of ``group`` set to ``d`` (those that cannot be swapped
    keep theirs when ``d`` is swap)."""
    out = list(decisions)
    for a in group:
        if d is not Decision.SWAP or acts[a].swappable:
            out[a] = d
    return out


def chain_readers(ev: Evaluator) -> tuple[list[list[int]], dict[int, set[int]]]:
    """Each activation's chain inputs (what its shortest recompute chain reads, :func:`chain_inputs`),
    and for each activation the activations whose chains read it."""
    inputs = [chain_inputs(ev.graph, a, ev.owner) for a in range(len(ev.graph.activations))]
    readers: dict[int, set[int]] = {}
    for c, read in enumerate(inputs):
        for a in read:
            readers.setdefault(a, set()).add(c)
    return inputs, readers


#: kept activations :func:`faster` tries recomputing (:func:`repairs`), one at a time, where a
#: trial misses the limit in program order. ``local`` on ResNet-50, GPT-2 6L and 12L over PCIe3
#: and PCIe5, from the floor to 3/4 of the way to in-core (24 rows), against none: 14 faster, 6
#: slower (at most 1.8%), geometric mean -0.37%; ResNet-50's PCIe3 floor 1.883x -> 1.849x in-core
#: (with 2: 1.878x; on ResNet-50's 8 rows, 1: -0.36%, 4: -0.64%). The schedules a repair reads are
#: not counted as work: at GPT-2 12L's PCIe5 floor 10 of them, 0.1 of 9.2 CPU s under cProfile
REPAIRS = 4


def faster(ev: Evaluator, best: Candidate, trial: list[Decision],
           repairs_tried: int | None = None) -> Candidate | None:
    """The plan of ``trial`` if it fits and is faster than ``best``, else the first of its
    :func:`repairs` (``repairs_tried`` of them, default :data:`REPAIRS`) that does; else None.
    A plan that cannot be faster (``Evaluator.cannot_beat``) is not judged."""
    step_time = best.step_time * (1 - 1e-9)
    if ev.cannot_beat(trial, step_time):
        return None
    c = ev.evaluate(trial)
    if c is None:
        return None
    if c.fits:
        return c if c.step_time < step_time else None
    for fix in repairs(ev, trial, REPAIRS if repairs_tried is None else repairs_tried):
        if not ev.cannot_beat(fix, step_time) and (c := ev.evaluate(fix)) is not None and c.fits \
                and c.step_time < step_time:
            return c
    return None


def repairs(ev: Evaluator, trial: Sequence[Decision], k: int) -> list[list[Decision]]:
    """``trial`` with one more kept activation recomputed, for each of the ``k`` whose shortest
    chains take least time (``Evaluator.rebuild_times``) among those ``trial``'s unshared schedule
    holds at its program-order peak without reading or writing them there, and of at least the
    bytes that peak is over the limit by; none unless ``evaluate`` found that schedule over the
    limit in program order (``Evaluator.known``). A move that misses the limit by less than one
    activation is often faster with one more recomputed: at ResNet-50's PCIe3 floor, keeping the
    last 5% of ``local``'s activations misses it by 33 MiB, and recomputing a 392 MiB ReLU output
    of the second stage as well fits and is 1.0% faster than the plan before. The schedule read
    for its peak is built once (the plan's, were it judged) and not counted as work; where no kept
    activation could cover the bytes over, it is not built."""
    alone = ev.known(trial, share=False)
    if not isinstance(alone, Unjudged):
        return []
    over = ev.graph.resident_bytes + int(alone.program_memory.max()) - ev.problem.mem_limit
    acts, buffers = ev.graph.activations, ev.graph.buffers
    kept = [a for a, act in enumerate(acts) if trial[a] is Decision.KEEP and ev.recomputable_alone[a]
            and buffers[act.buffer].nbytes >= over]
    if not kept:
        return []
    schedule = alone.layout
    peak = int(alone.program_memory.argmax())
    touched = {*schedule.instrs[peak].allocs, *schedule.instrs[peak].reads}
    held = [a for a in kept if acts[a].buffer not in touched
            and schedule.first_alloc[acts[a].buffer] <= peak <= schedule.last_reader[acts[a].buffer]]
    held.sort(key=lambda a: (ev.rebuild_times[a], a))
    return [[*trial[:a], Decision.RECOMPUTE, *trial[a + 1:]] for a in held[:k]]


def exchange(ev: Evaluator, best: Candidate, order: list[int], stop_at: int) -> Candidate | None:
    """The first faster fitting plan that trades the decisions of two activations of the same
    bytes (keep the first and recompute the second rather than the reverse, say: the same memory
    freed, by a cheaper chain), or None; ``order``: largest first."""
    acts = ev.graph.activations
    nbytes = [ev.graph.buffers[act.buffer].nbytes for act in acts]
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if nbytes[b] != nbytes[a]:
                break
            da, db = best.decisions[a], best.decisions[b]
            if da is db or (Decision.SWAP in (da, db) and not (acts[a].swappable and acts[b].swappable)):
                continue
            if ev.simulations >= stop_at:
                return None
            trial = list(best.decisions)
            trial[a], trial[b] = db, da
            if (c := faster(ev, best, trial)) is not None:
                return c
    return None


def linked(ev: Evaluator, best: Candidate, order: list[int], stop_at: int) -> Candidate | None:
    """The first faster fitting plan that sets an activation and one its shortest recompute chain
    reads to the same new decision (recompute a convolution's output together with the ReLU
    output it reads: one chain, where recomputing either alone frees too little or costs a
    longer chain), with, where that alone misses the limit, one change to the outputs of an op
    those two chains read or read with them (a batch norm's saved mean and inverse deviation,
    beside its ReLU output: swapped together rather than rebuilt by a chain of their own);
    or None. ``order``: largest first."""
    acts = ev.graph.activations
    inputs, readers = chain_readers(ev)
    outputs: dict[int, list[int]] = {}  # an op's saved outputs, decided together
    for a, act in enumerate(acts):
        outputs.setdefault(act.producer, []).append(a)
    for b in order:
        for a in inputs[b]:
            near = {*inputs[a], *inputs[b], *(c for i in inputs[a] + inputs[b] for c in readers[i])} - {a, b}
            units = sorted({tuple(c for c in outputs[acts[n].producer] if c not in (a, b)) for n in near})
            for d in Decision:
                if best.decisions[a] is d or best.decisions[b] is d or (
                        d is Decision.SWAP and not (acts[a].swappable and acts[b].swappable)):
                    continue  # one change: tried already
                trial = list(best.decisions)
                trial[a] = trial[b] = d
                tries = [trial] + [with_group(trial, acts, list(u), e) for u in units for e in Decision
                                   if any(trial[c] is not e for c in u)
                                   and (e is not Decision.SWAP or all(acts[c].swappable for c in u))]
                for t in tries:
                    if ev.simulations >= stop_at:
                        return None
                    c = ev.evaluate(t)
                    if c is not None and c.fits:
                        if c.step_time < best.step_time * (1 - 1e-9):
                            return c
                        break  # fits: the pair alone is no faster
    return None


def followups(ev: Evaluator, best: Candidate, order: list[int], stop_at: int) -> Candidate | None:
    """The first faster fitting plan made of a change that fits but is no faster alone and one
    more change to an activation at most two chain links away (one reads the other's chain input,
    or reads a value whose chain reads it); or None. ``order``: largest first.

    Swapping a 1 MiB clone that ``local`` recomputed costs time alone, but the chain through it no
    longer runs, and the dropout mask two links away can then stay on the device instead of being
    swapped (test:transformer_block at its floor over PCIe3: 1.398x -> 1.338x, the optimum)."""
    acts = ev.graph.activations
    inputs, readers = chain_readers(ev)
    links = [set(inputs[a]) | readers.get(a, set()) for a in range(len(acts))]
    rank = {a: i for i, a in enumerate(order)}
    for a in order:
        near = sorted(links[a].union(*(links[b] for b in links[a])) - {a}, key=rank.__getitem__)
        for d in Decision:
            if d is best.decisions[a] or (d is Decision.SWAP and not acts[a].swappable) or not near:
                continue
            if ev.simulations >= stop_at:
                return None
            first = list(best.decisions)
            first[a] = d
            c = ev.evaluate(first)
            if c is None or not c.fits:
                continue
            for b in near:
                for e in Decision:
                    if e is first[b] or (e is Decision.SWAP and not acts[b].swappable):
                        continue
                    if ev.simulations >= stop_at:
                        return None
                    trial = list(first)
                    trial[b] = e
                    if (c := faster(ev, best, trial)) is not None:
                        return c
    return None


def clusters(ev: Evaluator, best: Candidate, stop_at: int) -> Candidate:
    """First-improvement descent where each move recomputes (or swaps) a cluster of kept activations
    together: the kept ones whose shortest recompute chains read one value, with the kept ones whose
    chains read those; the clusters of most bytes first. A GELU's intermediates read the MLP's first
    output and one another: recomputing one or two of them frees too little for the chain it costs,
    recomputing three together rebuilds them in one short chain (GPT-2 at 2 layers returning its
    logits, at its floor over PCIe3: from 1.685x the in-core step, where local search alone ends,
    to 1.523x).
    Until no move helps or ``ev.simulations`` reaches ``stop_at``."""
    acts = ev.graph.activations
    nbytes = [ev.graph.buffers[act.buffer].nbytes for act in acts]
    _, readers = chain_readers(ev)
    improved = True
    while improved and ev.simulations < stop_at:
        improved = False
        kept = {a for a, d in enumerate(best.decisions) if d is Decision.KEEP}
        found: set[tuple[int, ...]] = set()
        for r in range(len(acts)):
            near = readers.get(r, set()) & kept
            cluster = tuple(sorted(near.union(*(readers.get(c, set()) & kept for c in near))))
            if len(cluster) > 1:
                found.add(cluster)
        for cluster in sorted(found, key=lambda c: (-sum(nbytes[a] for a in c), c)):
            for d in (Decision.RECOMPUTE, Decision.SWAP):
                trial = with_group(best.decisions, acts, cluster, d)
                if trial == list(best.decisions):
                    continue
                if ev.simulations >= stop_at:
                    return best
                if (c := faster(ev, best, trial)) is not None:
                    best, improved = c, True
                    break
            if improved:
                break
    return best
