"""The result a user inspects: decisions, predicted peak and time, a table and per-activation reasons.

``print(plan)`` shows one row per activation (shape, bytes, decision and the numbers behind it:
stall, late offload, swap / recompute overhead and PoocH's r(X)) then the totals;
``plan.explain(name)`` answers for one activation. The overheads are what-if simulations (one
decision changed, the others fixed) made lazily, only for these displays.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import cached_property

from tabulate import tabulate

from .errors import UnknownName
from .graph import NodeTable, StepGraph
from .planners.common import Evaluator, Problem
from .profile import Profile
from .schedule import Decision, Kind, NotRecomputable, Schedule, build_schedule, recompute_chain
from .simulator import Timeline, simulate
from .units import format_bytes

log = logging.getLogger("fxpooch.plan")

#: above this many activations the table leaves out the what-if overhead columns (2 simulations each)
MAX_OVERHEAD_ACTIVATIONS = 300

#: (shape, dtype name) of an activation's first saved value
ActivationMeta = tuple[tuple[int, ...], str]


def activation_names(graph: StepGraph) -> list[str]:
    """User-facing activation names: the node name, prefixed by its graph when there are several."""
    several = len(graph.forward_range) > 1
    return [f"g{a.graph}.{a.name}" if several else a.name for a in graph.activations]


def activation_meta(graph: StepGraph, table: NodeTable) -> tuple[ActivationMeta, ...]:
    """Shape and dtype of each activation's first member (for :attr:`Plan.activation_meta`)."""
    out = []
    for act in graph.activations:
        val = table.nodes[act.members[0]].meta.get("val")
        if isinstance(val, (tuple, list)):
            val = next((v for v in val if hasattr(v, "shape")), None)
        if val is None or not hasattr(val, "shape"):
            out.append(((), "?"))
            continue
        try:
            shape = tuple(int(s) for s in val.shape)
        except TypeError:  # symbolic sizes
            shape = ()
        out.append((shape, str(val.dtype).removeprefix("torch.")))
    return tuple(out)


@dataclass(frozen=True)
class WhatIf:
    """The simulated step with one activation's decision changed, the others fixed."""

    step_time: float
    peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class Overheads:
    """What keeping, swapping and recomputing one activation would give (None: impossible)."""

    keep: WhatIf
    swap: WhatIf | None
    recompute: WhatIf | None
    why_not_swap: str = ""
    why_not_recompute: str = ""

    def of(self, decision: str) -> WhatIf | None:
        return {"keep": self.keep, "swap": self.swap, "recompute": self.recompute}[decision]

    @property
    def swap_overhead(self) -> float | None:
        """Step time added by swapping instead of keeping."""
        return None if self.swap is None else self.swap.step_time - self.keep.step_time

    @property
    def recompute_overhead(self) -> float | None:
        return None if self.recompute is None else self.recompute.step_time - self.keep.step_time

    @property
    def r(self) -> float | None:
        """PoocH's r(X) = recompute_overhead / swap_overhead (< 1: recomputing is cheaper)."""
        s, c = self.swap_overhead, self.recompute_overhead
        if s is None or c is None:
            return None
        if s <= 0:
            return math.inf if c > 0 else math.nan
        return c / s


