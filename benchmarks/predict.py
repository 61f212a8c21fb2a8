"""How well the plan predicts a CPU step: predicted vs measured step time and peak.

    python benchmarks/predict.py                   # every model below, JSON in results/predict.json
    python benchmarks/predict.py --models gpt2 --rounds 3
    python benchmarks/predict.py --report results/predict.json   # re-print a saved run

For each model of :mod:`fxpooch.models` at a CPU-sized input (``MODELS`` below), with its loss
inside the compiled module: compile at an in-core limit with a measured profile (``profile="measure"``:
each node timed in situ, the least of its repeats, and the host copies timed on this thread), then
at 0.5x of the in-core peak with the same profile (at the smallest feasible limit where 0.5x
cannot fit: at these sizes the parameters and their gradients are most of a CNN's step). Every step is timed on one torch thread, in
interleaved rounds (one step of every configuration per round, so load from other processes
falls on all of them alike); the figures are the medians over rounds of the wall-clock step and
of the thread's CPU time. The profile is timed on the thread clock with one torch thread
(:class:`fxpooch.profile.ProfileOptions`), so on a loaded machine the CPU-time ratio is the one to
judge: the wall clock then also counts the time other processes hold the core. The peak is measured by the tests' independent counter
(``tests/measure.py``: live storages the executed ops create, plus the resident ones) and compared
with the plan's ``static_peak_bytes`` (copies instantaneous, as a CPU run is). Target: predicted /
measured step time within 10%.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tabulate import tabulate

import fxpooch
from fxpooch import models as zoo

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from gpu import WithLoss  # noqa: E402  (the loss inside the compiled module, as benchmarks/gpu.py plans it)
from measure import HOST_OPS, StepCounter  # noqa: E402  (the independent memory counter of the tests)
from memcount import resident_bytes  # noqa: E402

TARGET = 0.10  # |predicted / measured - 1| of the step time
SHARES = (1.0, 0.5)  # limits as shares of the in-core peak
CLASSES = 10  # classification heads of the image and video models


@dataclass(frozen=True)
class Case:
    """A zoo model at a size one CPU core steps through in about a second or less."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    size: str


