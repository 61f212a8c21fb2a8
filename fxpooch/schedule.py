"""Decisions -> a typed instruction list: what runs, in order, on which stream, and what it allocates.

The same :class:`Schedule` drives the simulator (stage 4) and the rewrite (stage 6), so the
predicted timeline and the executed graphs cannot drift apart. Liveness follows FX's own rule:
a value dies after its last reader in program order.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .graph import BufferKind, Phase, StepGraph
from .types import ActivationId, BufferId, InstanceId, OpId


class Decision(str, enum.Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


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
    #: per op: bytes it takes and frees inside itself while it runs (the graph's ``op_scratch``)
    op_scratch: tuple[int, ...] = ()

    @functools.cached_property
    def instr_scratch(self) -> tuple[int, ...]:
        """Per instruction: the scratch bytes held while it runs (a RUN's or RECOMPUTE's op's); ()
        when no op takes any."""
        if not self.op_scratch:
            return ()
        scratch, ops = self.op_scratch, (Kind.RUN, Kind.RECOMPUTE)
        return tuple(scratch[ins.op] if ins.kind in ops else 0 for ins in self.instrs)


class NotRecomputable(Exception):
    """Internal: an activation's recompute chain reaches something unavailable or unsafe."""


def member_owner(graph: StepGraph) -> dict[int, ActivationId]:
    return {m: a for a, act in enumerate(graph.activations) for m in act.members}


def chain_inputs(graph: StepGraph, a: ActivationId, owner: dict[int, ActivationId]) -> list[ActivationId]:
    """The activations ``a``'s shortest recompute chain (every other activation available) reads
    from the device: every chain that rebuilds ``a`` runs those ops."""
    ops = chain_ops(graph, a, lambda _: False, owner, strict=False)
    return sorted({owner[v] for o in ops for v in graph.ops[o].recompute_args
                   if v in owner and v in graph.saved and v not in ops} - {a})


def recompute_chain(graph: StepGraph, a: ActivationId, decisions: Sequence[Decision],
                    owner: dict[int, ActivationId] | None = None) -> tuple[OpId, ...]:
    """Forward ops (program order) that rebuild activation ``a`` from values the backward has.

    Raises NotRecomputable if the chain needs an unsaved input or an op that is random or mutates.
    """
    owner = member_owner(graph) if owner is None else owner
    return tuple(sorted(chain_ops(graph, a, lambda b: decisions[b] is Decision.RECOMPUTE, owner)))


def chain_ops(graph: StepGraph, a: ActivationId, recomputed: Callable[[ActivationId], bool],
              owner: dict[int, ActivationId], strict: bool = True) -> set[OpId]:
    """The forward ops reached from ``a``'s members through saved values of activations for which
    ``recomputed(activation)`` holds. ``strict``: raise NotRecomputable at an unsaved input or a
    random or mutating op; otherwise stop there."""
    own = set(graph.activations[a].members)
    chain: set[int] = set()
    stack = list(own)
    while stack:
        x = stack.pop()
        if x in chain:
            continue
        if x not in own and x in graph.saved and (x not in owner or not recomputed(owner[x])):
            continue  # available in the backward
        op = graph.ops[x]
        if op.phase is not Phase.FORWARD or op.target == "placeholder":
            if not strict:
                continue
            raise NotRecomputable(f"{graph.activations[a].name}: needs unsaved input {op.name}")
        if strict and not op.recomputable:
            raise NotRecomputable(f"{graph.activations[a].name}: {op.name} ({op.target}) is random or mutating")
        chain.add(x)
        stack.extend(op.recompute_args)
    return chain


def can_recompute(graph: StepGraph, a: ActivationId, decisions: Sequence[Decision], owner=None) -> bool:
    try:
        recompute_chain(graph, a, decisions, owner)
    except NotRecomputable:
        return False
    return True


def build_schedule(graph: StepGraph, decisions: Sequence[Decision],
                   prefetch_before: Sequence[OpId] | None = None, share: bool = True) -> Schedule:
    """Lay out the step for ``decisions``; prefetches default to just before their first use.

    Recomputes run just before their activation's first backward reader, in that order. With
    ``share`` (checkpointing's rule), a recompute chain stops at recomputed activations already
    rebuilt (their copies stay alive until their last reader, this chain included), and every
    recomputed activation it rebuilds whole is kept from then on instead of being recomputed again
    at its own first reader: a segment between available values runs once. Without ``share``,
    each recomputed activation reruns its whole chain alone (fewer bytes live, more compute).

    Instance ids: buffer ``b``'s original copy is instance ``b``; swapped-in and recomputed
    copies are numbered after the buffers.
    """
    decisions = tuple(decisions)
    acts = graph.activations
    ops = graph.ops
    owner = member_owner(graph)

    # first backward op that needs each swapped / recomputed activation
    first_use: dict[int, int] = {}
    for a, act in enumerate(acts):
        if decisions[a] is not Decision.KEEP:
            readers = graph.backward_readers(act)
            if readers:
                first_use[a] = readers[0]
    chains: dict[int, tuple[int, ...]] = {}
    materialises: dict[int, tuple[int, ...]] = {}
    shared = False
    rebuilt: set[int] = set()
    memo = _per_graph(graph, _chain_memo)

    def remembered(b: int, pending: Callable[[int], bool]) -> set[int]:
        """``chain_ops(graph, b, pending, owner)``, from ``memo`` when every activation that walk asked
        ``pending`` about answers as it did then (the walk is the same), asking each again (``pending``
        notes what it sees)."""
        for asked, ops_of in memo.get(b, ()):
            if all(pending(c) is answer for c, answer in asked):
                return set(ops_of)
        asked: list[tuple[int, bool]] = []

        def asking(c: int) -> bool:
            answer = pending(c)
            asked.append((c, answer))
            return answer
        chain = chain_ops(graph, b, asking, owner)
        seen = memo.setdefault(b, [])
        seen.insert(0, (tuple(dict.fromkeys(asked)), frozenset(chain)))
        del seen[_CHAIN_MEMO_WALKS:]
        return chain

    recomputed = sorted((a for a, d in enumerate(decisions) if d is Decision.RECOMPUTE),
                        key=lambda a: (first_use.get(a, -1), a))
    for b in recomputed:
        if b in rebuilt:
            continue
        if not share or b not in first_use:
            chains[b] = tuple(sorted(remembered(b, lambda c: decisions[c] is Decision.RECOMPUTE)))
            materialises[b] = (b,)
            continue

        def pending(c: int) -> bool:
            nonlocal shared
            if c in rebuilt:
                shared = True
                return False
            return decisions[c] is Decision.RECOMPUTE

        chain = remembered(b, pending)
        whole: set[int] = set()
        grown = True
        while grown:  # a pending activation whose storage the chain allocates is rebuilt whole
            grown = False
            for c in {owner[x] for x in chain if x in owner} - whole - {b}:
                if (c in first_use and c not in rebuilt and decisions[c] is Decision.RECOMPUTE
                        and acts[c].producer in chain):
                    whole.add(c)
                    chain |= remembered(c, pending)
                    grown = True
        shared = shared or bool(whole)
        chains[b] = tuple(sorted(chain))
        materialises[b] = (b, *sorted(whole))
        rebuilt.update(materialises[b])
    for b, chain in chains.items():
        if b not in first_use:
            continue
        for a in {owner[x] for o in chain for x in ops[o].recompute_args if x in owner} - {b}:
            if decisions[a] is Decision.SWAP and a in first_use:
                first_use[a] = min(first_use[a], first_use[b])
    prefetch = [-1] * len(acts)
    for a, use in first_use.items():
        if decisions[a] is Decision.SWAP:
            chosen = prefetch_before[a] if prefetch_before is not None else -1
            prefetch[a] = chosen if 0 <= chosen <= use else use

    # instances: original copies first (id = buffer id), then swapped-in and recomputed copies
    buffers = graph.buffers
    inst_bytes, inst_buf, persistent = (list(column) for column in _per_graph(graph, _buffer_columns))

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

    buffer_bytes = _per_graph(graph, _buffer_columns)[0]
    recompute_reads = graph.recompute_read_buffers

    def recompute_instrs(b: int) -> None:
        """The chain's own buffers are fresh copies tagged with ``b``; other reads see ``view``.
        (``emit`` and ``copy_of`` inlined: this runs for every recomputed chain of every schedule.)"""
        kept = {acts[c].buffer for c in materialises[b]}
        chain = chains[b]
        own: dict[int, int] = {}
        fresh: list[int] = []  # the buffers copied, in instance order
        n = len(inst_bytes)
        for o in chain:
            for buf in allocs[o]:
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
            new = tuple(map(owned, allocs[o]))
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
                for a in wait_at.get(op_id, ()):
                    emit(Kind.WAIT, -1, a, (), ())
                for b in recompute_at.get(op_id, ()):
                    recompute_instrs(b)
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
        materialises=materialises, shared=shared, op_scratch=graph.op_scratch,
    )