def _op_label(target: str) -> str:
    """``aten.convolution.default`` -> ``convolution``."""
    label = target.removeprefix("aten.").removesuffix(".default")
    return label if len(label) <= 30 else label[:28] + ".."


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
    #: per activation (graph order): (shape, dtype name); empty when unknown (rendered "?")
    activation_meta: tuple[ActivationMeta, ...] = field(default=(), repr=False)
    #: device bytes kept free under ``mem_limit`` for the allocator's fragmentation (planned against the rest)
    margin_bytes: int = 0

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
        """activation, op, bytes, decision: the short table."""
        rows = []
        names = activation_names(self.graph)
        for name, act, d in zip(names, self.graph.activations, self.schedule.decisions, strict=True):
            op = self.graph.ops[act.producer]
            rows.append([name, op.target, format_bytes(self.graph.buffers[act.buffer].nbytes), d.value])
        return rows

    # -- re-simulation (lazy: only for the displays) -------------------------------------------
    @cached_property
    def _evaluator(self) -> Evaluator:
        return Evaluator(Problem(self.graph, self.profile.costs(self.graph), self.mem_limit - self.margin_bytes))

    @cached_property
    def _overheads(self) -> dict[int, Overheads]:
        return {}

    def in_core_timeline(self) -> Timeline:
        """The all-keep schedule simulated with this plan's costs (the in-core reference)."""
        return self._in_core

    @cached_property
    def _in_core(self) -> Timeline:
        keep = [Decision.KEEP] * len(self.graph.activations)
        return simulate(self.graph, build_schedule(self.graph, keep), self._evaluator.problem.costs)

    def overheads(self, index: int) -> Overheads:
        """Keep / swap / recompute what-ifs for activation ``index`` (others as planned)."""
        if index not in self._overheads:
            self._overheads[index] = self._compute_overheads(index)
        return self._overheads[index]

    def _compute_overheads(self, a: int) -> Overheads:
        ev = self._evaluator
        act = self.graph.activations[a]
        results: dict[Decision, WhatIf | None] = {}
        why_not_swap = "" if act.swappable else "not a dense tensor, cannot be copied as is"
        why_not_recompute = ""
        for d in Decision:
            if d is Decision.SWAP and not act.swappable:
                results[d] = None
                continue
            trial = list(self.schedule.decisions)
            trial[a] = d
            if d is Decision.RECOMPUTE:
                try:
                    recompute_chain(self.graph, a, trial)
                except NotRecomputable as e:
                    why_not_recompute = str(e).split(": ", 1)[-1]
            c = ev.evaluate(trial)
            results[d] = None if c is None else WhatIf(c.step_time, c.timeline.peak_bytes, c.fits)
            if c is None and d is Decision.RECOMPUTE and not why_not_recompute:
                why_not_recompute = "another recompute chain cannot be built then"
        keep = results[Decision.KEEP]
        assert keep is not None  # keeping is always possible
        return Overheads(keep, results[Decision.SWAP], results[Decision.RECOMPUTE], why_not_swap,
                         why_not_recompute)

    def _index(self, name: str) -> int:
        names = activation_names(self.graph)
        if name in names:
            return names.index(name)
        bare = [i for i, act in enumerate(self.graph.activations) if act.name == name]
        if len(bare) == 1:
            return bare[0]
        raise UnknownName("activation", name, names)

    # -- display -------------------------------------------------------------------------------
    def _meta(self, a: int) -> tuple[str, str]:
        if len(self.activation_meta) != len(self.graph.activations):
            return "?", "?"
        shape, dtype = self.activation_meta[a]
        return "(" + ", ".join(map(str, shape)) + ")", dtype

    def _time_unit(self) -> tuple[str, float]:
        return ("ms", 1e3) if max(self.step_time, self.in_core_time) >= 10e-3 else ("us", 1e6)

    def _fmt_time(self, seconds: float | None, signed: bool = False) -> str:
        if seconds is None:
            return "-"
        unit, scale = self._time_unit()
        v = seconds * scale
        if abs(v) < 5e-4:
            return "0"
        return f"{v:+.3f}" if signed else f"{v:.3f}"

    def _late_offload(self, a: int) -> float:
        """Seconds by which activation ``a``'s offload outlasts the forward (0 if hidden)."""
        end = self.timeline.d2h_end.get(a)
        return 0.0 if end is None else max(0.0, end - self.timeline.forward_end)

    def table_rows(self, overheads: bool | None = None) -> tuple[list[str], list[list[str]]]:
        """Headers and rows of the full table; ``overheads`` None: only up to MAX_OVERHEAD_ACTIVATIONS."""
        n = len(self.graph.activations)
        with_over = n <= MAX_OVERHEAD_ACTIVATIONS if overheads is None else overheads
        unit, _ = self._time_unit()
        headers = ["graph", "activation", "op", "shape", "dtype", "bytes", "decision",
                   f"stall {unit}", f"late d2h {unit}"]
        if with_over:
            headers += [f"swap +{unit}", f"recompute +{unit}", "r(X)"]
            if n > 50 and len(self._overheads) < n:
                log.info("what-if simulations for %d activations (2 each) for the plan table", n)
        rows = []
        names = activation_names(self.graph)
        for a, (name, act, d) in enumerate(zip(names, self.graph.activations, self.schedule.decisions)):
            shape, dtype = self._meta(a)
            swapped = d is Decision.SWAP
            row = [str(act.graph), name, _op_label(self.graph.ops[act.producer].target), shape, dtype,
                   format_bytes(self.graph.buffers[act.buffer].nbytes), d.value,
                   self._fmt_time(self.timeline.stall.get(a, 0.0)) if swapped else "-",
                   self._fmt_time(self._late_offload(a)) if swapped else "-"]
            if with_over:
                o = self.overheads(a)
                r = o.r
                row += [self._fmt_time(o.swap_overhead, signed=True),
                        self._fmt_time(o.recompute_overhead, signed=True),
                        "-" if r is None or math.isnan(r) else ("inf" if math.isinf(r) else f"{r:.2f}")]
            rows.append(row)
        return headers, rows

    def summary_rows(self) -> list[list[str]]:
        """The totals under the table: limit, peaks, host bytes, counts, step time."""
        c = self.counts()
        slowdown = self.step_time / self.in_core_time if self.in_core_time else float("nan")
        unit, scale = self._time_unit()
        pct = 100 * self.peak_bytes / self.in_core_peak_bytes if self.in_core_peak_bytes else float("nan")
        return [
            ["planner", self.planner],
            ["memory limit", format_bytes(self.mem_limit)],
            ["allocator margin", f"{format_bytes(self.margin_bytes)} (planned under "
                                 f"{format_bytes(self.mem_limit - self.margin_bytes)})"],
            ["planned peak", f"{format_bytes(self.peak_bytes)} ({pct:.0f}% of in-core)"],
            ["in-core peak", format_bytes(self.in_core_peak_bytes)],
            ["resident (params, inputs)", format_bytes(self.graph.resident_bytes)],
            ["host bytes (swapped)", format_bytes(self.host_bytes)],
            ["keep / swap / recompute", f"{c['keep']} / {c['swap']} / {c['recompute']}"],
            ["step time (simulated)", f"{self.step_time * scale:.3f} {unit} ({slowdown:.2f}x in-core)"],
            ["in-core step time", f"{self.in_core_time * scale:.3f} {unit}"],
            ["profile", self.profile.source],
        ]

    def __str__(self) -> str:
        return self.table()

    def table(self, overheads: bool | None = None) -> str:
        """The activation table and the totals; ``overheads`` as in :meth:`table_rows`."""
        headers, rows = self.table_rows(overheads)
        table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
        unit, _ = self._time_unit()
        notes = [f"stall: compute waited for the prefetch; late d2h: offload ran past the forward's end ({unit})."]
        if len(headers) > 9:
            notes.append("swap + / recompute +: simulated step time vs keeping it, the others as planned (negative: "
                         "keeping it leaves less room to prefetch the others early); r(X) = recompute + / swap + "
                         "(< 1: recomputing is cheaper).")
        elif overheads is None:
            notes.append(f"overhead columns left out: {len(rows)} activations > {MAX_OVERHEAD_ACTIVATIONS} "
                         "(each needs 2 simulations); plan.explain(name) gives them for one activation.")
        else:
            notes.append("overhead columns left out; plan.explain(name) gives them for one activation.")
        summary = tabulate(self.summary_rows(), tablefmt="plain")
        return f"{table}\n" + "\n".join(notes) + f"\n\n{summary}"

    def explain(self, name: str) -> str:
        """Why activation ``name`` (a key of :attr:`decisions`) got its decision, in numbers."""
        a = self._index(name)
        return _explain(self, a)


