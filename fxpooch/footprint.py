"""A plan's program-order memory without laying out its instructions.

Near the floor most plans a search tries are over the limit in program order already, and that is
all it reads of them. :func:`program_memory` computes the curve :func:`~fxpooch.simulator.static_memory`
would read off :func:`~fxpooch.schedule.build_schedule`'s just-in-time schedule (the same value per
instruction), from where the schedule puts each instruction rather than from the instructions:
instruction indices come from counts (offloads per forward op, prefetches and recompute
lengths per backward op), each recompute chain's own buffers from a summary kept per chain, and
the rest from arrays. Only plans that may fit need their schedule built.

Instances are numbered as the schedule's are not: buffer ``b``'s original is ``b``, activation
``a``'s swapped-in copy ``n_buffers + a`` and its recomputed copy ``n_buffers + n_activations + a``;
a chain's own buffers are events of its summary only (nothing outside it reads them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .graph import BufferKind, StepGraph
from .segments import Recomputes, per_graph, plan_recomputes
from .types import Decision


class Copies(NamedTuple):
    """The recomputed copies of a plan's activations read in the backward: their instructions'
    lives, and the part of each their own readers need (from their first reader's group to their
    last reader). Held outside it, a copy is held for sharing: rebuilt by an earlier chain, or
    read by a later one."""

    acts: np.ndarray
    first: np.ndarray
    last: np.ndarray
    need_from: np.ndarray
    need_to: np.ndarray

    def held_at(self, i: int) -> np.ndarray:
        """The activations whose copies are held for sharing at instruction ``i``."""
        live = (self.first <= i) & (i <= self.last)
        return self.acts[live & ((i < self.need_from) | (i > self.need_to))]


class Footprint(NamedTuple):
    memory: np.ndarray  # per instruction: device bytes live (resident excluded, scratch included)
    forward: int  # instructions of the forward (its ops and offloads), laid out first
    recomputes: Recomputes  # the chains (``build_schedule`` takes them)
    copies: Copies | None = None  # the recomputed copies' lives (None: not known)

    @property
    def shared(self) -> bool:  # as ``Schedule.shared``
        return self.recomputes.shared


def program_memory(graph: StepGraph, decisions: Sequence[Decision], share: bool = True,
                   recomputes: Recomputes | None = None) -> Footprint | None:
    """``static_memory(build_schedule(graph, decisions, share=share))`` and the forward's length,
    without building the schedule; None where the graph's buffers are not one per activation (then
    build it). Raises NotRecomputable where ``build_schedule`` would. ``recomputes``:
    ``plan_recomputes(graph, decisions, share)`` where the caller has it already."""
    tables = per_graph(graph, _Tables.of)
    if tables is None:
        return None
    t: _Tables = tables
    if recomputes is None:
        recomputes = plan_recomputes(graph, decisions, share)
    first_use, chains, materialises, _, _ = recomputes
    n_acts, nb = len(decisions), t.n_buffers
    SWAP, RECOMPUTE = Decision.SWAP, Decision.RECOMPUTE
    code = np.fromiter((_CODE[d] for d in decisions), dtype=np.int8, count=n_acts)
    swapped = np.flatnonzero(code == 1)
    # forward: each op's RUN, then the offloads of the activations whose last member it is
    offloads = np.bincount(t.offload_pos[swapped], minlength=t.n_forward)
    run_f = np.arange(t.n_forward) + np.concatenate(([0], np.cumsum(offloads)[:-1]))
    forward = t.n_forward + len(swapped)
    # backward: each op's prefetches, recompute chains (each after the waits for the prefetches
    # it reads) and the other waits, then its RUN
    prefetched = [a for a in first_use if decisions[a] is SWAP]
    pf_pos = t.bwd_pos[[first_use[a] for a in prefetched]] if prefetched else np.zeros(0, np.int64)
    emitted = [b for b in chains if b in first_use]  # in the order build_schedule emits them
    chain_pos = t.bwd_pos[[first_use[b] for b in emitted]].tolist() if emitted else []
    extra = 2 * np.bincount(pf_pos, minlength=t.n_backward)
    if emitted:
        extra += np.bincount(chain_pos, [len(chains[b]) for b in emitted], minlength=t.n_backward).astype(np.int64)
    run_b = forward + np.arange(t.n_backward) + np.cumsum(extra)
    group = run_b - extra
    n = int(forward + t.n_backward + extra.sum())
    run_idx = np.concatenate((run_f, run_b))  # by program position

    view = np.arange(nb)
    view[t.act_buffer[swapped]] = nb + swapped
    recomputed = np.flatnonzero(code == 2)
    view[t.act_buffer[recomputed]] = nb + n_acts + recomputed
    size = nb + 2 * n_acts
    nbytes = np.concatenate((t.buffer_bytes, t.transfer_bytes, t.buffer_bytes[t.act_buffer]))
    first = np.full(size, n, dtype=np.int64)
    last = np.full(size, -1, dtype=np.int64)
    # originals: allocated by their op's RUN, read by forward RUNs as themselves, by backward RUNs
    # through the view, and by their offload
    first[t.allocated] = run_idx[t.alloc_pos[t.allocated]]
    last[t.fwd_read] = run_idx[t.fwd_last[t.fwd_read]]
    np.maximum.at(last, view[t.bwd_read], run_idx[t.bwd_last[t.bwd_read]])
    if len(swapped):
        rank = _rank_within(t.offload_pos[swapped])
        np.maximum.at(last, t.act_buffer[swapped], run_idx[t.offload_pos[swapped]] + 1 + rank)
    if prefetched:  # in activation order within an op
        order = np.argsort(pf_pos, kind="stable")
        pa, pp = np.asarray(prefetched)[order], pf_pos[order]
        first[nb + pa] = group[pp] + _rank_within(pp)
    scratch = np.zeros(n, dtype=np.int64)
    if t.op_scratch is not None:
        scratch[run_idx] = t.op_scratch
    at = (group + np.bincount(pf_pos, minlength=t.n_backward)).tolist()  # where each op's chains start
    waits: dict[int, list[int]] = {}  # op position -> the buffers its group's waits are still for
    if emitted:
        act_buffer = t.act_buffer_list
        for a, p in zip(prefetched, pf_pos.tolist()):
            waits.setdefault(p, []).append(act_buffer[a])
    starts, summaries = [], []
    for b, p in zip(emitted, chain_pos):
        s = _summary(t, graph, b, chains[b], materialises[b])
        if waits.get(p):  # the waits for the prefetches the chain reads come just before it
            before = [buf for buf in waits[p] if buf in s.reads]
            at[p] += len(before)
            waits[p] = [buf for buf in waits[p] if buf not in before]
        starts.append(at[p])
        at[p] += s.length
        summaries.append(s)
        if s.scratch is not None:
            scratch[starts[-1]:starts[-1] + s.length] += s.scratch
    if summaries:  # each table of every chain at once, its instructions shifted to where the chain starts
        def rows(field: int) -> tuple[np.ndarray, np.ndarray]:
            table = np.concatenate([s[field] for s in summaries])
            return table, np.repeat(starts, [len(s[field]) for s in summaries])
        alloc, shift = rows(_Chain.ALLOC)
        np.minimum.at(first, view[alloc[:, 1]], alloc[:, 0] + shift)
        read_rows, shift = rows(_Chain.READ)
        np.maximum.at(last, view[read_rows[:, 1]], read_rows[:, 0] + shift)
        own_rows, shift = rows(_Chain.OWN)
        own = (own_rows[:, 0] + shift, own_rows[:, 1] + shift + 1, own_rows[:, 2])
    else:
        own = None
    allocated = first < n
    last = np.maximum(last, first)
    # autograd holds a backward call's incoming gradients until it returns; a dropped user output
    # is held until the forward returns
    ends = np.append(run_b, forward - 1)  # a backward call of no op: what came before it
    holds = allocated[t.tangent]
    last[t.tangent[holds]] = np.maximum(last[t.tangent[holds]], ends[t.tangent_end[holds]])
    kept = t.returned[allocated[t.returned]]
    last[kept] = np.maximum(last[kept], forward - 1)
    live = allocated & (nbytes > 0)
    freed = live & ~np.concatenate((t.persistent, np.zeros(2 * n_acts, dtype=bool)))
    delta = np.bincount(first[live], nbytes[live], minlength=n + 1) - np.bincount(
        last[freed] + 1, nbytes[freed], minlength=n + 1)
    if own is not None:  # the chains' own buffers
        delta += np.bincount(own[0], own[2], minlength=n + 1) - np.bincount(own[1], own[2], minlength=n + 1)
    memory = np.cumsum(delta[:n]).astype(np.int64) + scratch
    read = np.asarray([a for a in first_use if decisions[a] is RECOMPUTE], dtype=np.int64)
    copy = nb + n_acts + read
    need_from = group[t.bwd_pos[[first_use[a] for a in read]]] if len(read) else read
    need_to = run_idx[t.bwd_last[t.act_buffer[read]]]
    return Footprint(memory, forward, recomputes, Copies(read, first[copy], last[copy], need_from, need_to))


_CODE = {Decision.KEEP: 0, Decision.SWAP: 1, Decision.RECOMPUTE: 2}


def _rank_within(keys: np.ndarray) -> np.ndarray:
    """Per element of ``keys`` (sorted, or grouped by value in the order wanted): its rank among the
    elements before it of the same value."""
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    ranks = np.empty(len(keys), dtype=np.int64)
    k = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    counts = np.diff(np.concatenate((starts, [len(k)])))
    ranks[order] = np.arange(len(k)) - np.repeat(starts, counts)
    return ranks


@dataclass(frozen=True)
class _Tables:
    """What every plan of a graph shares, by program position (forward ops, then backward ops in
    the order the schedule runs them)."""

    n_buffers: int
    n_forward: int
    n_backward: int
    bwd_pos: np.ndarray  # op id -> its position among the backward ops (-1: a forward op)
    buffer_bytes: np.ndarray
    transfer_bytes: np.ndarray  # per activation: its swapped-in copy's bytes
    act_buffer: np.ndarray  # per activation: its buffer
    act_buffer_list: list[int]  # the same, a list
    offload_pos: np.ndarray  # per activation: the program position of its last member
    persistent: np.ndarray  # per buffer: lives until the step ends
    allocated: np.ndarray  # buffers an op's RUN allocates
    alloc_pos: np.ndarray  # per buffer: the program position of the first RUN allocating it
    fwd_read: np.ndarray  # buffers a forward op reads
    fwd_last: np.ndarray  # per buffer: the program position of its last forward reader
    bwd_read: np.ndarray  # buffers a backward op reads
    bwd_last: np.ndarray  # per buffer: the program position of its last backward reader
    tangent: np.ndarray  # buffers a backward call holds until it returns
    tangent_end: np.ndarray  # per tangent buffer: the backward position of its call's last op
    returned: np.ndarray  # user outputs held until the forward returns
    op_scratch: np.ndarray | None  # per program position: the op's scratch bytes
    chains: dict  # (activation, chain, kept buffers) -> _Chain

    @classmethod
    def of(cls, graph: StepGraph) -> _Tables | None:
        acts = graph.activations
        if len({act.buffer for act in acts}) != len(acts):
            return None
        forward = [o for start, stop in graph.forward_range for o in range(start, stop)]
        backward = [o for g in reversed(range(len(graph.backward_range))) for o in range(*graph.backward_range[g])]
        order = forward + backward
        pos = np.full(len(graph.ops), -1, dtype=np.int64)
        pos[order] = np.arange(len(order))
        bwd_pos = np.where(pos >= len(forward), pos - len(forward), -1)
        nb = len(graph.buffers)
        alloc_pos = np.full(nb, -1, dtype=np.int64)
        fwd_last = np.full(nb, -1, dtype=np.int64)
        bwd_last = np.full(nb, -1, dtype=np.int64)
        for p, o in enumerate(order):
            for b in graph.dynamic_allocs[o]:
                if alloc_pos[b] < 0:
                    alloc_pos[b] = p
            for b in graph.read_buffers[o]:
                if p < len(forward):
                    fwd_last[b] = p
                else:
                    bwd_last[b] = p
        tangent = [(b, g) for g, bufs in enumerate(graph.tangent_buffers) for b in bufs]
        ends = np.cumsum([stop - start for start, stop in reversed(graph.backward_range)]) - 1
        end_of = {g: int(ends[len(graph.backward_range) - 1 - g]) for g in range(len(graph.backward_range))}
        scratch = np.asarray(graph.op_scratch, dtype=np.int64)[order] if graph.op_scratch else None
        return cls(
            n_buffers=nb, n_forward=len(forward), n_backward=len(backward), bwd_pos=bwd_pos,
            buffer_bytes=np.asarray([b.nbytes for b in graph.buffers], dtype=np.int64),
            transfer_bytes=np.asarray([act.transfer_bytes for act in acts], dtype=np.int64),
            act_buffer=np.asarray([act.buffer for act in acts], dtype=np.int64),
            act_buffer_list=[act.buffer for act in acts],
            offload_pos=np.asarray([pos[max(act.members)] for act in acts], dtype=np.int64),
            persistent=np.asarray([b.kind is BufferKind.OUTPUT for b in graph.buffers], dtype=bool),
            allocated=np.flatnonzero(alloc_pos >= 0), alloc_pos=alloc_pos,
            fwd_read=np.flatnonzero(fwd_last >= 0), fwd_last=fwd_last,
            bwd_read=np.flatnonzero(bwd_last >= 0), bwd_last=bwd_last,
            tangent=np.asarray([b for b, _ in tangent], dtype=np.int64),
            tangent_end=np.asarray([end_of[g] for _, g in tangent], dtype=np.int64),
            returned=np.asarray(graph.returned_buffers, dtype=np.int64),
            op_scratch=scratch, chains={})


class _Chain(NamedTuple):
    """One recompute chain's instructions, relative to its first: what they allocate and read
    outside the chain's own buffers (the views of the step: a kept rebuilt copy, an input), and the
    own buffers' lives."""

    length: int
    alloc: np.ndarray  # rows (instruction, kept buffer): where the chain allocates a kept copy
    read: np.ndarray  # rows (instruction, buffer): a buffer read through the view, its last reader
    own: np.ndarray  # rows (first instruction, last instruction, bytes): the chain's own buffers
    scratch: np.ndarray | None
    reads: frozenset[int]  # the buffers of ``read``

    ALLOC, READ, OWN = range(1, 4)


