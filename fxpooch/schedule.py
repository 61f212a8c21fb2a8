"""Decisions -> a typed instruction list: what runs, in order, on which stream, and what it allocates.

The same :class:`Schedule` drives the simulator (stage 4) and the rewrite (stage 6), so the
predicted timeline and the executed graphs cannot drift apart. Liveness follows FX's own rule:
a value dies after its last reader in program order.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .graph import BufferKind, Phase, StepGraph


class Decision(str, enum.Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


class Kind(str, enum.Enum):
    RUN = "run"  # an op of the captured graphs, on the compute stream
    OFFLOAD = "offload"  # device -> host copy of an activation (D2H stream)
    PREFETCH = "prefetch"  # host -> device copy (H2D stream); allocates on the device
    WAIT = "wait"  # compute stream waits for a prefetch
    RECOMPUTE = "recompute"  # a forward op run again in the backward, for one activation


# An instance is one device copy of a buffer: (buffer, tag), tag = ORIGINAL, ("in", act) or ("re", act).
ORIGINAL = 0


@dataclass(frozen=True)
class Instr:
    kind: Kind
    op: int = -1  # RUN / RECOMPUTE
    act: int = -1  # OFFLOAD / PREFETCH / WAIT / RECOMPUTE
    allocs: tuple[int, ...] = ()  # instance ids
    reads: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    decisions: tuple[Decision, ...]  # per activation
    prefetch_before: tuple[int, ...]  # per activation: backward op the prefetch precedes (-1: none)
    instrs: tuple[Instr, ...]
    instance_bytes: tuple[int, ...]
    instance_buffer: tuple[int, ...]
    persistent: tuple[bool, ...]  # instance lives until the step ends
    last_reader: tuple[int, ...]  # per instance: instruction index (its own alloc if never read)
    chains: dict[int, tuple[int, ...]]  # recomputed activation -> forward ops run again
    first_use: dict[int, int]  # swapped/recomputed activation -> first backward op needing it


class NotRecomputable(Exception):
    """Internal: an activation's recompute chain reaches something unavailable or unsafe."""


def member_owner(graph: StepGraph) -> dict[int, int]:
    return {m: a for a, act in enumerate(graph.activations) for m in act.members}


def recompute_chain(graph: StepGraph, a: int, decisions: Sequence[Decision],
                    owner: dict[int, int] | None = None) -> tuple[int, ...]:
    """Forward ops (program order) that rebuild activation ``a`` from values the backward has.

    Raises NotRecomputable if the chain needs an unsaved input or an op that is random or mutates.
    """
    owner = member_owner(graph) if owner is None else owner
    own = set(graph.activations[a].members)
    chain: set[int] = set()
    stack = list(own)
    while stack:
        x = stack.pop()
        if x in chain:
            continue
        if x not in own and x in graph.saved and (x not in owner or decisions[owner[x]] is not Decision.RECOMPUTE):
            continue  # available in the backward
        op = graph.ops[x]
        if op.phase is not Phase.FORWARD or op.target == "placeholder":
            raise NotRecomputable(f"{graph.activations[a].name}: needs unsaved input {op.name}")
        if not op.recomputable:
            raise NotRecomputable(f"{graph.activations[a].name}: {op.name} ({op.target}) is random or mutating")
        chain.add(x)
        stack.extend(op.recompute_args)
    return tuple(sorted(chain))


def can_recompute(graph: StepGraph, a: int, decisions: Sequence[Decision], owner=None) -> bool:
    try:
        recompute_chain(graph, a, decisions, owner)
    except NotRecomputable:
        return False
    return True


