"""Decisions -> a typed instruction list: what runs, in order, on which stream, and what it allocates.

The same :class:`Schedule` drives the simulator (stage 4) and the rewrite (stage 6), so the
predicted timeline and the executed graphs cannot drift apart. Liveness follows FX's own rule:
a value dies after its last reader in program order.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .graph import BufferKind, StepGraph
from .segments import Recomputes, per_graph, plan_recomputes
from .types import ActivationId, BufferId, Decision, InstanceId, OpId


class Kind(str, enum.Enum):
    RUN = "run"  # an op of the captured graphs, on the compute stream
    OFFLOAD = "offload"  # device -> host copy of an activation (D2H stream)
    PREFETCH = "prefetch"  # host -> device copy (H2D stream); allocates on the device
    WAIT = "wait"  # compute stream waits for a prefetch
    RECOMPUTE = "recompute"  # a forward op run again in the backward, for a recompute segment


class Instr(NamedTuple):
    kind: Kind
    op: OpId = OpId(-1)  # RUN / RECOMPUTE
    act: ActivationId = ActivationId(-1)  # OFFLOAD / PREFETCH / WAIT / RECOMPUTE
    allocs: tuple[InstanceId, ...] = ()
    reads: tuple[InstanceId, ...] = ()


#: :attr:`Schedule.kinds`' code of each kind
KIND_CODE = {kind: code for code, kind in enumerate(Kind)}
_kind_of = operator.itemgetter(0)
_op_of = operator.itemgetter(1)


@dataclass(frozen=True)
class Schedule:
    decisions: tuple[Decision, ...]  # per activation
    prefetch_before: tuple[OpId, ...]  # per activation: backward op the prefetch precedes (-1: none)
    instrs: tuple[Instr, ...]
    instance_bytes: tuple[int, ...]
    instance_buffer: tuple[BufferId, ...]
    persistent: tuple[bool, ...]  # instance lives until the step ends
    last_reader: tuple[int, ...]  # per instance: instruction index (its own alloc if never read)
    first_alloc: tuple[int, ...]  # per instance: the instruction that allocates it (-1: none)
    chains: dict[ActivationId, tuple[OpId, ...]]  # activation whose recompute is emitted -> forward ops run again
    first_use: dict[ActivationId, OpId]  # swapped/recomputed activation -> first backward op needing it
    #: activation whose recompute is emitted -> the recomputed activations it makes available
    #: (itself first; with ``share``, also those its chain rebuilds whole, as checkpointing does)
    materialises: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: did sharing change anything (a chain stopped at, or rebuilt, another recomputed activation)
    shared: bool = False
    #: recomputed activations whose chains run alone, shared with none (``plan_recomputes(apart=...)``)
    apart: frozenset[int] = frozenset()
    #: per op: bytes it takes and frees inside itself while it runs (the graph's ``op_scratch``)
    op_scratch: tuple[int, ...] = ()

    @functools.cached_property
    def kinds(self) -> np.ndarray:
        """Per instruction: its kind's index in :class:`Kind` (``KIND_CODE``), for vector work."""
        return np.fromiter(map(KIND_CODE.__getitem__, map(_kind_of, self.instrs)), dtype=np.int8, count=len(self.instrs))

    @functools.cached_property
    def ops(self) -> np.ndarray:
        """Per instruction: its op (-1 for a copy or a wait), for vector work."""
        return np.fromiter(map(_op_of, self.instrs), dtype=np.int64, count=len(self.instrs))

    @functools.cached_property
    def instance_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per instance, read-only arrays: its bytes, the instruction allocating it (-1: none) and
        the one reading it last, whether it is allocated on the device, and whether it is freed
        (allocated, not persistent). The simulator and ``static_memory`` both read them."""
        nbytes = np.asarray(self.instance_bytes, dtype=np.int64)
        alloc = np.asarray(self.first_alloc, dtype=np.int64)
        last = np.asarray(self.last_reader, dtype=np.int64)
        live = (alloc >= 0) & (nbytes > 0)
        columns = (nbytes, alloc, last, live, live & ~np.asarray(self.persistent, dtype=bool))
        for column in columns:
            column.setflags(write=False)
        return columns

    @functools.cached_property
    def instr_scratch(self) -> tuple[int, ...]:
        """Per instruction: the scratch bytes held while it runs (a RUN's or RECOMPUTE's op's); ()
        when no op takes any."""
        if not self.op_scratch:
            return ()
        scratch, ops = self.op_scratch, (Kind.RUN, Kind.RECOMPUTE)
        return tuple(scratch[ins.op] if ins.kind in ops else 0 for ins in self.instrs)


def build_schedule(graph: StepGraph, decisions: Sequence[Decision],
                   prefetch_before: Sequence[OpId] | None = None, share: bool = True,
                   recomputes: Recomputes | None = None) -> Schedule:
    """Lay out the step for ``decisions``; prefetches default to just before their first use.

    Recomputes run just before their activation's first backward reader, in that order; compute
    waits for a prefetch just before the first of them that reads it, else just before its reader
    (a chain that does not read it runs while it is copied). With
    ``share`` (checkpointing's rule), a recompute chain stops at recomputed activations already
    rebuilt (their copies stay alive until their last reader, this chain included), and every
    recomputed activation it rebuilds whole is kept from then on instead of being recomputed again
    at its own first reader: a segment between available values runs once. Without ``share``,
    each recomputed activation reruns its whole chain alone (fewer bytes live, more compute).

    Instance ids: buffer ``b``'s original copy is instance ``b``; swapped-in and recomputed
    copies are numbered after the buffers. ``recomputes``: ``plan_recomputes(graph, decisions,
    share)`` where the caller has it already.
    """
    decisions = tuple(decisions)
    acts = graph.activations
    if recomputes is None:
        recomputes = plan_recomputes(graph, decisions, share)
    first_use, chains, materialises, shared, apart = recomputes
    prefetch = [-1] * len(acts)
    for a, use in first_use.items():
        if decisions[a] is Decision.SWAP:
            chosen = prefetch_before[a] if prefetch_before is not None else -1
            prefetch[a] = chosen if 0 <= chosen <= use else use

    # instances: original copies first (id = buffer id), then swapped-in and recomputed copies
    buffers = graph.buffers
    inst_bytes, inst_buf, persistent = (list(column) for column in per_graph(graph, _buffer_columns))

    def copy_of(buf: int, nbytes: int) -> int:
        inst_bytes.append(nbytes)
        inst_buf.append(buf)
        persistent.append(False)
        return len(inst_bytes) - 1

    view = list(range(len(buffers)))  # per buffer: the instance a backward reader sees
    for a, d in enumerate(decisions):
        if d is Decision.SWAP:
            view[acts[a].buffer] = copy_of(acts[a].buffer, acts[a].transfer_bytes)
        elif d is Decision.RECOMPUTE:
            view[acts[a].buffer] = copy_of(acts[a].buffer, buffers[acts[a].buffer].nbytes)

    reads, allocs = graph.read_buffers, graph.dynamic_allocs
    instrs: list[Instr] = []
    offload_after: dict[int, list[int]] = {}
    for a, act in enumerate(acts):
        if decisions[a] is Decision.SWAP:
            offload_after.setdefault(max(act.members), []).append(a)
    prefetch_at: dict[int, list[int]] = {}
    wait_at: dict[int, list[int]] = {}
    for a, op in sorted(enumerate(prefetch), key=lambda t: first_use.get(t[0], -1)):
        if op >= 0:  # prefetches issued together leave in the order they are needed (H2D is FIFO)
            prefetch_at.setdefault(op, []).append(a)
            wait_at.setdefault(first_use[a], []).append(a)
    recompute_at: dict[int, list[int]] = {}
    for b in chains:
        if b in first_use:
            recompute_at.setdefault(first_use[b], []).append(b)

    last: list[int] = [-1] * len(inst_bytes)  # per instance: its last reader (its allocator if unread)
    first: list[int] = [-1] * len(inst_bytes)

    def emit(kind: Kind, op: int, act: int, new: tuple[int, ...], read: tuple[int, ...]) -> None:
        i = len(instrs)
        instrs.append(make_instr(Instr, (kind, op, act, new, read)))
        for x in new:
            if first[x] < 0:
                first[x] = last[x] = i
        for x in read:
            last[x] = i

    buffer_bytes = per_graph(graph, _buffer_columns)[0]
    recompute_reads, recompute_allocs = graph.recompute_read_buffers, graph.recompute_allocs

    def chain_reads(b: int) -> set[int]:
        """The buffers ``b``'s chain reads and does not make itself."""
        return ({buf for o in chains[b] for buf in recompute_reads[o]}
                - {buf for o in chains[b] for buf in recompute_allocs[o]})

    def recompute_instrs(b: int) -> None:
        """The chain's own buffers are fresh copies tagged with ``b``; other reads see ``view``.
        (``emit`` and ``copy_of`` inlined: this runs for every recomputed chain of every schedule.)"""
        kept = {acts[c].buffer for c in materialises[b]}
        chain = chains[b]
        own: dict[int, int] = {}
        fresh: list[int] = []  # the buffers copied, in instance order
        n = len(inst_bytes)
        for o in chain:
            for buf in recompute_allocs[o]:
                if buf in kept:
                    own[buf] = view[buf]
                elif buf not in own:
                    own[buf] = n + len(fresh)
                    fresh.append(buf)
        inst_bytes.extend([buffer_bytes[buf] for buf in fresh])
        inst_buf.extend(fresh)
        persistent.extend([False] * len(fresh))
        last.extend([-1] * (len(inst_bytes) - len(last)))
        first.extend([-1] * (len(inst_bytes) - len(first)))
        sees, owned, seen = own.get, own.__getitem__, view.__getitem__  # mapped: no comprehension frames
        i = len(instrs)
        for o in chain:
            new = tuple(map(owned, recompute_allocs[o]))
            read = recompute_reads[o]
            read = tuple(map(sees, read, map(seen, read)))
            instrs.append(make_instr(Instr, (RECOMPUTE, o, b, new, read)))
            for x in new:
                if first[x] < 0:
                    first[x] = last[x] = i
            for x in read:
                last[x] = i
            i += 1

    make_instr = tuple.__new__  # Instr without its keyword-default wrapper: this loop is the hot path
    RECOMPUTE = Kind.RECOMPUTE
    runs = _forward_runs(graph)
    for start, stop in graph.forward_range:
        for op_id in range(start, stop):
            i = len(instrs)
            instrs.append(runs[op_id])
            for x in allocs[op_id]:
                if first[x] < 0:
                    first[x] = last[x] = i
            for x in reads[op_id]:
                last[x] = i
            for a in offload_after.get(op_id, ()):
                emit(Kind.OFFLOAD, -1, a, (), (acts[a].buffer,))
    for buf in graph.returned_buffers:  # a dropped user output is held until the forward returns
        if first[buf] >= 0:
            last[buf] = max(last[buf], len(instrs) - 1)
    before = prefetch_at.keys() | wait_at.keys() | recompute_at.keys()  # backward ops with more than a run
    RUN = Kind.RUN
    for g in reversed(range(len(graph.backward_range))):
        for op_id in range(*graph.backward_range[g]):
            if op_id in before:
                for a in prefetch_at.get(op_id, ()):
                    emit(Kind.PREFETCH, -1, a, (view[acts[a].buffer],), ())
                waits = wait_at.get(op_id, [])
                for b in recompute_at.get(op_id, ()):
                    if waits:  # compute waits for a prefetch only before the first chain that reads it
                        read = chain_reads(b)
                        for a in [a for a in waits if acts[a].buffer in read]:
                            emit(Kind.WAIT, -1, a, (), ())
                        waits = [a for a in waits if acts[a].buffer not in read]
                    recompute_instrs(b)
                for a in waits:
                    emit(Kind.WAIT, -1, a, (), ())
            i = len(instrs)
            new = allocs[op_id]
            read = tuple(map(view.__getitem__, reads[op_id]))
            instrs.append(make_instr(Instr, (RUN, op_id, -1, new, read)))
            for x in new:
                if first[x] < 0:
                    first[x] = last[x] = i
            for x in read:
                last[x] = i
        # autograd holds the incoming gradients for the whole backward call
        for buf in graph.tangent_buffers[g]:
            if last[buf] >= 0:
                last[buf] = len(instrs) - 1
    return Schedule(
        decisions=decisions, prefetch_before=tuple(prefetch), instrs=tuple(instrs),
        instance_bytes=tuple(inst_bytes), instance_buffer=tuple(inst_buf), persistent=tuple(persistent),
        last_reader=tuple(last), first_alloc=tuple(first), chains=chains, first_use=first_use,
        materialises=materialises, shared=shared, apart=apart, op_scratch=graph.op_scratch,
    )


def _forward_runs(graph: StepGraph) -> dict[int, Instr]:
    """The RUN instruction of each forward op: the same in every schedule of ``graph``."""
    return per_graph(graph, _make_forward_runs)


def _make_forward_runs(graph: StepGraph) -> dict[int, Instr]:
    return {op: Instr(Kind.RUN, op, -1, graph.dynamic_allocs[op], graph.read_buffers[op])
            for start, stop in graph.forward_range for op in range(start, stop)}


def _buffer_columns(graph: StepGraph) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Per buffer: the bytes, buffer id and persistence of its original instance."""
    return (tuple(b.nbytes for b in graph.buffers), tuple(range(len(graph.buffers))),
            tuple(b.kind is BufferKind.OUTPUT for b in graph.buffers))


def move_prefetches(schedule: Schedule, prefetch_before: Sequence[OpId]) -> Schedule:
    """``schedule`` with each swap-in issued before ``prefetch_before[a]`` instead (not later
    than its first use): what :func:`build_schedule` lays out for those positions, without
    laying out the rest of the step again.

    A swap-in issued before a backward op goes just before that op's group (what runs just for
    it: its waits, recomputes and run); the other instructions keep their order.
    """
    old = schedule.prefetch_before
    first_use = schedule.first_use
    target = [p if 0 <= p <= first_use.get(a, -1) else old[a] for a, p in enumerate(prefetch_before)]
    target = [t if old[a] >= 0 else -1 for a, t in enumerate(target)]
    at: dict[int, list[int]] = {}
    for a in sorted((a for a, t in enumerate(target) if t >= 0), key=lambda a: first_use[a]):
        at.setdefault(target[a], []).append(a)
    instrs = schedule.instrs
    new_index, order = _moved_order(schedule, at)
    out = list(map(instrs.__getitem__, order.tolist()))

    def remap(indices: tuple[int, ...]) -> tuple[int, ...]:
        x = np.asarray(indices, dtype=np.int64)
        return tuple(np.where(x >= 0, new_index[x], -1).tolist()) if len(x) else ()

    return dataclasses.replace(schedule, prefetch_before=tuple(target), instrs=tuple(out),
                               last_reader=remap(schedule.last_reader), first_alloc=remap(schedule.first_alloc))


def _moved_order(schedule: Schedule, at: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per instruction: its index once the prefetches of ``at[op]`` (activations, in order) are
    issued just before backward op ``op``'s group; -1 for a prefetch of no ``at`` list. And the
    instructions in their new order.

    A group is the non-prefetch instructions since the last RUN or OFFLOAD, up to and including
    the RUN that closes it (an offload follows its producer's run and belongs to no later group).
    """
    instrs, kinds = schedule.instrs, schedule.kinds
    n = len(instrs)
    is_prefetch = kinds == KIND_CODE[Kind.PREFETCH]
    is_run = kinds == KIND_CODE[Kind.RUN]
    closes = is_run | (kinds == KIND_CODE[Kind.OFFLOAD])
    positions = np.arange(n, dtype=np.int64)
    last_close = np.maximum.accumulate(np.where(closes, positions, -1)) if n else positions
    next_kept = np.minimum.accumulate(np.where(is_prefetch, n, positions)[::-1])[::-1]
    prefetch_of = {instrs[i][2]: i for i in np.flatnonzero(is_prefetch).tolist()}
    runs = np.flatnonzero(is_run)
    runs = runs[np.isin(schedule.ops[runs], list(at))]
    run_of = dict(zip(schedule.ops[runs].tolist(), runs.tolist()))
    kept = np.flatnonzero(~is_prefetch)
    moved, primary, secondary = [], [], []
    for op, acts in at.items():
        if op not in run_of:
            continue
        r = run_of[op]
        group_start = int(next_kept[last_close[r - 1] + 1]) if r > 0 else int(next_kept[0])
        for rank, a in enumerate(acts):
            moved.append(prefetch_of[a])
            primary.append(2 * group_start)
            secondary.append(rank)
    items = np.concatenate((kept, np.asarray(moved, dtype=np.int64)))
    keys = np.concatenate((2 * kept + 1, np.asarray(primary, dtype=np.int64)))
    ranks = np.concatenate((np.zeros(len(kept), dtype=np.int64), np.asarray(secondary, dtype=np.int64)))
    order = items[np.lexsort((ranks, keys))]
    new_index = np.full(n, -1, dtype=np.int64)
    new_index[order] = np.arange(len(order), dtype=np.int64)
    return new_index, order
