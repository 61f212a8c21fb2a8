"""Stage 4, simulate: a schedule + costs -> the timeline of three streams and memory over time.

Compute runs the RUN / RECOMPUTE / WAIT instructions in order. OFFLOAD copies queue on the
D2H stream once their producer has run; PREFETCH copies queue on the H2D stream once the
host copy exists, and allocate their device buffer when issued. A buffer is freed when its
last reader finishes; for an offloaded activation that includes its D2H copy (the runtime's
``record_stream``), so a slow link holds memory longer.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .graph import StepGraph
from .schedule import Kind, Schedule


@dataclass(frozen=True)
class Costs:
    """Seconds per op and per activation transfer, aligned with a StepGraph's ids."""

    op_time: tuple[float, ...]
    d2h_time: tuple[float, ...]
    h2d_time: tuple[float, ...]


@dataclass(frozen=True)
class Event:
    lane: str  # "compute", "d2h", "h2d"
    name: str
    start: float
    end: float
    kind: Kind


@dataclass(frozen=True)
class Timeline:
    step_time: float
    peak_bytes: int  # device bytes at the timed peak, resident included
    static_peak_bytes: int  # the same with copies taken as instantaneous (program order only)
    forward_end: float  # when the last forward op finishes on the compute stream
    d2h_end: dict[int, float]  # activation -> its offload's end
    h2d_end: dict[int, float]
    stall: dict[int, float]  # activation -> seconds compute waited for its prefetch
    memory: tuple[tuple[float, int], ...]  # (time, bytes) after each change, resident included
    start: tuple[float, ...]  # per instruction
    end: tuple[float, ...]


def simulate(graph: StepGraph, schedule: Schedule, costs: Costs, mem_limit: int | None = None) -> Timeline:
    """With ``mem_limit``, an allocation that would exceed it waits for pending frees (offloads
    still copying), as the caching allocator does before it reports out of memory."""
    n_inst = len(schedule.instance_bytes)
    new_bytes = [0] * len(schedule.instrs)  # device bytes each instruction allocates
    frees_after: list[list[int]] = [[] for _ in schedule.instrs]  # instances whose last reader it is
    first_alloc = [-1] * n_inst
    for i, ins in enumerate(schedule.instrs):
        for x in ins.allocs:
            if first_alloc[x] < 0:
                first_alloc[x] = i
                new_bytes[i] += schedule.instance_bytes[x]
    for x, last in enumerate(schedule.last_reader):
        if first_alloc[x] >= 0 and not schedule.persistent[x] and schedule.instance_bytes[x]:
            frees_after[last].append(x)
    pending: list[tuple[float, int]] = []  # heap of (free time, bytes)
    live = graph.resident_bytes
    waited_for_memory = 0.0
    start, end, issue = [], [], []
    t = d2h = h2d = 0.0
    forward_end = 0.0
    d2h_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    stall: dict[int, float] = {}
    freed_at = [0.0] * n_inst
    ops = graph.ops
    for i, ins in enumerate(schedule.instrs):
        kind = ins.kind
        need = new_bytes[i]
        if need and kind is not Kind.OFFLOAD:
            while pending and pending[0][0] <= t:
                live -= heapq.heappop(pending)[1]
            while mem_limit is not None and live + need > mem_limit and pending:
                when, nbytes = heapq.heappop(pending)  # wait for the next copy to release memory
                if when > t:
                    waited_for_memory += when - t
                    t = when
                live -= nbytes
            live += need
        if kind is Kind.RUN or kind is Kind.RECOMPUTE:
            s = t
            t = e = t + costs.op_time[ins.op]
            if kind is Kind.RUN and ops[ins.op].phase.value == "forward":
                forward_end = t
            issued = s
        elif kind is Kind.OFFLOAD:
            s = max(d2h, t)
            d2h = e = s + costs.d2h_time[ins.act]
            d2h_end[ins.act] = e
            issued = t
        elif kind is Kind.PREFETCH:
            s = max(h2d, t, d2h_end.get(ins.act, 0.0))
            h2d = e = s + costs.h2d_time[ins.act]
            h2d_end[ins.act] = e
            issued = t
        else:  # WAIT
            s = t
            ready = h2d_end.get(ins.act, t)
            if ready > t:
                stall[ins.act] = ready - t
                t = ready
            e = t
            issued = s
        start.append(s)
        end.append(e)
        issue.append(issued)
        for x in ins.reads:
            if e > freed_at[x]:
                freed_at[x] = e
        for x in frees_after[i]:
            heapq.heappush(pending, (max(freed_at[x], e), schedule.instance_bytes[x]))

    # memory events: (time, order, delta); order puts an instruction's allocs before its frees
    timed: list[tuple[float, float, int]] = []
    static: list[tuple[float, int]] = []
    alloc_at = [-1] * n_inst
    for i, ins in enumerate(schedule.instrs):
        for x in ins.allocs:
            if alloc_at[x] < 0:
                alloc_at[x] = i
    for x, nbytes in enumerate(schedule.instance_bytes):
        a = alloc_at[x]
        if a < 0 or nbytes == 0:
            continue
        timed.append((issue[a], a, nbytes))
        static.append((a, nbytes))
        if not schedule.persistent[x]:
            last = schedule.last_reader[x]
            timed.append((max(freed_at[x], end[last]), last + 0.5, -nbytes))
            static.append((last + 0.5, -nbytes))
    timed.sort()
    static.sort()
    base = graph.resident_bytes
    cur = peak = base
    memory = []
    for when, _, delta in timed:
        cur += delta
        memory.append((when, cur))
        peak = max(peak, cur)
    cur = static_peak = base
    for _, delta in static:
        cur += delta
        static_peak = max(static_peak, cur)
    step_time = max(t, d2h, h2d)
    return Timeline(step_time, peak, static_peak, forward_end, d2h_end, h2d_end, stall,
                    tuple(memory), tuple(start), tuple(end))


def static_memory(schedule: Schedule) -> list[int]:
    """Device bytes live during each instruction (resident excluded), copies instantaneous."""
    n = len(schedule.instrs)
    delta = [0] * (n + 1)
    alloc_at = [-1] * len(schedule.instance_bytes)
    for i, ins in enumerate(schedule.instrs):
        for x in ins.allocs:
            if alloc_at[x] < 0:
                alloc_at[x] = i
    for x, nbytes in enumerate(schedule.instance_bytes):
        a = alloc_at[x]
        if a < 0 or nbytes == 0:
            continue
        delta[a] += nbytes
        if not schedule.persistent[x]:
            delta[schedule.last_reader[x] + 1] -= nbytes
    out, cur = [], 0
    for i in range(n):
        cur += delta[i]
        out.append(cur)
    return out
