"""The result a user inspects: decisions, predicted peak and time, a table and per-activation reasons.

``print(plan)`` shows one row per activation (the module that saved it, shape, bytes, decision and
the numbers behind it: stall, late offload, swap / recompute overhead and PoocH's r(X)), small
ones folded into one line, then the totals; ``plan.explain(name)`` answers for one activation or
one module (see :mod:`fxpooch.explain`). The overheads are what-if simulations (one
decision changed, the others fixed) made lazily, only for these displays.
"""
from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from tabulate import tabulate

from .errors import UnknownName
from .graph import NodeTable, StepGraph
from .planners.common import Evaluator, Problem
from .profile import Profile
from .progress import Stage, stage
from .schedule import Decision, NotRecomputable, Schedule, build_schedule, recompute_chain
from .simulator import Timeline, simulate
from .units import format_bytes

log = logging.getLogger("fxpooch.plan")

#: above this many activations the table leaves out the what-if overhead columns (2 simulations each)
MAX_OVERHEAD_ACTIVATIONS = 300
#: the table folds activations smaller than this (and than FOLD_FRACTION of the largest) into one line:
#: normalisation statistics and the like, a few KiB each, which no plan needs to decide about
FOLD_BELOW_BYTES = 64 * 2**10
FOLD_FRACTION = 1 / 100

#: (shape, dtype name) of an activation's first saved value
ActivationMeta = tuple[tuple[int, ...], str]


def activation_names(graph: StepGraph) -> list[str]:
    """User-facing activation names: the node name, prefixed by its graph when there are several."""
    several = len(graph.forward_range) > 1
    return [f"g{a.graph}.{a.name}" if several else a.name for a in graph.activations]


#: dynamo's spellings of a submodule access inside an nn_module_stack path, rewritten to "a.b.0"
_PATH_REWRITES = ((re.compile(r"getattr\(([^()]*), '([^']*)'\)"), r"\1.\2"),
                  (re.compile(r"\._modules\['([^']*)'\]"), r".\1"),
                  (re.compile(r"\[(\d+)\]"), r".\1"),
                  (re.compile(r"\['([^']*)'\]"), r".\1"))
_ROOT = re.compile(r"L\['[^']*'\]")


def module_path(node_meta: dict) -> str:
    """The innermost module of a node's ``nn_module_stack`` as ``model.named_modules()`` names it
    (``layer1.0.bn1``); "" when the node was made by the top-level forward or carries no stack."""
    stack = node_meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = _ROOT.sub("", path)
    for pattern, repl in _PATH_REWRITES:
        while pattern.search(path):
            path = pattern.sub(repl, path)
    return path.lstrip(".")


def module_paths(graph: StepGraph, table: NodeTable) -> tuple[str, ...]:
    """The module whose forward made each activation's storage (for :attr:`Plan.module_paths`): the
    producing op's module, as the table's op column; its saved view's module if the op has no stack."""
    out = []
    for act in graph.activations:
        producer = table.nodes[act.producer].meta
        out.append(module_path(producer if "nn_module_stack" in producer else table.nodes[act.members[0]].meta))
    return tuple(out)


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
        if s <= 0:  # swapping costs nothing: infinitely cheaper, unless recomputing is free too
            return math.inf if c > 0 else math.nan
        return max(c, 0.0) / s  # recomputing faster than keeping is free (0), not a negative ratio


