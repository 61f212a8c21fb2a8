"""The default planner over models x limits x presets: is it ever far from the best plan any
planner finds, slower than swap-all or sqrt(n) checkpointing, or far from the lower bound? And
how does its planning time grow with the graph?

Models: GPT-2 (HuggingFace ``GPT2LMHeadModel``, 768 wide, context 1024, batch 8, loss inside
the model; the zoo's own decoder when transformers is missing) at several depths, ResNet-50 at
batch 256, and the test zoo (tests/zoo.py). Limits: the floor (the smallest feasible limit) and
1/4, 1/2, 3/4 of the way to the in-core peak. Presets: V100 PCIe3, V100 NVLink2, H100 PCIe5.
Everything is simulated on the analytic cost model and traced on the meta device (the test zoo
runs its tiny models for real); planning times are CPU seconds of this process.
Writes ``results/planners_sweep.json`` and ``results/planners_time.svg``.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time

import torch
from tabulate import tabulate

import fxpooch
from fxpooch import models as zoo
from fxpooch.errors import InfeasibleMemoryLimit
from fxpooch.pipeline import problem_of
from fxpooch.plan import Plan
from fxpooch.planners import Evaluator
from fxpooch.planners.bounds import lower_bound
from fxpooch.planners.lp import lp_lower_bound
from fxpooch.planners.search import SearchOptions, plan_local

DEFAULT = "local"
PLANNERS_COMPARED = (DEFAULT, "pooch", "swap-all", "checkpoint", "checkpoint-all")
PRESETS = ("v100-pcie3", "v100-nvlink2", "h100-pcie5")
POINTS = (0.0, 0.25, 0.5, 0.75)  # limit = floor + point * (in-core - floor)
GPT2_DEPTHS_FULL = (2, 6, 12, 24, 48)
GPT2_DEPTHS_QUICK = (2, 6)
#: graphs up to this many activations get the LP relaxation's bound after probing, larger ones
#: the cut bound: GPT-2 2L's (49 activations) takes one to two minutes at the floor with every
#: family, 6L's (137) 20 to 140 CPU s on the cuts alone (``lp.LARGE``); at 12L (269) and ResNet-50
#: (211) even that model passes ``lp.MAX_NONZEROS`` (3.9M and 1.8M nonzeros at the floor)
LP_UP_TO = 150
#: the yardsticks: within this of the best plan; of the bound where the bound is tight
BEST_TOLERANCE, BOUND_TOLERANCE = 0.10, 0.15
#: the best plan also counts ``local`` run with this many times its work (a longer descent from
#: the same seeds: what the default planner's budget leaves on the table), on graphs of at most
#: ``LONG_UP_TO`` ops (GPT-2 24L has 4,387; at 48L's 8,683 the search's floor of simulations is most
#: of ``local``'s budget, and 8x the work buys 460 simulations against 300: hardly a longer search)
LONG_WORK, LONG_UP_TO = 8, 4_500
LONG = f"local-{LONG_WORK}x"
#: and, where ``--part sweep-longer`` ran (graphs of at most ``LONGER_UP_TO`` ops), ``local`` with
#: this many times its work: at ResNet-50's PCIe3 floor 8x stops at 1.767x in-core, 64x finds 1.698x
#: (``local``: 1.883x), while at GPT-2 6L's floor 64x ends where 8x does
LONGER_WORK, LONGER_UP_TO = 64, 1_400
LONGER = f"local-{LONGER_WORK}x"
#: the longer searches' columns, each counted among the best plans
LONG_SEARCHES = (LONG, LONGER)
#: the gap table (``planners.py --part gap``, saved beside this sweep's JSON) runs some of the same
#: rows (the test zoo and GPT-2 2L and 6L, at the floor and 1/4 and 1/2 of the way to in-core):
#: there its MILP and exact search bound the optimum better than the LP alone, and the exact
#: search's plan counts among the best
GAP_TABLE = "planners.json"
EXACT = "exact"


def long_local(work: int):
    """``local`` with ``work`` times its work, as a planner."""
    def planner(problem):
        return plan_local(problem, SearchOptions(work=work * SearchOptions().work))
    planner.__name__ = f"local-{work}x"
    return planner


def gpt2(n_layer: int, batch: int = 8, seq: int = 1024):
    try:
        import transformers
    except ImportError:
        with torch.device("meta"):
            return zoo.gpt_decoder(n_layer=n_layer, seq=seq), zoo.token_input(batch, seq)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, n_positions=seq, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def models(quick: bool):
    for depth in GPT2_DEPTHS_QUICK if quick else GPT2_DEPTHS_FULL:
        yield f"gpt2-{depth}L", lambda depth=depth: gpt2(depth)
    if not quick:
        def resnet50():
            with torch.device("meta"):
                spec = zoo.MODELS["resnet50"]
                return spec.build(), spec.make_input(256)
        yield "resnet50-b256", resnet50
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "zoo.py")
    spec = importlib.util.spec_from_file_location("fxpooch_test_zoo", path)  # the tests' graphs, not fxpooch.models
    test_zoo = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dynamo imports it by name
    spec.loader.exec_module(test_zoo)
    for name in sorted(test_zoo.ZOO):
        yield f"test:{name}", test_zoo.ZOO[name]


def plan_row(base: Plan, limit: int) -> dict:
    row = planner_columns(base, limit)
    row.update(long_columns(base, limit))
    row.update(bound_columns(base, limit))
    row.update(gaps(row))
    return row


def planner_columns(base: Plan, limit: int) -> dict:
    """Each of :data:`PLANNERS_COMPARED`'s plans relative to in-core and its CPU seconds, and the
    reference plans the default planner is slower than."""
    row: dict = {}
    in_core_time = base.in_core_time
    for p in PLANNERS_COMPARED:
        t0 = time.process_time()
        try:
            row[p] = fxpooch.replan(base, planner=p, mem_limit=limit).step_time / in_core_time
        except InfeasibleMemoryLimit:
            row[p] = None
        row[f"{p}_s"] = time.process_time() - t0
    row["worse_than_reference"] = [p for p in ("swap-all", "checkpoint") if row[p] is not None
                                   and (row[DEFAULT] is None or row[DEFAULT] > row[p] * (1 + 1e-9))]
    return row


def long_columns(base: Plan, limit: int, work: int = LONG_WORK, up_to: int = LONG_UP_TO) -> dict:
    """The plan of ``local`` with ``work`` times its work (:data:`LONG` by default) relative to
    in-core and its CPU seconds (None past ``up_to`` ops)."""
    name = f"local-{work}x"
    if len(base.graph.ops) > up_to:
        return {name: None, f"{name}_s": None}
    t0 = time.process_time()
    try:
        found = fxpooch.replan(base, planner=long_local(work), mem_limit=limit).step_time / base.in_core_time
    except InfeasibleMemoryLimit:
        found = None
    return {name: found, f"{name}_s": time.process_time() - t0}


def longer_columns(base: Plan, limit: int) -> dict:
    """:data:`LONGER`'s columns (:func:`long_columns`): run by ``--part sweep-longer`` alone."""
    return long_columns(base, limit, LONGER_WORK, LONGER_UP_TO)