_PER_GRAPH: dict[int, tuple[weakref.ref, dict[Callable, object]]] = {}


def _per_graph(graph: StepGraph, make: Callable[[StepGraph], object]):
    """``make(graph)``, computed once per graph: what every schedule of ``graph`` shares."""
    cached = _PER_GRAPH.get(id(graph))
    if cached is None or cached[0]() is not graph:
        cached = _PER_GRAPH[id(graph)] = (weakref.ref(graph, lambda _, key=id(graph): _PER_GRAPH.pop(key, None)), {})
    values = cached[1]
    if make not in values:
        values[make] = make(graph)
    return values[make]


#: walks of one activation's recompute chain :func:`build_schedule` remembers per graph (the latest)
_CHAIN_MEMO_WALKS = 4


def _chain_memo(graph: StepGraph) -> dict[int, list[tuple[tuple[tuple[int, bool], ...], frozenset[int]]]]:
    """Per activation: the walks of its recompute chain (what ``pending`` answered, the ops found)."""
    return {}


def _forward_runs(graph: StepGraph) -> dict[int, Instr]:
    """The RUN instruction of each forward op: the same in every schedule of ``graph``."""
    return _per_graph(graph, _make_forward_runs)


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
    n = len(instrs)
    new_index = _moved_order(instrs, at)
    out = [None] * int(new_index.max() + 1 if n else 0)
    for i, j in enumerate(new_index.tolist()):
        if j >= 0:
            out[j] = instrs[i]

    def remap(indices: tuple[int, ...]) -> tuple[int, ...]:
        x = np.asarray(indices, dtype=np.int64)
        return tuple(np.where(x >= 0, new_index[x], -1).tolist()) if len(x) else ()

    return dataclasses.replace(schedule, prefetch_before=tuple(target), instrs=tuple(out),
                               last_reader=remap(schedule.last_reader), first_alloc=remap(schedule.first_alloc))


