"""What the allocator margin buys on a GPU: the default planner's plan for each share of the limit kept
free, run under the limit (``set_per_process_memory_fraction``), side by side in one process.

    python benchmarks/margin.py                                 # ResNet-50 b=300, GPT-2 b=10, 8 GiB
    python benchmarks/margin.py --shares 0.05,0.1 --models gpt2:10

A plan leaves ``share * limit`` free for what the caching allocator holds but cannot use. Too little,
and the capped allocator frees its cache to satisfy an allocation (``num_alloc_retries``; each waits for
the GPU); too much, and the plan swaps or recomputes more. The profile is measured once per model, at
the first share, and every later plan is made from it, so the plans differ by the margin alone.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
from tabulate import tabulate

import fxpooch
from fxpooch.memory import Margin
from fxpooch.units import parse_bytes

from gpu import ALLOC_CONF, autocast, build, clean, memory_cap, timed_steps

log = logging.getLogger("fxpooch.bench.margin")


def run(model_name: str, batch: int, limit: int, shares: list[float], steps: int) -> list[dict]:
    rows, profile = [], "measure"
    for share in shares:
        model, inputs = build(model_name, batch, "cuda", 12)
        clean()
        row = {"model": model_name, "batch": batch, "limit": limit, "share": share}
        try:
            with memory_cap(limit), autocast("fp32"):
                cm = fxpooch.compile(model, inputs, limit, profile=profile, margin=Margin(share))
            profile = cm.plan.profile
            row.update(pred_s=cm.plan.step_time, pred_peak=cm.plan.peak_bytes, margin=cm.plan.margin_bytes,
                       counts=cm.plan.counts(), in_core_s=cm.plan.in_core_time)
            row.update(timed_steps(cm, model, inputs, "fp32", limit, 2, steps))
            row["uncapped_s"] = timed_steps(cm, model, inputs, "fp32", None, 1, steps)["step_s"]
        except (torch.OutOfMemoryError, fxpooch.InfeasibleMemoryLimit) as e:
            row["status"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        log.info("%s", {k: v for k, v in row.items() if k != "steps_s"})
        rows.append(row)
        del model, inputs
        clean()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50:300,gpt2:10", help="comma list of model:batch")
    p.add_argument("--limit", default="8GiB")
    p.add_argument("--shares", default="0.05,0.1,0.15,0.2", help="margins, as shares of the limit")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    p.add_argument("--out", default=None, help="JSON of the rows")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        print("benchmarks/margin.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    limit, shares = parse_bytes(args.limit), [float(s) for s in args.shares.split(",")]
    rows = []
    for spec in args.models.split(","):
        name, batch = spec.split(":")
        rows += run(name, int(batch), limit, shares, args.steps)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"], "rows": rows},
                                             indent=1, default=str))
    gib = 2**30
    print(tabulate([[r["model"], r["batch"], f"{r['share']:.0%}", r.get("status", ""),
                     r.get("step_s") and f"{1e3 * r['step_s']:.1f}", r.get("uncapped_s") and f"{1e3 * r['uncapped_s']:.1f}",
                     r.get("pred_s") and f"{1e3 * r['pred_s']:.1f}", r.get("peak") and f"{r['peak'] / gib:.2f}",
                     r.get("reserved") and f"{r['reserved'] / gib:.2f}",
                     r.get("allocator", {}).get("num_alloc_retries"), r.get("counts")] for r in rows],
                   headers=["model", "batch", "margin", "status", "capped ms", "uncapped ms", "pred ms", "peak GiB",
                            "reserved GiB", "retries", "plan"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
