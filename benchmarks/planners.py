"""How far are the planners from the optimum? One command: ``python benchmarks/planners.py [--quick]``.

``--part gap``: for each model x hardware preset x limit (the floor, the smallest feasible limit,
and 1/4 and 1/2 of the way from it to the in-core peak) it plans with ``pooch``,
``superneurons`` and ``local`` on the SAME captured graph and costs, and reports the simulated
step time of each; the lower bounds: the cut bound (``planners/bounds.py``), its LP relaxation
(``planners/lp.py``) and the same model with integral decisions (``planners/milp.py``, HiGHS
stopped after ``MILP_SECONDS``: then its proved dual bound); the optimum where it is known:
``exact`` on graphs of at most ``EXACT_UP_TO`` activations, or a plan no slower than the best
bound (the bound proves it optimal); and the default planner's gap to the optimum and to the
best bound (an upper estimate of its distance from the optimum). Planning times are CPU seconds
of this process, so other load does not inflate them (HiGHS's limit is wall-clock).
Models: the test zoo (tests/zoo.py), GPT-2 at 2 layers (HuggingFace, as the sweep), an 8-layer
convnet; ``--models a,b`` runs a subset (also ``resnet50``, ``gpt2``... of ``fxpooch.models``).
All figures are simulated on the analytic cost model of the named hardware; tracing runs on
meta tensors (no memory used). Writes benchmarks/results/planners.json.

``--part sweep`` (also part of the default ``all``) runs ``planners_sweep.py``: the default
planner over GPT-2 depths, ResNet-50 and the test zoo at limits from the floor to in-core on
three presets, its gap to the best plan and the bound, and planning time vs graph size
(results/planners_sweep.json, results/planners_time.svg).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fxpooch import models as zoo  # noqa: E402
import planners_sweep  # noqa: E402

import fxpooch  # noqa: E402
from fxpooch.errors import InfeasibleMemoryLimit  # noqa: E402
from fxpooch.pipeline import problem_of  # noqa: E402
from fxpooch.planners import PLANNERS, Evaluator  # noqa: E402
from fxpooch.planners.bounds import lower_bound  # noqa: E402
from fxpooch.planners.lp import lp_lower_bound  # noqa: E402
from fxpooch.planners.milp import milp_lower_bound  # noqa: E402

POINTS = (0.0, 0.25, 0.5)  # limit = floor + point * (in-core - floor)
#: the exact search proves the optimum in seconds up to here on these models (see search.py)
EXACT_UP_TO = 12
#: the LP and the MILP run on graphs of at most this many activations (the cut bound on all)
MILP_UP_TO = 150
#: HiGHS's wall-clock limit per MILP; past it the bound it has proved is used
MILP_SECONDS = 20.0
TEST_ZOO = ["test:cnn_bn", "test:mlp", "test:resnet_small", "test:transformer_block"]
FULL = [("convnet-8", 32), ("gpt2-2L", 8), *((name, 0) for name in TEST_ZOO)]
QUICK = [("convnet-8", 32), ("test:mlp", 0), ("test:cnn_bn", 0)]
PRESETS_FULL = ("v100-pcie3", "v100-nvlink2", "h100-pcie5")
PRESETS_QUICK = ("v100-pcie3", "h100-pcie5")


class _MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def build(name: str, batch: int):
    with torch.device("meta"):
        if name == "convnet-8":  # 8 x (3x3 conv, ReLU) at 32 channels, 64x64: 9 activations
            layers = [m for _ in range(8) for m in (nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())]
            return nn.Sequential(*layers, _MeanPool(), nn.Linear(32, 10)), torch.randn(batch, 32, 64, 64)
        if name == "gpt2-2layer":
            model = zoo.gpt_decoder(n_layer=2, d_model=256, n_head=4, seq=256, vocab=1000)
            return model, zoo.token_input(batch, 256, 1000)
    if name == "gpt2-2L" or name.startswith("test:"):
        return dict(planners_sweep.models(quick=True))[name]()  # the sweep's GPT-2 and the tests' zoo
    with torch.device("meta"):
        spec = zoo.MODELS[name]
        return spec.build(), spec.make_input(batch)


def run(models, presets, planners) -> list[dict]:
    rows = []
    for name, batch in models:
        model, x = build(name, batch)
        for hw in presets:
            t0 = time.perf_counter()
            base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hw)
            capture_s = time.perf_counter() - t0
            graph = base.graph
            floor = Evaluator(problem_of(base, base.in_core_peak_bytes)).floor().timeline.static_peak_bytes
            print(f"{name}{f' b{batch}' if batch else ''} on {hw}: {len(graph.ops)} ops, {len(graph.activations)} activations, "
                  f"captured in {capture_s:.1f} s", file=sys.stderr, flush=True)
            for point in POINTS:
                limit = int(floor + point * (base.in_core_peak_bytes - floor))
                row = {"model": name, "batch": batch, "hardware": hw, "point": point,
                       "fraction": limit / base.in_core_peak_bytes, "ops": len(graph.ops),
                       "activations": len(graph.activations)}
                for p in planners:
                    t0 = time.process_time()
                    try:
                        row[p] = fxpooch.replan(base, planner=p, mem_limit=limit).step_time / base.in_core_time
                    except InfeasibleMemoryLimit:
                        row[p] = None
                    row[f"{p}_s"] = time.process_time() - t0
                row.update(bound_columns(base, limit))
                rows.append(row)
    return rows


def bound_columns(base, limit: int) -> dict:
    """The bounds relative to in-core (None where none ran or no plan fits), their CPU seconds, and
    the optimum where ``exact`` runs."""
    ic, n = base.in_core_time, len(base.graph.activations)
    out: dict = {}
    for key, fn in (("cut", lower_bound), ("lp", lp_lower_bound if n <= MILP_UP_TO else None),
                    ("milp", (lambda ev: milp_lower_bound(ev, MILP_SECONDS)) if n <= MILP_UP_TO else None)):
        t0 = time.process_time()
        value = None if fn is None else fn(Evaluator(problem_of(base, limit)))
        if key == "milp" and value is not None:
            out["milp_proved"] = value.proved
            value = value.bound
        out[key] = None if value is None or value == math.inf else value / ic
        out[f"{key}_s"] = time.process_time() - t0
        if value == math.inf:
            out["no_plan_fits"] = True
    out.setdefault("no_plan_fits", False)
    found = [v for v in (out["cut"], out["lp"], out["milp"]) if v is not None]
    out["bound"] = max(found) if found else None
    out["optimum"], out["optimum_from"] = None, None
    if n <= EXACT_UP_TO:
        t0 = time.process_time()
        try:
            out["optimum"] = fxpooch.replan(base, planner="exact", mem_limit=limit).step_time / ic
            out["optimum_from"] = "exact"
        except InfeasibleMemoryLimit:
            pass
        out["exact_s"] = time.process_time() - t0
    return out


def gaps(row: dict, planners) -> None:
    """Each planner's gap to the optimum and to the best bound; a plan that meets the bound is optimal."""
    found = [row[p] for p in planners if row[p] is not None]
    if row["optimum"] is None and found and row["bound"] is not None and min(found) <= row["bound"] * (1 + 1e-9):
        row["optimum"], row["optimum_from"] = min(found), "bound"
    for p in planners:
        for key, ref in (("gap", row["optimum"]), ("gap_bound", row["bound"])):
            row[f"{p}_{key}"] = None if row[p] is None or ref is None else round(100 * (row[p] / ref - 1), 9) + 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models and fewer presets (a few minutes)")
    ap.add_argument("--models", help="comma list of the models to run (default: all of the chosen set)")
    ap.add_argument("--part", choices=("all", "gap", "sweep"), default="all",
                    help="gap: planners vs the optimum / bound; sweep: the default planner over models, "
                         "limits and presets, with planning time vs graph size")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "planners.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.part in ("all", "sweep"):
        only = set(args.models.split(",")) if args.models and args.part == "sweep" else None
        planners_sweep.main(args.quick, os.path.join(os.path.dirname(args.out), "planners_sweep.json"), only)
    if args.part == "sweep":
        return 0
    planners = [p for p in ("pooch", "superneurons", "local") if p in PLANNERS]
    models = QUICK if args.quick else FULL
    if args.models:
        wanted = args.models.split(",")
        models = [m for m in FULL + QUICK if m[0] in wanted] + [(m, 64) for m in wanted if m in zoo.MODELS]
        if not models:
            ap.error(f"--models: none of {wanted} in {[m[0] for m in FULL + QUICK] + sorted(zoo.MODELS)}")
        models = list(dict.fromkeys(models))
    rows = run(models, PRESETS_QUICK if args.quick else PRESETS_FULL, planners)
    for r in rows:
        gaps(r, planners)
    print(gap_table(rows, planners))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"simulated": True, "command": "python benchmarks/planners.py --part gap" + (" --quick" if args.quick else ""),
                   "rows": rows}, f, indent=1)
    write_readme(os.path.join(os.path.dirname(__file__), "..", "README.md"), rows, planners)
    print(f"wrote {args.out}")
    return 0