def _moved_order(instrs: tuple[Instr, ...], at: dict[int, list[int]]) -> np.ndarray:
    """Per instruction: its index once the prefetches of ``at[op]`` (activations, in order) are
    issued just before backward op ``op``'s group; -1 for a prefetch of no ``at`` list.

    A group is the non-prefetch instructions since the last RUN or OFFLOAD, up to and including
    the RUN that closes it (an offload follows its producer's run and belongs to no later group).
    """
    n = len(instrs)
    PREFETCH, RUN, OFFLOAD = Kind.PREFETCH, Kind.RUN, Kind.OFFLOAD
    kinds = [ins[0] for ins in instrs]
    is_prefetch = np.fromiter((k is PREFETCH for k in kinds), dtype=bool, count=n)
    closes = np.fromiter((k is RUN or k is OFFLOAD for k in kinds), dtype=bool, count=n)
    positions = np.arange(n, dtype=np.int64)
    last_close = np.maximum.accumulate(np.where(closes, positions, -1)) if n else positions
    next_kept = np.minimum.accumulate(np.where(is_prefetch, n, positions)[::-1])[::-1]
    prefetch_of = {instrs[i][2]: i for i in np.flatnonzero(is_prefetch).tolist()}
    run_of = {instrs[i][1]: i for i in np.flatnonzero(closes).tolist() if kinds[i] is RUN and instrs[i][1] in at}
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
    return new_index