def _explain(plan: Plan, a: int) -> str:
    graph, sched, tl = plan.graph, plan.schedule, plan.timeline
    act = graph.activations[a]
    d = sched.decisions[a]
    o = plan.overheads(a)
    t = plan._fmt_time
    unit, _ = plan._time_unit()
    shape, dtype = plan._meta(a)
    name = activation_names(graph)[a]
    nbytes = graph.buffers[act.buffer].nbytes
    run_at = {ins.op: i for i, ins in enumerate(sched.instrs) if ins.kind is Kind.RUN}
    produced = tl.end[run_at[act.producer]]
    readers = graph.backward_readers(act)
    first = sched.first_use.get(a, readers[0] if readers else None)
    lines = [f"{name} (graph {act.graph}): {d.value}",
             f"  {format_bytes(nbytes)} on the device, shape {shape} {dtype}, made by "
             f"{graph.ops[act.producer].target} (node {graph.ops[act.producer].name})"]
    if first is None:
        lines.append(f"  produced at {t(produced)} {unit}; no backward op reads it")
    else:
        gap = tl.start[run_at[first]] - produced
        lines.append(f"  produced at {t(produced)} {unit}, first used at {t(tl.start[run_at[first]])} {unit} "
                     f"by {graph.ops[first].name} ({gap / max(plan.step_time, 1e-30):.0%} of the step later)")
    if d is Decision.SWAP:
        stall, late = tl.stall.get(a, 0.0), plan._late_offload(a)
        hidden = "hidden" if stall == 0 and late == 0 else "not hidden"
        lines.append(f"  swap is {hidden}: stall {t(stall)} {unit}, offload past forward end {t(late)} {unit}, "
                     f"{format_bytes(act.transfer_bytes)} each way")
    elif d is Decision.RECOMPUTE:
        chain = sched.chains.get(a, ())
        lines.append(f"  recompute runs {len(chain)} forward op(s) again: "
                     + ", ".join(graph.ops[i].name for i in chain[:8]) + (" ..." if len(chain) > 8 else ""))
    for choice, label in (("keep", "kept"), ("swap", "swapped"), ("recompute", "recomputed")):
        w = o.of(choice)
        mark = "   <- planned" if choice == d.value else ""
        if w is None:
            why = o.why_not_swap if choice == "swap" else o.why_not_recompute
            lines.append(f"  if {label + ':':12} impossible ({why}){mark}")
        else:
            fit = "fits" if w.fits else "over the limit"
            delta = "reference" if choice == "keep" else t(w.step_time - o.keep.step_time, signed=True)
            lines.append(f"  if {label + ':':12} step {t(w.step_time)} {unit} ({delta}), "
                         f"peak {format_bytes(w.peak_bytes)} ({fit}){mark}")
    r = o.r
    if r is not None and not math.isnan(r):
        lines.append(f"  r(X) = recompute overhead / swap overhead = {'inf' if math.isinf(r) else f'{r:.2f}'}")
    lines.append("  why: " + _why(plan, d, o))
    return "\n".join(lines)


