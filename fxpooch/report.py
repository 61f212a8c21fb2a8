"""A plan as text: one row per activation and the totals (what ``print(plan)`` shows).

:func:`table` gives one row per activation (the module that saved it, shape, bytes, decision and
the numbers behind it: stall, late offload, swap / recompute overhead and PoocH's r(X)), small
ones folded into one line (:func:`folded`), then the totals (:func:`summary_rows`). The overheads
come from the plan's what-if simulations (:mod:`fxpooch.whatif`), made only for these displays.
``plan.table(...)`` and ``print(plan)`` call :func:`table`; :mod:`fxpooch.explain` answers for
one activation with the same numbers and formatting.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from tabulate import tabulate

from .plan import activation_names
from .progress import Stage, stage
from .schedule import Decision
from .units import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

#: above this many activations the table leaves out the what-if overhead columns (2 simulations each)
MAX_OVERHEAD_ACTIVATIONS = 300
#: the table folds activations smaller than this (and than FOLD_FRACTION of the largest) into one line:
#: normalisation statistics and the like, a few KiB each, which no plan needs to decide about
FOLD_BELOW_BYTES = 64 * 2**10
FOLD_FRACTION = 1 / 100
#: op names longer than this are cut in the table's op column
MAX_OP_LABEL = 30


def format_r(r: float | None) -> str:
    """r(X) for display: ``-`` when it means nothing (an overhead impossible, or neither costs anything)."""
    if r is None or math.isnan(r):
        return "-"
    return "inf" if math.isinf(r) else f"{r:.2f}"


def op_label(target: str) -> str:
    """``aten.convolution.default`` -> ``convolution``."""
    label = target.removeprefix("aten.").removesuffix(".default")
    return label if len(label) <= MAX_OP_LABEL else label[:MAX_OP_LABEL - 2] + ".."


def time_unit(plan: Plan) -> tuple[str, float]:
    """The unit the plan's times are shown in, and seconds -> that unit."""
    return ("ms", 1e3) if max(plan.step_time, plan.in_core_time) >= 10e-3 else ("us", 1e6)


def format_time(plan: Plan, seconds: float | None, signed: bool = False) -> str:
    """``seconds`` in :func:`time_unit` (without the unit); ``-`` for None, ``0`` below display precision."""
    if seconds is None:
        return "-"
    _, scale = time_unit(plan)
    v = seconds * scale
    if abs(v) < 5e-4:
        return "0"
    return f"{v:+.3f}" if signed else f"{v:.3f}"


def shape_dtype(plan: Plan, a: int) -> tuple[str, str]:
    """Activation ``a``'s shape and dtype as text ("?" when the plan was built without them)."""
    if len(plan.activation_meta) != len(plan.graph.activations):
        return "?", "?"
    shape, dtype = plan.activation_meta[a]
    return "(" + ", ".join(map(str, shape)) + ")", dtype


def late_offload(plan: Plan, a: int) -> float:
    """Seconds by which activation ``a``'s offload outlasts the forward (0 if hidden)."""
    end = plan.timeline.d2h_end.get(a)
    return 0.0 if end is None else max(0.0, end - plan.timeline.forward_end)


def folded(plan: Plan) -> list[int]:
    """Activations too small to matter (under FOLD_BELOW_BYTES and FOLD_FRACTION of the largest):
    the table shows them as one summary line."""
    sizes = [plan.graph.buffers[act.buffer].nbytes for act in plan.graph.activations]
    below = min(FOLD_BELOW_BYTES, max(sizes, default=0) * FOLD_FRACTION)
    return [a for a, n in enumerate(sizes) if n < below]


def _folded_line(plan: Plan, small: list[int]) -> str:
    if not small:
        return ""
    graph = plan.graph
    c = Counter(plan.schedule.decisions[a].value for a in small)
    ops = Counter(op_label(graph.ops[graph.activations[a].producer].target) for a in small)
    total = sum(graph.buffers[graph.activations[a].buffer].nbytes for a in small)
    largest = max(graph.buffers[graph.activations[a].buffer].nbytes for a in small)
    top = ", ".join(f"{op} x{k}" for op, k in ops.most_common(3)) + (", ..." if len(ops) > 3 else "")
    return (f"+ {len(small)} small activations not listed (each at most {format_bytes(largest)}, "
            f"{format_bytes(total)} in all; {top}): keep {c['keep']} / swap {c['swap']} / "
            f"recompute {c['recompute']}. plan.table(fold=False) or --all-rows lists them.")