def _images(batch: int, size: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (zoo.image_input(batch, size), torch.randint(CLASSES, (batch,)))


GPT = dict(n_layer=6, d_model=256, n_head=4, seq=128, vocab=2048)
MODELS: dict[str, Case] = {
    "resnet50": Case(lambda: zoo.resnet50(CLASSES), _images(32, 64), "batch 32, 64x64"),
    "alexnet": Case(lambda: zoo.alexnet(CLASSES), _images(16, 128), "batch 16, 128x128"),
    "vgg16": Case(lambda: zoo.vgg16(CLASSES), _images(4, 64), "batch 4, 64x64"),
    "resnext101_3d": Case(lambda: zoo.resnext101_3d(num_classes=CLASSES), lambda: (zoo.video_input(2, 8, 32), torch.randint(CLASSES, (2,))),
                          "batch 2, 8x32x32"),
    "gpt2": Case(lambda: zoo.gpt_decoder(**GPT), lambda: (zoo.token_input(4, GPT["seq"], GPT["vocab"]),
                                                          zoo.token_input(4, GPT["seq"], GPT["vocab"], seed=1)),
                 "6 layers, d 256, vocab 2048, batch 4 x 128"),
}


@dataclass
class Config:
    model: str
    share: float
    compiled: Any
    module: nn.Module
    inputs: tuple
    wall: list[float]
    cpu: list[float]


def measured_peak(compiled: Any, module: nn.Module, inputs: tuple) -> int:
    counter = StepCounter(host_ops=HOST_OPS)
    counter.seed(module, inputs)
    resident = resident_bytes(module, list(inputs))
    with counter:
        compiled(*inputs).backward()
    zero(module)
    return resident + counter.peak_bytes


def zero(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def step(cfg: Config) -> None:
    t0, c0 = time.perf_counter(), time.thread_time()
    cfg.compiled(*cfg.inputs).backward()
    cfg.wall.append(time.perf_counter() - t0)
    cfg.cpu.append(time.thread_time() - c0)
    zero(cfg.module)


def run(names: list[str], rounds: int) -> list[dict[str, Any]]:
    configs: list[Config] = []
    rows: list[dict[str, Any]] = []
    for name in names:
        case = MODELS[name]
        torch.manual_seed(0)
        module, inputs = WithLoss(case.build()), case.inputs()
        in_core = fxpooch.compile(module, inputs, "1TiB", profile="measure")
        peak = in_core.plan.in_core_peak_bytes
        for share in SHARES:
            try:
                cm = in_core if share == 1.0 else fxpooch.compile(module, inputs, int(share * peak),
                                                                   profile=in_core.plan.profile)
            except fxpooch.InfeasibleMemoryLimit as e:  # parameters and their gradients are most of the step
                print(f"{name} at {share:.1f}x: infeasible, at the floor ({e.min_feasible_bytes / peak:.2f}x)")
                cm = fxpooch.compile(module, inputs, e.min_feasible_bytes, profile=in_core.plan.profile)
            plan = cm.plan
            cfg = Config(name, share, cm, module, inputs, [], [])
            step(cfg)  # warm-up
            cfg.wall.clear(), cfg.cpu.clear()
            configs.append(cfg)
            rows.append({"model": name, "size": case.size, "asked": share,
                         "share": 1.0 if cm is in_core else plan.mem_limit / peak,
                         "in_core_peak": peak, "limit": plan.mem_limit,
                         "planned_peak": plan.static_peak_bytes, "measured_peak": measured_peak(cm, module, inputs),
                         "predicted_s": plan.step_time, "in_core_predicted_s": plan.in_core_time,
                         "counts": plan.counts(), "profile": plan.profile.source, "link": plan.profile.link.name})
            print(f"{name} at {share:.1f}x: planned {plan.counts()}", flush=True)
    for r in range(rounds):
        for cfg in configs:
            step(cfg)
        gc.collect()
        print(f"round {r + 1}/{rounds}", flush=True)
    for row, cfg in zip(rows, configs):
        row["measured_s"] = statistics.median(cfg.wall)
        row["measured_cpu_s"] = statistics.median(cfg.cpu)
        row["walls_s"], row["cpus_s"] = cfg.wall, cfg.cpu
        row["ratio"] = row["predicted_s"] / row["measured_s"]
        row["ratio_cpu"] = row["predicted_s"] / row["measured_cpu_s"]
        row["within_target"] = abs(row["ratio"] - 1) <= TARGET
        row["within_target_cpu"] = abs(row["ratio_cpu"] - 1) <= TARGET
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    return tabulate([[r["model"], f"{r['share']:.2f}x", r["counts"], f"{r['predicted_s'] * 1e3:.1f}",
                      f"{r['measured_s'] * 1e3:.1f}", f"{r['measured_cpu_s'] * 1e3:.1f}", f"{r['ratio']:.3f}",
                      f"{r['ratio_cpu']:.3f}", "yes" if r["within_target"] else "NO",
                      "yes" if r["within_target_cpu"] else "NO",
                      f"{r['planned_peak'] / mib:.2f}", f"{r['measured_peak'] / mib:.2f}"] for r in rows],
                    headers=["model", "limit", "keep/swap/recompute", "pred ms", "meas ms", "meas cpu ms",
                             "pred/meas", "pred/cpu", f"within {TARGET:.0%}", "cpu within", "planned MiB",
                             "measured MiB"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "predict.json")
    ap.add_argument("--report", type=Path, help="print a saved run and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())["rows"]))
        return 0
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = run(args.models, args.rounds)
    result = {"torch": torch.__version__, "machine": platform.machine(), "cores": os.cpu_count(), "threads": 1,
              "rounds": args.rounds, "load_before": load, "load_after": os.getloadavg(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(table(rows))
    print(f"load average (1 min) before and after: {load[0]:.2f}, {result['load_after'][0]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