def bound_columns(base: Plan, limit: int) -> dict:
    """The bound (the LP after probing on small graphs, the cut bound on the rest) relative to
    in-core, its kind and CPU seconds."""
    kind = "lp" if len(base.graph.activations) <= LP_UP_TO else "cut"
    t0 = time.process_time()
    ev = Evaluator(problem_of(base, limit))
    bound = lp_lower_bound(ev) if kind == "lp" else lower_bound(ev)
    return {"bound_kind": kind, "bound_s": time.process_time() - t0,
            "bound": None if bound == math.inf else bound / base.in_core_time}


def gap_table_columns(row: dict, gap_rows: list[dict]) -> dict:
    """The gap table's best proved bound at ``row``'s problem (the same model, preset, graph and
    limit), which of its bounds that is, and its exact search's plan; None where it has no such row."""
    key = (row["model"], row["hardware"], row["point"], row["ops"], row["activations"])
    for g in gap_rows:
        if (g["model"], g["hardware"], g["point"], g["ops"], g["activations"]) == key and \
                math.isclose(g["fraction"], row["fraction"], rel_tol=1e-12):
            proved = [(g[k], kind) for k, kind in (("cut", "cut"), ("lp", "lp"), ("milp", "milp"), ("exact_bound", EXACT))
                      if g.get(k) is not None]
            bound, kind = max(proved) if proved else (None, None)
            return {"gap_table_bound": bound, "gap_table_bound_kind": kind, EXACT: g.get("exact_best")}
    return {"gap_table_bound": None, "gap_table_bound_kind": None, EXACT: None}