def _saving(plan: Plan, chosen: WhatIf | None, keep: WhatIf) -> str:
    unit, _ = plan._time_unit()
    saved = 0.0 if chosen is None else chosen.step_time - keep.step_time
    if plan._fmt_time(saved) == "0":
        return "at the same step time (the planner frees memory it could keep when that is free)"
    if saved < 0:
        return f"but {plan._fmt_time(-saved)} {unit} slower"
    return f"{plan._fmt_time(saved)} {unit} faster: planner {plan.planner!r} chose otherwise"


def _why(plan: Plan, d: Decision, o: Overheads) -> str:
    """One sentence from the what-if numbers."""
    t = plan._fmt_time
    unit, _ = plan._time_unit()
    limit = format_bytes(plan.mem_limit)

    def cost(w: WhatIf | None, what: str, why_not: str) -> str:
        if w is None:
            return f"it cannot be {what} ({why_not})"
        extra = w.step_time - o.keep.step_time
        fit = "" if w.fits else f", and the peak would be {format_bytes(w.peak_bytes)} > limit"
        if extra < 0:
            return f"{what} it would take {t(-extra)} {unit} less than keeping it{fit}"
        return f"{what} it would add {t(extra)} {unit}{fit}"

    swap_txt = cost(o.swap, "swapped" if o.swap is None else "swapping", o.why_not_swap)
    rec_txt = cost(o.recompute, "recomputed" if o.recompute is None else "recomputing", o.why_not_recompute)
    if d is Decision.KEEP:
        if o.keep.fits:
            return (f"kept: {swap_txt}; {rec_txt}; memory allowed keeping it "
                    f"(peak {format_bytes(o.keep.peak_bytes)} <= limit {limit}).")
        return f"kept although the plan is over the limit ({format_bytes(o.keep.peak_bytes)} > {limit}); {swap_txt}."
    keep_txt = (f"keeping it would raise the peak to {format_bytes(o.keep.peak_bytes)} > limit {limit}"
                if not o.keep.fits else
                f"keeping it would also fit (peak {format_bytes(o.keep.peak_bytes)}), "
                + _saving(plan, o.of(d.value), o.keep))
    r = o.r
    r_txt = "" if r is None or math.isnan(r) else f" (r(X) = {'inf' if math.isinf(r) else f'{r:.2f}'})"
    chosen, other = (o.swap, o.recompute) if d is Decision.SWAP else (o.recompute, o.swap)
    if other is not None and other.fits and chosen is not None and other.step_time < chosen.step_time:
        verdict = f"the other way would be cheaper, but planner {plan.planner!r} chose this one"
    else:
        verdict = f"so {'swapping' if d is Decision.SWAP else 'recomputing'} is the cheaper way to free it"
    if d is Decision.SWAP:
        return f"swapped: {keep_txt}; {rec_txt}{r_txt}: {verdict}."
    return f"recomputed: {keep_txt}; {swap_txt}{r_txt}: {verdict}."