def _summary(t: _Tables, graph: StepGraph, b: int, chain: tuple[int, ...], materialises: tuple[int, ...]) -> _Chain:
    key = (b, chain, materialises)
    found = t.chains.get(key)
    if found is not None:
        return found
    kept = {graph.activations[c].buffer for c in materialises}
    own: dict[int, int] = {}  # a fresh buffer -> its own index
    own_first: list[int] = []
    own_last: list[int] = []
    own_bytes: list[int] = []
    alloc: dict[int, int] = {}  # a kept buffer -> where the chain allocates its copy
    read: dict[int, int] = {}  # a buffer the chain reads through the view -> its last reader
    for i, o in enumerate(chain):  # every allocation first: a read sees the chain's own copy
        for buf in graph.recompute_allocs[o]:
            if buf in kept:
                alloc.setdefault(buf, i)
            elif buf not in own:
                own[buf] = len(own_first)
                own_first.append(i)
                own_last.append(i)
                own_bytes.append(graph.buffers[buf].nbytes)
    for i, o in enumerate(chain):
        for buf in graph.recompute_read_buffers[o]:
            if buf in own:
                own_last[own[buf]] = max(own_last[own[buf]], i)
            else:
                read[buf] = i
    scratch = (np.asarray([graph.op_scratch[o] for o in chain], dtype=np.int64)
               if graph.op_scratch else None)
    def table(*columns: list[int]) -> np.ndarray:
        return np.asarray(columns, dtype=np.int64).reshape(len(columns), -1).T.copy()
    found = _Chain(len(chain), table(list(alloc.values()), list(alloc)), table(list(read.values()), list(read)),
                   table(own_first, own_last, own_bytes), scratch, frozenset(read))
    t.chains[key] = found
    return found
