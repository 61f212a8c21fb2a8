"""The ``torch.compile`` backend with inductor: a step's measured peak with and without the check of
the caller's steps (``peak_check_rounds``), at the limits ``benchmarks/compile.py`` ran
``fxpooch.compile(..., codegen="inductor")`` at (its last results, ``results/compile-cpu.json``).

    python3 benchmarks/backend_check.py                 # both models; JSON in results/backend-check-cpu.json
    python3 benchmarks/backend_check.py --models cnn

Each configuration trains a fresh copy of the model through ``torch.compile(model,
backend=fxpooch.backend(limit, peak_check_rounds=r), dynamic=False)`` (analytic costs, the backend's
default) for ``--steps`` steps, then measures one more step's peak by the profiler's allocator events
(``benchmarks/memprofile.py``), resident bytes included. With the check (``r`` = 3) the row also lists
each measured plan's swaps, recomputes and peak, in order.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import fxpooch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from compile import build  # noqa: E402  (the models of the CPU benchmark)
from memprofile import profiled_memory  # noqa: E402

MiB = 2**20
CHECK_ROUNDS = (0, 3)  # off, and compile()'s default


def limits_of(model: str, results: Path) -> list[int]:
    rows = json.loads(results.read_text())["rows"]
    return sorted({r["mem_limit"] for r in rows if r["model"] == model and r["method"] == "fxpooch inductor"},
                  reverse=True)


def run(model_name: str, limit: int, rounds: int, steps: int) -> dict:
    base, inputs = build(model_name)
    resident = sum(t.untyped_storage().nbytes() for t in [*base.parameters(), *base.buffers(), *inputs])
    model = copy.deepcopy(base)
    backend = fxpooch.backend(limit, peak_check_rounds=rounds)
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    row = dict(model=model_name, limit=limit, rounds=rounds)
    t0 = time.process_time()
    try:
        for _ in range(steps):
            step()
    except fxpooch.InfeasibleMemoryLimit as e:
        return {**row, "infeasible": e.min_feasible_bytes}
    if any(c.result is None for c in backend.checks.values()):
        raise RuntimeError(f"{model_name} at {limit}: the check is not over after {steps} steps; raise --steps")
    with profiled_memory() as mem:
        step()
    return {**row, "cpu_s": time.process_time() - t0, "planned": backend.plan.peak_bytes,
            "counts": backend.plan.counts(), "measured": resident + mem.peak_bytes,
            "checked": [dict(counts=m.plan.counts(), peak=m.peak_bytes)
                        for c in backend.checks.values() for m in c.measured]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cnn", "gpt2"])
    p.add_argument("--steps", type=int, default=12, help="steps before the measured one (the check needs up to 11)")
    p.add_argument("--results", type=Path, default=HERE / "results" / "compile-cpu.json")
    p.add_argument("--out", type=Path, default=HERE / "results" / "backend-check-cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(m, limit, r, args.steps) for m in args.models for limit in limits_of(m, args.results)
            for r in CHECK_ROUNDS]
    args.out.write_text(json.dumps(dict(torch=torch.__version__, steps=args.steps, rows=rows), indent=1) + "\n")
    table = [[r["model"], f"{r['limit'] / MiB:.3f}", r["rounds"],
              f"infeasible: names {r['infeasible'] / MiB:.3f}" if "infeasible" in r else
              f"{r['measured'] / MiB:.3f}" + (" OVER" if r["measured"] > r["limit"] else ""),
              "" if "infeasible" in r else "{swap}/{recompute}".format(**r["counts"]),
              ", ".join(f"{c['counts']['swap']}/{c['counts']['recompute']}: {c['peak'] / MiB:.3f}"
                        for c in r.get("checked", []))] for r in rows]
    print(tabulate(table, headers=["model", "limit MiB", "check rounds", "measured MiB", "swap/rec",
                                   "plans measured by the check (swap/rec: MiB)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
