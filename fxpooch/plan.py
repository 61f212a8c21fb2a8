"""The result a user inspects: decisions, predicted peak and time, and a table."""
from __future__ import annotations

from dataclasses import dataclass, field

from tabulate import tabulate

from .graph import StepGraph
from .profile import Profile
from .schedule import Decision, Schedule
from .simulator import Timeline
from .units import format_bytes


def activation_names(graph: StepGraph) -> list[str]:
    """User-facing activation names: the node name, prefixed by its graph when there are several."""
    several = len(graph.forward_range) > 1
    return [f"g{a.graph}.{a.name}" if several else a.name for a in graph.activations]


@dataclass(frozen=True)
class Plan:
    planner: str
    mem_limit: int
    peak_bytes: int  # simulated, resident included (what max_memory_allocated would show)
    step_time: float  # simulated seconds of forward + backward
    in_core_time: float
    in_core_peak_bytes: int
    decisions: dict[str, str]  # activation name -> "keep" | "swap" | "recompute"
    graph: StepGraph = field(repr=False)
    schedule: Schedule = field(repr=False)
    timeline: Timeline = field(repr=False)
    profile: Profile = field(repr=False)

    @property
    def static_peak_bytes(self) -> int:
        """The peak with copies taken as instantaneous (what a CPU run measures)."""
        return self.timeline.static_peak_bytes

    @property
    def host_bytes(self) -> int:
        return sum(a.transfer_bytes for a, d in zip(self.graph.activations, self.schedule.decisions)
                   if d is Decision.SWAP)

    def counts(self) -> dict[str, int]:
        out = {d.value: 0 for d in Decision}
        for d in self.decisions.values():
            out[d] += 1
        return out

    def rows(self) -> list[list[object]]:
        rows = []
        names = activation_names(self.graph)
        for name, act, d in zip(names, self.graph.activations, self.schedule.decisions, strict=True):
            op = self.graph.ops[act.producer]
            rows.append([name, op.target, format_bytes(self.graph.buffers[act.buffer].nbytes), d.value])
        return rows

    def __str__(self) -> str:
        table = tabulate(self.rows(), headers=["activation", "op", "bytes", "decision"], tablefmt="simple")
        c = self.counts()
        slowdown = self.step_time / self.in_core_time if self.in_core_time else float("nan")
        summary = tabulate([
            ["planner", self.planner],
            ["memory limit", format_bytes(self.mem_limit)],
            ["planned peak", format_bytes(self.peak_bytes)],
            ["in-core peak", format_bytes(self.in_core_peak_bytes)],
            ["host bytes (swapped)", format_bytes(self.host_bytes)],
            ["keep / swap / recompute", f"{c['keep']} / {c['swap']} / {c['recompute']}"],
            ["step time (simulated)", f"{self.step_time * 1e3:.3f} ms ({slowdown:.2f}x in-core)"],
            ["profile", self.profile.source],
        ], tablefmt="plain")
        return f"{table}\n\n{summary}"
