"""Stage 4, simulate: a schedule + costs -> the timeline of three streams and memory over time.

Compute runs the RUN / RECOMPUTE / WAIT instructions in order. OFFLOAD copies queue on the
D2H stream once their producer has run; PREFETCH copies queue on the H2D stream once the
host copy exists, and allocate their device buffer when issued. With
``Costs.serial_copies`` (a CPU host) the compute thread makes each copy itself, in program
order, so copies add to the step instead of overlapping it. A buffer is freed when its
last reader finishes; for an offloaded activation that includes its D2H copy (the runtime's
``record_stream``), so a slow link holds memory longer.
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

from .graph import StepGraph
from .schedule import Decision, Kind, Schedule, build_schedule
from .types import ActivationId, Costs, OpId


@dataclass(frozen=True)
class Timeline:
    step_time: float
    peak_bytes: int  # device bytes at the timed peak, resident included
    static_peak_bytes: int  # the same with copies taken as instantaneous (program order only)
    forward_end: float  # when the last forward op finishes on the compute stream
    d2h_end: dict[int, float]  # activation -> its offload's end
    h2d_end: dict[int, float]
    stall: dict[int, float]  # activation -> seconds compute waited for its prefetch
    start: tuple[float, ...]  # per instruction
    end: tuple[float, ...]
    resident_bytes: int
    #: the device memory's changes (time, order, bytes), as made: order sorts those at one time
    #: (an instruction's allocations, then its op's scratch freed, then its frees)
    events: list[tuple[float, float, int]]

    @functools.cached_property
    def memory(self) -> tuple[tuple[float, int], ...]:
        """(time, bytes) after each change, resident included."""
        cur, memory = self.resident_bytes, []
        for when, _, delta in sorted(self.events):
            cur += delta
            memory.append((when, cur))
        return tuple(memory)


def simulate(graph: StepGraph, schedule: Schedule, costs: Costs, mem_limit: int | None = None) -> Timeline:
    """With ``mem_limit``, an allocation that would exceed it waits for pending frees (offloads
    still copying), as the caching allocator does before it reports out of memory."""
    instrs = schedule.instrs
    n = len(instrs)
    inst_bytes = schedule.instance_bytes
    new_bytes, freed_at, frees_after = _frees(graph, schedule)
    # the forward's instructions come first: its ops, each followed by its offloads
    forward_last = sum(stop - start for start, stop in graph.forward_range) - 1 + sum(
        d is Decision.SWAP for d in schedule.decisions)
    while forward_last >= 0 and instrs[forward_last].kind is not Kind.RUN:
        forward_last -= 1
    RUN, RECOMPUTE, OFFLOAD, PREFETCH = Kind.RUN, Kind.RECOMPUTE, Kind.OFFLOAD, Kind.PREFETCH
    scratch = schedule.instr_scratch  # held from an op's start to its end, on top of what it allocates
    op_time, d2h_time, h2d_time, serial = costs.op_time, costs.d2h_time, costs.h2d_time, costs.serial_copies
    pending: list[tuple[float, int]] = []  # heap of (free time, bytes) of frees still ahead
    live = peak = graph.resident_bytes
    start, end = [0.0] * n, [0.0] * n
    # memory events (time, order, delta); order puts an instruction's allocs before its frees
    timed: list[tuple[float, float, int]] = []
    event = timed.append
    t = d2h = h2d = 0.0
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    copied_until: dict[int, float] = {}  # offloaded instance -> its D2H end (it is read until then)
    stall: dict[int, float] = {}
    for i, instr in enumerate(instrs):
        kind = instr[0]
        need = new_bytes[i]
        extra = scratch[i] if scratch else 0
        if need or extra:
            if kind is not OFFLOAD:
                while pending and pending[0][0] <= t:
                    live -= heapq.heappop(pending)[1]
                while mem_limit is not None and live + need + extra > mem_limit and pending:
                    when, nbytes = heapq.heappop(pending)  # wait for the next copy to release memory
                    if when > t:
                        t = when
                    live -= nbytes
                    while pending and pending[0][0] <= t:  # others at that time (before it in time order)
                        live -= heapq.heappop(pending)[1]
                live += need
                if live + extra > peak:  # every change before this one in time order is counted
                    peak = live + extra
            event((t, i, need + extra))
        if kind is RUN or kind is RECOMPUTE:
            s = t
            t = e = t + op_time[instr[1]]
            if extra:
                event((e, i + 0.25, -extra))  # before the frees of its inputs (i + 0.5)
        elif kind is OFFLOAD:
            act = instr[2]
            s = d2h if d2h > t else t
            d2h = e = s + d2h_time[act]
            d2h_end[act] = copied_until[instr[4][0]] = e
            if serial:
                t = e
        elif kind is PREFETCH:
            act = instr[2]
            s = max(h2d, t, d2h_end.get(act, 0.0))
            h2d = e = s + h2d_time[act]
            h2d_end[act] = e
            if serial:
                t = e
        else:  # WAIT
            act = instr[2]
            s = t
            ready = h2d_end.get(act, t)
            if ready > t:
                stall[act] = ready - t
                t = ready
            e = t
        start[i] = s
        end[i] = e
        # compute-stream times never decrease, so an instance is free once its last reader ends,
        # or its offload does if that is later; frees not after the compute stream's time are
        # taken at once (every later allocation happens no earlier)
        freed_now = freed_at[i]
        frees = frees_after.get(i)
        if frees is None:
            if freed_now:
                live -= freed_now
                event((t, i + 0.5, -freed_now))
            continue
        for x in frees:
            when = copied_until.get(x, 0.0) if copied_until else 0.0
            if when < e:
                when = e
            if when == t:
                freed_now += inst_bytes[x]
                continue
            if when < t:
                live -= inst_bytes[x]
            else:
                heapq.heappush(pending, (when, inst_bytes[x]))
            event((when, i + 0.5, -inst_bytes[x]))
        if freed_now:
            live -= freed_now
            event((t, i + 0.5, -freed_now))
    static = static_memory(schedule)
    static_peak = graph.resident_bytes + max(int(static.max()) if len(static) else 0, 0)
    forward_end = end[forward_last] if forward_last >= 0 else 0.0
    return Timeline(max(t, d2h, h2d), peak, static_peak, forward_end, d2h_end, h2d_end, stall,
                    tuple(start), tuple(end), graph.resident_bytes, timed)


def _frees(graph: StepGraph, schedule: Schedule) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """Per instruction: the device bytes it allocates, and the bytes of the instances it reads
    last that are free when it ends (on the compute stream: a run's or a recompute's); per
    instruction, the instances it reads last that may be free later, in order: an offloaded
    activation's (its copy may still run), or one no instruction reads (its last reader is its
    allocator, a prefetch perhaps, which ends on its own stream)."""
    n = len(schedule.instrs)
    nbytes, alloc, last, live, freed = schedule.instance_columns
    later = alloc == last
    offloaded = [graph.activations[a].buffer for a, d in enumerate(schedule.decisions) if d is Decision.SWAP]
    later[offloaded] = True
    later &= freed
    now = freed & ~later
    # float sums of integers below 2**53: exact
    new_bytes = np.bincount(alloc[live], nbytes[live], minlength=n).astype(np.int64).tolist()
    freed_at = np.bincount(last[now], nbytes[now], minlength=n).astype(np.int64).tolist()
    frees_after: dict[int, list[int]] = {}
    xs = np.flatnonzero(later)
    for x, r in zip(xs.tolist(), last[xs].tolist()):
        frees_after.setdefault(r, []).append(x)
    return new_bytes, freed_at, frees_after


def release_points(graph: StepGraph, schedule: Schedule, timeline: Timeline) -> dict[ActivationId, OpId]:
    """Swapped activation -> the op of its graph pair (forward or backward) before which its device
    buffer is released in stream order (the compute stream waits for the offload's copy, then the
    buffer is free to reuse).

    It is the first op after the buffer's last reader that ``timeline`` starts no earlier than the
    copy ends, where the simulated memory has the buffer freed already, so releasing there changes
    no allocation the plan counted, and the wait costs nothing when the copy runs as simulated. An
    activation has none where the first instruction from then on that runs an op or allocates is
    not an op of its pair's graphs (another pair's op, a recomputation, a prefetch: its own
    included); its buffer is freed when the copy ends, as simulated (the runtime's ``record_stream``).

    The forward's last offloads, queued behind the others on one link, often end after it: their
    release is then in the backward, before its first op once they are copied."""
    instrs, start, last_reader = schedule.instrs, timeline.start, schedule.last_reader
    RUN, OFFLOAD, WAIT = Kind.RUN, Kind.OFFLOAD, Kind.WAIT
    points: dict[ActivationId, OpId] = {}
    for j, ins in enumerate(instrs):
        if ins.kind is not OFFLOAD:
            continue
        g = graph.activations[ins.act].graph
        (flo, fhi), (blo, bhi) = graph.forward_range[g], graph.backward_range[g]
        copied = timeline.d2h_end[ins.act]
        for i in range(max(j, last_reader[ins.reads[0]]) + 1, len(instrs)):
            op = instrs[i]
            if op.kind is OFFLOAD or op.kind is WAIT or start[i] < copied:  # no allocation, or before the copy ends
                continue
            if op.kind is RUN and (flo <= op.op < fhi or blo <= op.op < bhi):
                points[ins.act] = op.op
            break
    return points


def static_memory(schedule: Schedule) -> np.ndarray:
    """Device bytes live during each instruction (resident excluded, an op's scratch included),
    copies instantaneous."""
    n = len(schedule.instrs)
    nbytes, alloc, last, live, freed = schedule.instance_columns
    delta = np.bincount(alloc[live], nbytes[live], minlength=n + 1) - np.bincount(
        last[freed] + 1, nbytes[freed], minlength=n + 1)
    mem = np.cumsum(delta[:n]).astype(np.int64)
    if schedule.instr_scratch:  # an op's scratch is live during its own instruction only
        mem += np.asarray(schedule.instr_scratch, dtype=np.int64)
    return mem


def in_core_peak_bytes(graph: StepGraph) -> int:
    """Device bytes of the step with every activation kept (resident included), from the graph alone."""
    keep = build_schedule(graph, [Decision.KEEP] * len(graph.activations))
    zero = tuple(0.0 for _ in graph.ops)
    none = tuple(0.0 for _ in graph.activations)
    return simulate(graph, keep, Costs(zero, none, none)).static_peak_bytes
