"""``plan.explain(name)`` (:func:`explain`): why one activation got its decision, from the plan's what-if numbers.

``name`` is an activation's name (a key of ``plan.decisions``) or the path of the module that saved
it (``layer1.0.bn1``, as in ``model.named_modules()``); a module saving several activations gets
one answer for each.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from .plan import activation_names
from .report import format_r, format_time, late_offload, shape_dtype, time_unit
from .schedule import Decision, Kind
from .units import format_bytes

if TYPE_CHECKING:
    from .plan import Plan
    from .whatif import Overheads, WhatIf


def explain(plan: Plan, name: str) -> str:
    """Why activation ``name`` (a key of ``plan.decisions``) got its decision, in numbers; for a
    module path (``layer1.0.bn1``), the same for each activation that module saved."""
    found = plan.indices(name)
    parts = [explain_one(plan, a) for a in found]
    if len(found) > 1:
        names = activation_names(plan.graph)
        parts.insert(0, f"module {name} saves {len(found)} activations: " + ", ".join(names[a] for a in found))
    return "\n\n".join(parts)


def explain_one(plan: Plan, a: int) -> str:
    """The explanation of activation index ``a``."""
    graph, sched, tl = plan.graph, plan.schedule, plan.timeline
    act = graph.activations[a]
    d = sched.decisions[a]
    o = plan.what_ifs.overheads(a)
    t = partial(format_time, plan)
    unit, _ = time_unit(plan)
    shape, dtype = shape_dtype(plan, a)
    name = activation_names(graph)[a]
    module = plan.module_of(a)
    nbytes = graph.buffers[act.buffer].nbytes
    run_at = {ins.op: i for i, ins in enumerate(sched.instrs) if ins.kind is Kind.RUN}
    produced = tl.end[run_at[act.producer]]
    readers = graph.backward_readers(act)
    first = sched.first_use.get(a, readers[0] if readers else None)
    where = f"graph {act.graph}, module {module}" if module else f"graph {act.graph}"
    lines = [f"{name} ({where}): {d.value}",
             f"  {format_bytes(nbytes)} on the device, shape {shape} {dtype}, made by "
             f"{graph.ops[act.producer].target} (node {graph.ops[act.producer].name})"]
    if first is None:
        lines.append(f"  produced at {t(produced)} {unit}; no backward op reads it")
    else:
        gap = tl.start[run_at[first]] - produced
        lines.append(f"  produced at {t(produced)} {unit}, first used at {t(tl.start[run_at[first]])} {unit} "
                     f"by {graph.ops[first].name} ({gap / max(plan.step_time, 1e-30):.0%} of the step later)")
    if d is Decision.SWAP:
        stall, late = tl.stall.get(a, 0.0), late_offload(plan, a)
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
    if format_r(o.r) != "-":
        lines.append(f"  r(X) = recompute overhead / swap overhead = {format_r(o.r)}")
    lines.append("  why: " + _why(plan, d, o))
    return "\n".join(lines)


def _saving(plan: Plan, chosen: WhatIf | None, keep: WhatIf) -> str:
    unit, _ = time_unit(plan)
    saved = 0.0 if chosen is None else chosen.step_time - keep.step_time
    if format_time(plan, saved) == "0":
        return "at the same step time (the planner frees memory it could keep when that is free)"
    if saved < 0:
        return f"but {format_time(plan, -saved)} {unit} slower"
    return f"{format_time(plan, saved)} {unit} faster: planner {plan.planner!r} chose otherwise"


def _why(plan: Plan, d: Decision, o: Overheads) -> str:
    """One sentence from the what-if numbers."""
    t = partial(format_time, plan)
    unit, _ = time_unit(plan)
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
    r_txt = "" if format_r(o.r) == "-" else f" (r(X) = {format_r(o.r)})"
    chosen, other = (o.swap, o.recompute) if d is Decision.SWAP else (o.recompute, o.swap)
    if other is not None and other.fits and chosen is not None and other.step_time < chosen.step_time:
        verdict = f"the other way would be cheaper, but planner {plan.planner!r} chose this one"
    else:
        verdict = f"so {'swapping' if d is Decision.SWAP else 'recomputing'} is the cheaper way to free it"
    if d is Decision.SWAP:
        return f"swapped: {keep_txt}; {rec_txt}{r_txt}: {verdict}."
    return f"recomputed: {keep_txt}; {swap_txt}{r_txt}: {verdict}."