def table_rows(plan: Plan, overheads: bool | None = None, fold: bool = True) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the table; ``overheads`` None: only up to MAX_OVERHEAD_ACTIVATIONS rows;
    ``fold``: without the rows of :func:`folded`."""
    skip = set(folded(plan)) if fold else set()
    n = len(plan.graph.activations) - len(skip)
    with_over = n <= MAX_OVERHEAD_ACTIVATIONS if overheads is None else overheads
    unit, _ = time_unit(plan)
    headers = ["graph", "activation", "module", "op", "shape", "dtype", "bytes", "decision",
               f"stall {unit}", f"late d2h {unit}"]
    if with_over:
        headers += [f"swap +{unit}", f"recompute +{unit}", "r(X)"]
    with stage("what-if simulations for the table", n if with_over else None, "activation") as progress:
        return headers, _rows(plan, skip, with_over, progress)


def _rows(plan: Plan, skip: set[int], with_over: bool, progress: Stage) -> list[list[str]]:
    rows = []
    graph = plan.graph
    for a, (name, act, d) in enumerate(zip(activation_names(graph), graph.activations, plan.schedule.decisions)):
        if a in skip:
            continue
        shape, dtype = shape_dtype(plan, a)
        swapped = d is Decision.SWAP
        row = [str(act.graph), name, plan.module_of(a) or "-", op_label(graph.ops[act.producer].target),
               shape, dtype, format_bytes(graph.buffers[act.buffer].nbytes), d.value,
               format_time(plan, plan.timeline.stall.get(a, 0.0)) if swapped else "-",
               format_time(plan, late_offload(plan, a)) if swapped else "-"]
        if with_over:
            o = plan.what_ifs.overheads(a)
            row += [format_time(plan, o.swap_overhead, signed=True),
                    format_time(plan, o.recompute_overhead, signed=True), format_r(o.r)]
            progress.update()
        rows.append(row)
    return rows


def summary_rows(plan: Plan) -> list[list[str]]:
    """The totals under the table: limit, peaks, host bytes, counts, step time."""
    c = plan.counts()
    slowdown = plan.step_time / plan.in_core_time if plan.in_core_time else float("nan")
    unit, scale = time_unit(plan)
    pct = 100 * plan.peak_bytes / plan.in_core_peak_bytes if plan.in_core_peak_bytes else float("nan")
    return [
        ["planner", plan.planner],
        ["memory limit", format_bytes(plan.mem_limit)],
        ["allocator margin", f"{format_bytes(plan.margin_bytes)} (planned under "
                             f"{format_bytes(plan.mem_limit - plan.margin_bytes)})"],
        ["planned peak", f"{format_bytes(plan.peak_bytes)} ({pct:.0f}% of in-core)"],
        ["in-core peak", format_bytes(plan.in_core_peak_bytes)],
        ["resident (params, inputs)", format_bytes(plan.graph.resident_bytes)],
        ["host bytes (swapped)", format_bytes(plan.host_bytes)],
        ["keep / swap / recompute", f"{c['keep']} / {c['swap']} / {c['recompute']}"],
        ["step time (simulated)", f"{plan.step_time * scale:.3f} {unit} ({slowdown:.2f}x in-core)"],
        ["in-core step time", f"{plan.in_core_time * scale:.3f} {unit}"],
        ["profile", plan.profile.source],
    ]


def table(plan: Plan, overheads: bool | None = None, fold: bool = True) -> str:
    """The activation table and the totals; ``overheads`` and ``fold`` as in :func:`table_rows`."""
    headers, rows = table_rows(plan, overheads, fold)
    text = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    small = _folded_line(plan, folded(plan)) if fold else ""
    unit, _ = time_unit(plan)
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
    summary = tabulate(summary_rows(plan), tablefmt="plain")
    return f"{text}\n" + (f"{small}\n" if small else "") + "\n".join(notes) + f"\n\n{summary}"