def best_bound(row: dict) -> tuple[float | None, str | None]:
    """The best lower bound known at ``row`` and its kind: the sweep's own (``bound``) or the gap
    table's (:func:`gap_table_columns`)."""
    known = [(row[b], row[k]) for b, k in (("bound", "bound_kind"), ("gap_table_bound", "gap_table_bound_kind"))
             if row.get(b) is not None]
    return max(known) if known else (None, None)


def gaps(row: dict) -> dict:
    """The best plan of the planners compared, the longer searches (:data:`LONG_SEARCHES`, where
    they ran) and the gap table's exact search, and the default planner's gaps to it and to the
    best bound (:func:`best_bound`)."""
    found = [row[p] for p in (*PLANNERS_COMPARED, *LONG_SEARCHES, EXACT) if row.get(p) is not None]
    best = min(found) if found else None
    d = row[DEFAULT]
    bound, kind = best_bound(row)
    return {"best": best, "gap_to_best": None if d is None or best is None else d / best - 1,
            "best_bound": bound, "best_bound_kind": kind,
            "gap_to_bound": None if d is None or bound is None else d / bound - 1}


def with_gap_table(rows: list[dict], path: str) -> list[dict]:
    """``rows`` with the gap table's columns (:func:`gap_table_columns`, from the JSON at ``path``
    where it exists) and their gaps made again."""
    gap_rows = []
    if os.path.exists(path):
        with open(path) as f:
            gap_rows = json.load(f)["rows"]
    for row in rows:
        row.update(gap_table_columns(row, gap_rows))
        row.update(gaps(row))
    return rows


def refresh(out: str, only: set[str], columns) -> list[dict]:
    """The saved rows with the ``columns`` (:func:`bound_columns` or :func:`long_columns`) of the
    models in ``only`` made again, and their gaps; the other columns stay."""
    with open(out) as f:
        rows = json.load(f)["rows"]
    for name, build in models(quick=False):
        if name not in only:
            continue
        model, x = build()
        for hw in PRESETS:
            base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hw)
            for row in rows:
                if row["model"] == name and row["hardware"] == hw:
                    made = columns(base, row["limit"])
                    row.update(made)
                    row.update(gaps(row))
                    print(f"{name} {hw} {row['point']}: {made}", file=sys.stderr, flush=True)
    return rows


def bases(quick: bool, only: set[str] | None, presets: tuple[str, ...]):
    """(model, preset, its in-core plan, its floor) for each model of ``only`` (None: all) on each
    preset, said on stderr as each is captured."""
    for name, build in models(quick):
        if only is not None and name not in only:
            continue
        model, x = build()
        for hw in presets:
            t0 = time.process_time()
            base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hw)
            graph = base.graph
            floor = Evaluator(problem_of(base, base.in_core_peak_bytes)).floor().timeline.static_peak_bytes
            print(f"{name} on {hw}: {len(graph.ops)} ops, {len(graph.activations)} activations, floor "
                  f"{floor / base.in_core_peak_bytes:.2f} of in-core (captured in {time.process_time() - t0:.1f} CPU s)",
                  file=sys.stderr, flush=True)
            yield name, hw, base, floor


def limit_at(base: Plan, floor: int, point: float) -> int:
    """The limit ``point`` of the way from ``floor`` to ``base``'s in-core peak (a row's)."""
    return int(floor + point * (base.in_core_peak_bytes - floor))


def run(quick: bool, only: set[str] | None = None) -> list[dict]:
    rows = []
    presets = ("v100-pcie3", "h100-pcie5") if quick else PRESETS
    for name, hw, base, floor in bases(quick, only, presets):
        graph = base.graph
        for point in POINTS:
            limit = limit_at(base, floor, point)
            row = {"model": name, "hardware": hw, "point": point, "limit": limit,
                   "fraction": limit / base.in_core_peak_bytes, "ops": len(graph.ops),
                   "activations": len(graph.activations)}
            row.update(plan_row(base, limit))
            rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    planned = [r for r in rows if r[DEFAULT] is not None]
    tight = [r for r in planned if r["best_bound"] is not None and r["gap_to_best"] is not None
             and r["best"] <= r["best_bound"] * (1 + BOUND_TOLERANCE)]
    return {
        "rows": len(rows), "default_fits": len(planned),
        "default_fails_where_another_fits": sum(r[DEFAULT] is None and r["best"] is not None for r in rows),
        "worst_gap_to_best": max((r["gap_to_best"] for r in planned), default=None),
        "rows_over_best_tolerance": sum(r["gap_to_best"] > BEST_TOLERANCE for r in planned),
        "rows_worse_than_swap_all_or_checkpoint": sum(bool(r["worse_than_reference"]) for r in planned),
        "rows_with_tight_bound": len(tight),
        "worst_gap_to_tight_bound": max((r["gap_to_bound"] for r in tight), default=None),
    }


