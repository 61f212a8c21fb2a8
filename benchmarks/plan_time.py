"""The default planner's planning time on this machine beside the sweep's saved figures.

Plans some rows of ``results/planners_sweep.json`` again (GPT-2 at 12 and 48 layers over H100
PCIe5, at the floor and half way to in-core, by default) with ``local``, and times a plain Python
loop beside them, so that planning times measured on machines of different speeds can be set
side by side (benchmarks/PLANNERS.md, "Planning time"). The planner's budget is counted in work
units, not seconds: where the graph is the one the sweep planned (same ops, same limit), the
plan's step time must equal the saved one (``same_plan``).

    python benchmarks/plan_time.py [--models gpt2-12L,gpt2-48L] [--presets h100-pcie5]
                                   [--points 0,0.5] [--repeat 1] [--out FILE]

With ``--repeat N`` each row is planned N times in turn and its time is the least (a busy
machine only adds to it; every run must plan the same step time).

Each row is written to ``--out`` as it ends (a run stopped by a timeout keeps what it planned).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import fxpooch
from fxpooch.errors import InfeasibleMemoryLimit

sys.path.insert(0, os.path.dirname(__file__))
from planners_sweep import DEFAULT, bases, limit_at  # noqa: E402

SWEEP = os.path.join(os.path.dirname(__file__), "results", "planners_sweep.json")
#: iterations of :func:`loop_seconds`' loop: about 1 to 2 s of CPU on a 2020s server core
LOOP = 10_000_000


def loop_seconds(n: int = LOOP) -> float:
    """CPU seconds of a plain Python loop of ``n`` additions: the machine's interpreter speed."""
    t0 = time.process_time()
    total = 0
    for i in range(n):
        total += i
    return time.process_time() - t0


def machine() -> dict:
    """The interpreter, torch, transformers (None: the sweep's GPT-2 rows are then fxpooch's own
    decoder, another graph) and the machine, with its Python speed."""
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": hf,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "loop_s": loop_seconds(),
            "loop_iterations": LOOP}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-12L,gpt2-48L")
    ap.add_argument("--presets", default="h100-pcie5")
    ap.add_argument("--points", default="0,0.5")
    ap.add_argument("--repeat", type=int, default=1, help="plans per row; its CPU time is the least")
    ap.add_argument("--out", default=None, help="JSON to write (default: print only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with open(SWEEP) as f:
        saved = {(r["model"], r["hardware"], r["point"]): r for r in json.load(f)["rows"]}
    wanted, presets = args.models.split(","), args.presets.split(",")
    points = [float(p) for p in args.points.split(",")]
    out = {"machine": machine(), "rows": []}
    print(f"machine: {out['machine']}", flush=True)
    if out["machine"]["transformers"] is None:
        print("transformers is not installed: GPT-2 is fxpooch's own decoder, not the sweep's graph "
              "(pip install fxpooch[thirdparty])", file=sys.stderr, flush=True)
    for name, hw, base, floor in bases(quick=False, only=set(wanted), presets=tuple(presets)):
        for point in points:
            limit = limit_at(base, floor, point)
            steps, times = set(), []
            for _ in range(max(1, args.repeat)):
                t0 = time.process_time()
                try:
                    step = fxpooch.replan(base, planner=DEFAULT, mem_limit=limit).step_time / base.in_core_time
                except InfeasibleMemoryLimit:
                    step = None
                times.append(time.process_time() - t0)
                steps.add(step)
            if len(steps) > 1:
                raise SystemExit(f"{name} {hw} {point}: the plan changed between runs ({sorted(map(str, steps))})")
            row = {"model": name, "hardware": hw, "point": point, "ops": len(base.graph.ops),
                   "limit": limit, DEFAULT: step, f"{DEFAULT}_s": min(times), f"{DEFAULT}_runs_s": times}
            old = saved.get((name, hw, point))
            if old is not None:
                row.update(saved_ops=old["ops"], saved_limit=old["limit"], saved=old[DEFAULT],
                           saved_s=old[f"{DEFAULT}_s"])
                same_row = (old["ops"], old["limit"]) == (row["ops"], limit)
                row["same_plan"] = old[DEFAULT] == step if same_row else None  # None: another graph
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