def gap_table(rows: list[dict], planners, markdown: bool = False) -> str:
    """Simulated step times relative to in-core, the bounds, the optimum and the default's gaps."""
    def fmt(v):
        return "-" if v is None else f"{v:.3f}x"

    def pct(v):
        return "-" if v is None else f"{v:.1f}%"

    table = []
    for r in rows:
        optimum = fmt(r["optimum"]) + ("" if r["optimum_from"] in (None, "exact") else " (bound)")
        milp = "-" if r["milp"] is None else fmt(r["milp"]) + ("" if r.get("milp_proved") else "*")
        row = [r["model"], r["hardware"], f"{r['fraction']:.2f}", r["activations"],
               *(fmt(r[p]) if r[p] is not None else "fails" for p in planners),
               "none fits" if r["no_plan_fits"] else fmt(r["cut"]), fmt(r["lp"]), milp, optimum,
               pct(r["local_gap"]), pct(r["local_gap_bound"])]
        if not markdown:
            row.append(" / ".join(f"{r[f'{p}_s']:.1f}" for p in planners) + f" / {r['milp_s']:.1f}")
        table.append(row)
    headers = ["model", "hardware", "limit", "acts", *planners, "cut bound", "LP bound", "MILP bound", "optimum",
               "local gap to optimum", "local gap to bound"]
    if not markdown:
        headers.append("planning CPU s (" + " / ".join(planners) + " / MILP)")
    title = ("Simulated step time relative to in-core (analytic cost model, not measured); limit as a fraction of "
             "in-core, from the floor up; * a MILP stopped at its time limit (its proved bound); (bound) an "
             "optimum proved by the bound:")
    if markdown:
        return tabulate(table, headers=headers, tablefmt="github")
    return title + "\n" + tabulate(table, headers=headers)


README_BEGIN, README_END = "<!-- planners-gap: begin -->", "<!-- planners-gap: end -->"


def write_readme(path: str, rows: list[dict], planners) -> None:
    """Replace the table between the README's gap markers with one made from ``rows``."""
    body = ("\n`python benchmarks/planners.py --part gap` (benchmarks/results/planners.json; simulated on the analytic "
            "cost model; * a MILP stopped at its time limit, its proved bound; (bound) an optimum proved by the "
            f"bound):\n\n{gap_table(rows, planners, markdown=True)}\n")
    planners_sweep.replace_between(path, README_BEGIN, README_END, body)


if __name__ == "__main__":
    sys.exit(main())
