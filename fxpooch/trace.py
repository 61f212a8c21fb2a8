"""A plan's simulated timeline as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

One process, three lanes (threads): ``compute`` (forward and backward ops, recomputations and
waits for prefetches), ``D2H`` (offloads) and ``H2D`` (prefetches), as complete ("X") events;
device memory over time and the memory limit as counter ("C") tracks. Times are microseconds.
"""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from .graph import Phase
from .schedule import Kind
from .units import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

log = logging.getLogger("fxpooch.trace")

PID = 1
#: lane -> (tid, label): the timeline's lanes
LANES = {"compute": (1, "compute"), "d2h": (2, "D2H (offload)"), "h2d": (3, "H2D (prefetch)")}
MEMORY_COUNTER = "device memory"
LIMIT_COUNTER = "memory limit"
US = 1e6  # microseconds per second


def _meta_events(plan: Plan) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
         "args": {"name": f"fxpooch plan ({plan.planner}, limit {format_bytes(plan.mem_limit)})"}},
    ]
    for tid, label in LANES.values():
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": label}})
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return events


def _instruction_events(plan: Plan) -> list[dict[str, Any]]:
    """One X event per instruction that takes time on its stream."""
    graph, sched, tl = plan.graph, plan.schedule, plan.timeline
    acts = graph.activations
    # "relu_3 (layer1.0.relu)": the node name with the module that saved it, when known
    names = {a: f"{act.name} ({plan.module_of(a)})" if plan.module_of(a) else act.name for a, act in enumerate(acts)}
    events = []
    for i, ins in enumerate(sched.instrs):
        start, end = tl.start[i], tl.end[i]
        if end <= start:
            continue  # kernel-free ops and waits that did not wait
        args: dict[str, Any] = {}
        if ins.kind is Kind.RUN:
            op = graph.ops[ins.op]
            lane, name = "compute", op.name
            cat = "forward" if op.phase is Phase.FORWARD else "backward"
            args = {"target": op.target, "graph": op.graph}
        elif ins.kind is Kind.RECOMPUTE:
            op = graph.ops[ins.op]
            lane, name, cat = "compute", f"recompute {op.name}", "recompute"
            args = {"target": op.target, "for": names[ins.act]}
        elif ins.kind is Kind.WAIT:
            lane, name, cat = "compute", f"wait {names[ins.act]}", "stall"
            args = {"activation": acts[ins.act].name, "module": plan.module_of(ins.act)}
        else:
            act = acts[ins.act]
            lane = "d2h" if ins.kind is Kind.OFFLOAD else "h2d"
            name, cat = f"{ins.kind.value} {names[ins.act]}", ins.kind.value
            args = {"activation": act.name, "module": plan.module_of(ins.act), "bytes": act.transfer_bytes}
        args["instruction"] = i
        events.append({"ph": "X", "pid": PID, "tid": LANES[lane][0], "name": name, "cat": cat,
                       "ts": start * US, "dur": (end - start) * US, "args": args})
    return events


def _counter_events(plan: Plan) -> list[dict[str, Any]]:
    """Device bytes after each change (resident included), and the limit, as counter tracks."""
    tl = plan.timeline
    events = [{"ph": "C", "pid": PID, "name": MEMORY_COUNTER, "ts": 0.0,
               "args": {"bytes": plan.graph.resident_bytes}}]
    for when, nbytes in tl.memory:
        events.append({"ph": "C", "pid": PID, "name": MEMORY_COUNTER, "ts": when * US, "args": {"bytes": nbytes}})
    for when in (0.0, tl.step_time):
        events.append({"ph": "C", "pid": PID, "name": LIMIT_COUNTER, "ts": when * US,
                       "args": {"bytes": plan.mem_limit}})
    return events


def chrome_trace(plan: Plan) -> dict[str, Any]:
    """The plan's simulated step as a Chrome trace-event JSON object (``{"traceEvents": [...]}``)."""
    events = _meta_events(plan) + _instruction_events(plan) + _counter_events(plan)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "planner": plan.planner, "mem_limit": plan.mem_limit, "peak_bytes": plan.peak_bytes,
            "in_core_peak_bytes": plan.in_core_peak_bytes, "step_time_s": plan.step_time,
            "in_core_time_s": plan.in_core_time, "profile": plan.profile.source,
            "decisions": plan.counts(),
        },
    }


def write_chrome_trace(plan: Plan, path: str | os.PathLike) -> str:
    """Write :func:`chrome_trace` to ``path`` (JSON) and return the path."""
    trace = chrome_trace(plan)
    with open(path, "w") as f:
        json.dump(trace, f)
    log.info("wrote %d trace events to %s", len(trace["traceEvents"]), path)
    return os.fspath(path)