README_BEGIN, README_END = "<!-- planners-sweep: begin -->", "<!-- planners-sweep: end -->"


def readme_table(rows: list[dict]) -> str:
    """Per model: the default planner's worst gaps over presets and limits (markdown)."""
    lines = [f"| model | ops | activations | limits fitted | worst gap to the best plan | worse than swap-all "
             f"or checkpoint | bound | worst gap to a tight bound | {DEFAULT} CPU s (max) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        s = summary(mine)

        def pct(v):
            return "-" if v is None else f"{100 * v:.1f}%"

        lines.append(f"| {model} | {mine[0]['ops']} | {mine[0]['activations']} | {s['default_fits']}/{s['rows']} | "
                     f"{pct(s['worst_gap_to_best'])} | {s['rows_worse_than_swap_all_or_checkpoint']} | "
                     f"{', '.join(sorted({r['best_bound_kind'] for r in mine if r['best_bound_kind']}))} | {pct(s['worst_gap_to_tight_bound'])} ({s['rows_with_tight_bound']} rows) | "
                     f"{max(r[f'{DEFAULT}_s'] for r in mine):.1f} |")
    return "\n".join(lines)


def replace_between(path: str, begin: str, end: str, body: str) -> None:
    """Replace what the file ``path`` has between the markers ``begin`` and ``end`` with ``body``
    (nothing happens where a marker is missing)."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    with open(path, "w") as f:
        f.write(head + begin + body + end + rest.split(end, 1)[1])


def write_readme(path: str, rows: list[dict], commands: list[str]) -> None:
    """Replace the table between the README's sweep markers with one made from ``rows`` (made by
    ``commands``, in that order)."""
    ran = ", then ".join(f"`{c}`" for c in commands)
    body = (f"\n{ran} (benchmarks/results/planners_sweep.json; simulated on the analytic cost model, "
            f"presets {', '.join(sorted({r['hardware'] for r in rows}))}, limits from the floor to 3/4 of the way to "
            f"in-core; the best plan of {', '.join(PLANNERS_COMPARED)} and, on graphs of at most {LONG_UP_TO:,} ops, "
            f"`{DEFAULT}` with {LONG_WORK}x its work, where `--part sweep-longer` ran (graphs of at most {LONGER_UP_TO:,} "
            f"ops) with {LONGER_WORK}x, and at the gap table's rows its exact search's plan; the bound: the "
            f"sweep's own and, at those rows, the gap table's MILP or exact search where higher; planning CPU seconds "
            f"on a 2-core machine):\n\n{readme_table(rows)}\n")
    replace_between(path, README_BEGIN, README_END, body)


def time_picture(rows: list[dict], path: str) -> None:
    """Planning CPU seconds of the default planner against ops, log-log, as a plain SVG."""
    pts = [(r["ops"], r[f"{DEFAULT}_s"]) for r in rows if r[f"{DEFAULT}_s"] > 0]
    if not pts:
        return
    w, h, m = 640, 400, 60
    lx = [math.log10(o) for o, _ in pts]
    ly = [math.log10(t) for _, t in pts]
    x0, x1 = math.floor(min(lx)), math.ceil(max(lx))
    y0, y1 = math.floor(min(ly)), math.ceil(max(ly))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)

    def px(x, y):
        return m + (x - x0) / (x1 - x0) * (w - 2 * m), h - m - (y - y0) / (y1 - y0) * (h - 2 * m)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle">{DEFAULT} planner: planning CPU seconds vs graph ops '
           '(log-log, simulated plans)</text>']
    for k in range(x0, x1 + 1):
        x, _ = px(k, y0)
        out.append(f'<line x1="{x}" y1="{m}" x2="{x}" y2="{h - m}" stroke="#ddd"/>'
                   f'<text x="{x}" y="{h - m + 16}" text-anchor="middle">{10 ** k:g}</text>')
    for k in range(y0, y1 + 1):
        _, y = px(x0, k)
        out.append(f'<line x1="{m}" y1="{y}" x2="{w - m}" y2="{y}" stroke="#ddd"/>'
                   f'<text x="{m - 6}" y="{y + 4}" text-anchor="end">{10 ** k:g}</text>')
    for a, b in zip(lx, ly):
        x, y = px(a, b)
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#1f6fb4" fill-opacity="0.6"/>')
    out.append(f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">ops in the step graph</text></svg>')
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def merged(rows: list[dict], out: str, names: list[str]) -> list[dict]:
    """``rows`` with the rows of every other model of ``names`` kept from ``out`` (a run of some
    models only), in the order of ``names``."""
    if not os.path.exists(out):
        return rows
    with open(out) as f:
        old = json.load(f)["rows"]
    ran = {r["model"] for r in rows}
    order = {name: k for k, name in enumerate(names)}
    kept = [r for r in old if r["model"] not in ran and r["model"] in order]
    return sorted(kept + rows, key=lambda r: order[r["model"]])  # stable: presets and limits keep their order


def saved_commands(out: str) -> list[str]:
    """The commands that made the rows saved in ``out``, in the order they ran (none if there is no
    ``out``)."""
    if not os.path.exists(out):
        return []
    with open(out) as f:
        return json.load(f)["commands"]


def commands_after(saved: list[str], command: str, whole: bool) -> list[str]:
    """The commands that made the rows once ``command`` ran after ``saved``, in the order they ran:
    ``command`` alone where it made them all (``whole``); else ``saved`` and ``command`` last, an
    earlier run of the same command left out (this one made its rows again).

    >>> commands_after(["sweep", "sweep --models a", "sweep-summary"], "sweep-summary", whole=False)
    ['sweep', 'sweep --models a', 'sweep-summary']
    """
    return [command] if whole else [*(c for c in saved if c != command), command]


#: ``--part`` -> the columns it makes again on the saved rows
REFRESH = {"sweep-planners": planner_columns, "sweep-bounds": bound_columns, "sweep-long": long_columns,
           "sweep-longer": longer_columns}


def main(quick: bool, out: str, only: set[str] | None = None, part: str = "sweep") -> None:
    """``part``: ``sweep``; one of :data:`REFRESH`: the saved rows, its columns of the models in
    ``only`` made again; or ``sweep-summary``: the saved rows as they are. Each time, the gap
    table's bounds and exact plans (:data:`GAP_TABLE`) are read again."""
    if part == "sweep-summary":
        with open(out) as f:
            rows = json.load(f)["rows"]
    elif part in REFRESH:
        rows = refresh(out, only or {name for name, _ in models(quick)}, REFRESH[part])
    else:
        rows = run(quick, only)
        if only is not None:
            rows = merged(rows, out, [name for name, _ in models(quick)])
    rows = with_gap_table(rows, os.path.join(os.path.dirname(out), GAP_TABLE))

    def fmt(v):
        return "fails" if v is None else f"{v:.3f}x"

    table = [[r["model"], r["hardware"], f"{r['fraction']:.2f}", r["ops"],
              *(fmt(r.get(p)) for p in (*PLANNERS_COMPARED, *LONG_SEARCHES, EXACT)), fmt(r["best_bound"]),
              r["best_bound_kind"],
              *("-" if r[g] is None else f"{100 * r[g]:.1f}%" for g in ("gap_to_best", "gap_to_bound")),
              f"{r[f'{DEFAULT}_s']:.1f}"]
             for r in rows]
    print(f"Simulated step time relative to in-core (analytic cost model, not measured); limit as a fraction "
          f"of in-core, from the floor up; gaps of the default planner ({DEFAULT}):")
    print(tabulate(table, headers=["model", "hardware", "limit", "ops", *PLANNERS_COMPARED, *LONG_SEARCHES, EXACT,
                                   "bound", "kind",
                                   "gap best", "gap bound", f"{DEFAULT} CPU s"]))
    summ = summary(rows)
    print(json.dumps(summ, indent=1))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    command = f"python benchmarks/planners.py --part {part}" + (" --quick" if quick and part == "sweep" else "") + (
        f" --models {','.join(sorted(only))}" if only else "")
    commands = commands_after(saved_commands(out), command, whole=part == "sweep" and only is None)
    with open(out, "w") as f:
        json.dump({"simulated": True, "commands": commands, "summary": summ, "rows": rows}, f, indent=1)
    time_picture(rows, os.path.join(os.path.dirname(out), "planners_time.svg"))
    print(readme_table(rows))
    write_readme(os.path.join(os.path.dirname(__file__), "..", "README.md"), rows, commands)
    print(f"wrote {out}")
