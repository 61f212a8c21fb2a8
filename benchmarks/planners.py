"""How far are the planners from the optimum? One command: ``python benchmarks/planners.py [--quick]``.

For each model x hardware preset x limit (1/2, 1/3, 1/4 of the in-core peak) it plans with
``pooch``, ``superneurons`` and ``local`` on the SAME captured graph and costs, and reports the
simulated step time of each, the optimum (``exact``, for graphs of at most 9 activations) or the
in-core lower bound, the gap in percent and the planning time. All figures are simulated on the
analytic cost model of the named hardware; tracing runs on meta tensors (no memory used).
Writes benchmarks/results/planners.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(__file__))
import zoo  # noqa: E402

import fxpooch  # noqa: E402
from fxpooch.errors import InfeasibleMemoryLimit  # noqa: E402
from fxpooch.planners import PLANNERS, Evaluator, Problem  # noqa: E402
from fxpooch.planners.search import SearchOptions, lower_bound, plan_exact  # noqa: E402

FRACTIONS = (1 / 2, 1 / 3, 1 / 4)
FULL = [("resnet50", 64), ("vgg16", 32), ("alexnet", 128), ("gpt2", 4)]
QUICK = [("alexnet", 512), ("gpt2-2layer", 8)]
PRESETS_FULL = ("v100-pcie3", "v100-nvlink2", "h100-pcie5")
PRESETS_QUICK = ("v100-pcie3", "v100-nvlink2")


def build(name: str, batch: int):
    with torch.device("meta"):
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
            graph, costs = base.graph, base.profile.costs(base.graph)
            print(f"{name} b{batch} on {hw}: {len(graph.ops)} ops, {len(graph.activations)} activations, "
                  f"captured in {capture_s:.1f} s", file=sys.stderr)
            for frac in FRACTIONS:
                prob = Problem(graph, costs, int(base.in_core_peak_bytes * frac))
                row = {"model": name, "batch": batch, "hardware": hw, "fraction": round(frac, 3),
                       "ops": len(graph.ops), "activations": len(graph.activations)}
                for p in planners:
                    t0 = time.perf_counter()
                    try:
                        c = PLANNERS[p](prob)
                        row[p] = c.step_time / base.in_core_time
                    except InfeasibleMemoryLimit:
                        row[p] = None
                    row[f"{p}_s"] = time.perf_counter() - t0
                if len(graph.activations) <= SearchOptions().max_exact:
                    try:
                        row["reference"], row["reference_kind"] = plan_exact(prob).step_time / base.in_core_time, "optimum"
                    except InfeasibleMemoryLimit:
                        row["reference"], row["reference_kind"] = None, "optimum"
                else:
                    row["reference"], row["reference_kind"] = lower_bound(Evaluator(prob)) / base.in_core_time, "bound"
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models and two presets (about a minute)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "planners.json"))
    args = ap.parse_args(argv)
    planners = [p for p in ("pooch", "superneurons", "local") if p in PLANNERS]
    rows = run(QUICK if args.quick else FULL, PRESETS_QUICK if args.quick else PRESETS_FULL, planners)

    def fmt(v):
        return "fails" if v is None else f"{v:.3f}x"

    table = []
    for r in rows:
        ref = r["reference"]
        best = min((r[p] for p in planners if r[p] is not None), default=None)
        gap = None if ref is None or best is None else 100 * (best / ref - 1)
        table.append([r["model"], r["hardware"], f"1/{round(1 / r['fraction'])}", *(fmt(r[p]) for p in planners),
                      f"{fmt(ref)} ({r['reference_kind']})", "-" if gap is None else f"{gap:.1f}%",
                      " / ".join(f"{r[f'{p}_s']:.1f}" for p in planners)])
    print("Simulated step time relative to in-core (analytic cost model, not measured):")
    print(tabulate(table, headers=["model", "hardware", "limit", *planners, "optimum or bound", "gap of best",
                                   "planning s (" + " / ".join(planners) + ")"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"simulated": True, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