def format_r(r: float | None) -> str:
    """r(X) for display: ``-`` when it means nothing (an overhead impossible, or neither costs anything)."""
    if r is None or math.isnan(r):
        return "-"
    return "inf" if math.isinf(r) else f"{r:.2f}"


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
    #: per activation (graph order): the path of the module that made it ("": the model's own forward); empty
    #: when unknown
    module_paths: tuple[str, ...] = field(default=(), repr=False)

    def module_of(self, index: int) -> str:
        """The path of the module that saved activation ``index`` ("" when unknown or top level)."""
        return self.module_paths[index] if len(self.module_paths) == len(self.graph.activations) else ""

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

    def indices(self, name: str) -> list[int]:
        """Activation indices for ``name``: an activation's name, or a module path (all it saved)."""
        names = activation_names(self.graph)
        if name in names:
            return [names.index(name)]
        bare = [i for i, act in enumerate(self.graph.activations) if act.name == name]
        if len(bare) == 1:
            return bare
        in_module = [i for i in range(len(names)) if self.module_of(i) == name.strip(".")]
        if in_module and name.strip("."):
            return in_module
        raise UnknownName("activation or module", name,
                          names + sorted({m for m in self.module_paths if m}))

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

    def folded(self) -> list[int]:
        """Activations too small to matter (under FOLD_BELOW_BYTES and FOLD_FRACTION of the largest):
        the table shows them as one summary line."""
        sizes = [self.graph.buffers[act.buffer].nbytes for act in self.graph.activations]
        below = min(FOLD_BELOW_BYTES, max(sizes, default=0) * FOLD_FRACTION)
        return [a for a, n in enumerate(sizes) if n < below]

    def _folded_line(self, folded: list[int]) -> str:
        if not folded:
            return ""
        c = Counter(self.schedule.decisions[a].value for a in folded)
        ops = Counter(_op_label(self.graph.ops[self.graph.activations[a].producer].target) for a in folded)
        total = sum(self.graph.buffers[self.graph.activations[a].buffer].nbytes for a in folded)
        largest = max(self.graph.buffers[self.graph.activations[a].buffer].nbytes for a in folded)
        top = ", ".join(f"{op} x{k}" for op, k in ops.most_common(3)) + (", ..." if len(ops) > 3 else "")
        return (f"+ {len(folded)} small activations not listed (each at most {format_bytes(largest)}, "
                f"{format_bytes(total)} in all; {top}): keep {c['keep']} / swap {c['swap']} / "
                f"recompute {c['recompute']}. plan.table(fold=False) or --all-rows lists them.")

    def table_rows(self, overheads: bool | None = None, fold: bool = True) -> tuple[list[str], list[list[str]]]:
        """Headers and rows of the table; ``overheads`` None: only up to MAX_OVERHEAD_ACTIVATIONS rows;
        ``fold``: without the rows of :meth:`folded`."""
        skip = set(self.folded()) if fold else set()
        n = len(self.graph.activations) - len(skip)
        with_over = n <= MAX_OVERHEAD_ACTIVATIONS if overheads is None else overheads
        unit, _ = self._time_unit()
        headers = ["graph", "activation", "module", "op", "shape", "dtype", "bytes", "decision",
                   f"stall {unit}", f"late d2h {unit}"]
        if with_over:
            headers += [f"swap +{unit}", f"recompute +{unit}", "r(X)"]
        with stage("what-if simulations for the table", n if with_over else None, "activation") as progress:
            return headers, self._rows(skip, with_over, progress)

    def _rows(self, skip: set[int], with_over: bool, progress: Stage) -> list[list[str]]:
        rows = []
        names = activation_names(self.graph)
        for a, (name, act, d) in enumerate(zip(names, self.graph.activations, self.schedule.decisions)):
            if a in skip:
                continue
            shape, dtype = self._meta(a)
            swapped = d is Decision.SWAP
            row = [str(act.graph), name, self.module_of(a) or "-", _op_label(self.graph.ops[act.producer].target),
                   shape, dtype, format_bytes(self.graph.buffers[act.buffer].nbytes), d.value,
                   self._fmt_time(self.timeline.stall.get(a, 0.0)) if swapped else "-",
                   self._fmt_time(self._late_offload(a)) if swapped else "-"]
            if with_over:
                o = self.overheads(a)
                row += [self._fmt_time(o.swap_overhead, signed=True),
                        self._fmt_time(o.recompute_overhead, signed=True), format_r(o.r)]
                progress.update()
            rows.append(row)
        return rows

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

    def table(self, overheads: bool | None = None, fold: bool = True) -> str:
        """The activation table and the totals; ``overheads`` and ``fold`` as in :meth:`table_rows`."""
        headers, rows = self.table_rows(overheads, fold)
        table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
        folded = self._folded_line(self.folded()) if fold else ""
        unit, _ = self._time_unit()
        notes = [f"module: the module that made it (its model.named_modules() path; - the model's own forward). "
                 f"stall: compute waited for the "
                 f"prefetch; late d2h: offload ran past the forward's end ({unit})."]
        if "r(X)" in headers:
            notes.append("swap + / recompute +: simulated step time vs keeping it, the others as planned (negative: "
                         "keeping it leaves less room to prefetch the others early); r(X) = recompute + / swap + "
                         "(< 1: recomputing is cheaper; 0: recomputing costs nothing; inf: swapping costs nothing; "
                         "-: neither costs anything, or one is impossible).")
        elif overheads is None:
            notes.append(f"overhead columns left out: {len(rows)} activations > {MAX_OVERHEAD_ACTIVATIONS} "
                         "(each needs 2 simulations); plan.explain(name) gives them for one activation.")
        else:
            notes.append("overhead columns left out; plan.explain(name) gives them for one activation.")
        summary = tabulate(self.summary_rows(), tablefmt="plain")
        return f"{table}\n" + (f"{folded}\n" if folded else "") + "\n".join(notes) + f"\n\n{summary}"

    def explain(self, name: str) -> str:
        """Why activation ``name`` (a key of :attr:`decisions`) got its decision, in numbers; for a
        module path (``layer1.0.bn1``), the same for each activation that module saved."""
        from .explain import explain_one

        found = self.indices(name)
        parts = [explain_one(self, a) for a in found]
        if len(found) > 1:
            names = activation_names(self.graph)
            parts.insert(0, f"module {name} saves {len(found)} activations: " + ", ".join(names[a] for a in found))
        return "\n\n".join(parts)