def build_schedule(graph: StepGraph, decisions: Sequence[Decision],
                   prefetch_before: Sequence[int] | None = None) -> Schedule:
    """Lay out the step for ``decisions``; prefetches default to just before their first use."""
    decisions = tuple(decisions)
    acts = graph.activations
    owner = member_owner(graph)
    chains = {a: recompute_chain(graph, a, decisions, owner)
              for a, d in enumerate(decisions) if d is Decision.RECOMPUTE}
    chain_allocs = {a: {b for o in ops for b in graph.ops[o].allocs} for a, ops in chains.items()}

    # first backward op that needs each swapped / recomputed activation
    first_use: dict[int, int] = {}
    for a, act in enumerate(acts):
        if decisions[a] is not Decision.KEEP:
            readers = graph.backward_readers(act)
            if readers:
                first_use[a] = readers[0]
    for b, ops in chains.items():
        if b not in first_use:
            continue
        for a in {owner[x] for o in ops for x in graph.ops[o].recompute_args if x in owner} - {b}:
            if decisions[a] is Decision.SWAP and a in first_use:
                first_use[a] = min(first_use[a], first_use[b])
    prefetch = [-1] * len(acts)
    for a, use in first_use.items():
        if decisions[a] is Decision.SWAP:
            chosen = prefetch_before[a] if prefetch_before is not None else -1
            prefetch[a] = chosen if 0 <= chosen <= use else use

    # instances
    inst_ids: dict[tuple[int, object], int] = {}
    inst_bytes: list[int] = []
    inst_buf: list[int] = []
    persistent: list[bool] = []

    def inst(buf: int, tag: object, nbytes: int | None = None) -> int:
        key = (buf, tag)
        if key not in inst_ids:
            inst_ids[key] = len(inst_bytes)
            b = graph.buffers[buf]
            inst_bytes.append(b.nbytes if nbytes is None else nbytes)
            inst_buf.append(buf)
            persistent.append(b.kind is BufferKind.OUTPUT and tag == ORIGINAL)
        return inst_ids[key]

    act_of_buffer = {act.buffer: a for a, act in enumerate(acts)}

    def view(buf: int, chain_of: int | None) -> int | None:
        """The instance a backward reader sees for ``buf``; None for resident storage."""
        if graph.buffers[buf].kind is BufferKind.RESIDENT:
            return None
        if chain_of is not None and buf in chain_allocs[chain_of]:
            return inst(buf, ("re", chain_of))
        a = act_of_buffer.get(buf)
        if a is None or decisions[a] is Decision.KEEP:
            return inst(buf, ORIGINAL)
        if decisions[a] is Decision.SWAP:
            return inst(buf, ("in", a), acts[a].transfer_bytes)
        return inst(buf, ("re", a))

    def reads_of(op_id: int, chain_of: int | None = None, backward: bool = True) -> tuple[int, ...]:
        out: dict[int, None] = {}
        op = graph.ops[op_id]
        for x in (op.recompute_args if chain_of is not None else op.args):
            for buf in graph.buffer_of[x]:
                i = view(buf, chain_of) if backward else (
                    None if graph.buffers[buf].kind is BufferKind.RESIDENT else inst(buf, ORIGINAL))
                if i is not None:
                    out[i] = None
        return tuple(out)

    def allocs_of(op_id: int, tag: object = ORIGINAL) -> tuple[int, ...]:
        return tuple(inst(b, tag) for b in graph.dynamic_allocs[op_id])

    tangent_graph = graph.buffer_graph
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

    for op_id, op in enumerate(graph.ops):
        if op.phase is Phase.FORWARD:
            instrs.append(Instr(Kind.RUN, op=op_id, allocs=allocs_of(op_id), reads=reads_of(op_id, backward=False)))
            for a in offload_after.get(op_id, ()):
                instrs.append(Instr(Kind.OFFLOAD, act=a, reads=(inst(acts[a].buffer, ORIGINAL),)))
            continue
        for a in prefetch_at.get(op_id, ()):
            instrs.append(Instr(Kind.PREFETCH, act=a, allocs=(view(acts[a].buffer, None),)))
        for a in wait_at.get(op_id, ()):
            instrs.append(Instr(Kind.WAIT, act=a))
        for b in recompute_at.get(op_id, ()):
            for o in chains[b]:
                instrs.append(Instr(Kind.RECOMPUTE, op=o, act=b, allocs=allocs_of(o, ("re", b)),
                                    reads=reads_of(o, chain_of=b)))
        instrs.append(Instr(Kind.RUN, op=op_id, allocs=allocs_of(op_id), reads=reads_of(op_id)))

    last = [-1] * len(inst_bytes)
    graph_end: dict[int, int] = {}  # backward graph -> its last instruction
    for i, ins in enumerate(instrs):
        for x in ins.allocs:
            if last[x] < 0:
                last[x] = i
        for x in ins.reads:
            last[x] = i
        if ins.kind is Kind.RUN and graph.ops[ins.op].phase is Phase.BACKWARD:
            graph_end[graph.ops[ins.op].graph] = i
    for x, buf in enumerate(inst_buf):
        # autograd holds the incoming gradients for the whole backward call
        if graph.buffers[buf].kind is BufferKind.TANGENT:
            last[x] = graph_end[tangent_graph[buf]]
    return Schedule(
        decisions=decisions, prefetch_before=tuple(prefetch), instrs=tuple(instrs),
        instance_bytes=tuple(inst_bytes), instance_buffer=tuple(inst_buf), persistent=tuple(persistent),
        last_reader=tuple(last), chains=chains, first_use=first_use,
    )
