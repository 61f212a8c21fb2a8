"""How far are the planners from the optimum? One command: ``python benchmarks/planners.py [--quick]``.

For each model x hardware preset x limit (1/2, 1/3, 1/4 of the in-core peak) it plans with
``pooch``, ``superneurons`` and ``local`` on the SAME captured graph and costs, and reports the
simulated step time of each, the optimum (``exact``, for graphs of at most ``EXACT_UP_TO``
activations) and the lower bound (``fxpooch.planners.bounds``), each planner's gap in percent to
the optimum where known, else to the bound (an upper estimate of its distance from the optimum),
and the planning times (CPU seconds of this process, so other load does not inflate them).
ResNeXt-101 3D (2,672 ops) is the full run's large-graph case. ``--models a,b`` runs a subset.
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

FRACTIONS = (1 / 2, 1 / 3, 1 / 4)
#: the exact search proves the optimum in seconds up to here on these models (see search.py)
EXACT_UP_TO = 12
FULL = [("convnet-8", 32), ("resnet50", 64), ("vgg16", 32), ("alexnet", 128), ("gpt2", 4), ("resnext101_3d", 8)]
QUICK = [("convnet-8", 32), ("gpt2-2layer", 8)]
PRESETS_FULL = ("v100-pcie3", "v100-nvlink2", "h100-pcie5")
PRESETS_QUICK = ("v100-pcie3", "v100-nvlink2")


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
            print(f"{name} b{batch} on {hw}: {len(graph.ops)} ops, {len(graph.activations)} activations, "
                  f"captured in {capture_s:.1f} s", file=sys.stderr)
            for frac in FRACTIONS:
                limit = int(base.in_core_peak_bytes * frac)
                row = {"model": name, "batch": batch, "hardware": hw, "fraction": round(frac, 3),
                       "ops": len(graph.ops), "activations": len(graph.activations)}
                for p in planners:
                    t0 = time.process_time()
                    try:
                        row[p] = fxpooch.replan(base, planner=p, mem_limit=limit).step_time / base.in_core_time
                    except InfeasibleMemoryLimit:
                        row[p] = None
                    row[f"{p}_s"] = time.process_time() - t0
                t0 = time.process_time()
                bound = lower_bound(Evaluator(problem_of(base, limit)))
                row["bound_s"] = time.process_time() - t0
                row["no_plan_fits"] = bound == math.inf  # the bound proves it
                row["bound"] = None if row["no_plan_fits"] else bound / base.in_core_time
                row["optimum"] = None
                if len(graph.activations) <= EXACT_UP_TO:
                    t0 = time.process_time()
                    try:
                        row["optimum"] = fxpooch.replan(base, planner="exact", mem_limit=limit).step_time / base.in_core_time
                    except InfeasibleMemoryLimit:
                        pass
                    row["optimum_s"] = time.process_time() - t0
                ref = row["optimum"] if row["optimum"] is not None else row["bound"]
                for p in planners:
                    row[f"{p}_gap"] = None if row[p] is None or ref is None else round(100 * (row[p] / ref - 1), 9) + 0.0
                rows.append(row)
    return rows


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
        models = [m for m in FULL + QUICK if m[0] in wanted]
        if not models:
            ap.error(f"--models: none of {wanted} in {[m[0] for m in FULL + QUICK]}")
    rows = run(models, PRESETS_QUICK if args.quick else PRESETS_FULL, planners)

    def fmt(v):
        return "-" if v is None else f"{v:.3f}x"

    table = []
    for r in rows:
        exact_s = f" / {r['optimum_s']:.1f}" if "optimum_s" in r else ""
        table.append([r["model"], r["hardware"], f"1/{round(1 / r['fraction'])}", r["activations"],
                      *(fmt(r[p]) if r[p] is not None else "fails" for p in planners),
                      fmt(r["optimum"]), "none fits" if r["no_plan_fits"] else fmt(r["bound"]),
                      *("-" if r[f"{p}_gap"] is None else f"{r[f'{p}_gap']:.1f}%" for p in planners),
                      " / ".join(f"{r[f'{p}_s']:.1f}" for p in planners) + f" / {r['bound_s']:.2f}" + exact_s])
    print("Simulated step time relative to in-core (analytic cost model, not measured); gap to the optimum "
          "where known, else to the lower bound:")
    print(tabulate(table, headers=["model", "hardware", "limit", "acts", *planners, "optimum", "bound",
                                   *(f"gap {p}" for p in planners),
                                   "planning CPU s (" + " / ".join(planners) + " / bound / exact)"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"simulated": True, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
