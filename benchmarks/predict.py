"""How well the plan predicts a CPU step: predicted vs measured step time and peak.

    python benchmarks/predict.py                   # every model below, JSON in results/predict.json
    python benchmarks/predict.py --models gpt2 --rounds 3
    python benchmarks/predict.py --report results/predict.json   # re-print a saved run

For each model of :mod:`fxpooch.models` at a CPU-sized input (``MODELS`` below), with its loss
inside the compiled module: compile at an in-core limit with a measured profile (``profile="measure"``:
each node timed in situ on the thread clock, the median of its repeats, and the host copies timed on
this thread), then at 0.5x of the in-core peak with the same profile (at the smallest feasible limit
where 0.5x cannot fit: at these sizes the parameters and their gradients are most of a CNN's step).
Each model's steps are then timed right away, on one torch thread, in interleaved rounds (one step
of each configuration per round, so load from other processes falls on both alike); the figures
are the medians over rounds of the wall-clock step, of the thread's CPU time, and of the CPU time
inside the compiled graphs' calls (``in graphs``: what the profile times; the rest of a step is
dynamo's guards, AOTAutograd's wrappers and the autograd engine around them).

The thread clock does not count other processes' time slices, but their load still slows every op
(shared caches, memory bandwidth): a profile holds for the load it was made under, and on a shared
machine that drifts between compile time and the measurement. So each round also profiles the step
in situ once more, next to the steps it is compared with, and ``pred now`` is each plan's schedule
simulated again on the median of those round profiles: ``now/cpu`` judges the cost model (the
simulator, the per-op times, the host copies) under the same load as the steps, ``pred/cpu`` the
plan's own prediction, which also carries the drift since compile time. The wall clock can match
only on an idle machine (the ``load`` column: the 1-minute load average over the rounds).

The peak is measured by the tests' independent counter (``tests/measure.py``: live storages the
executed ops create, plus the resident ones) and compared with the plan's ``static_peak_bytes``
(copies instantaneous, as a CPU run is). Target: predicted / measured step time within 10%.
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
from fxpooch.profile import Profile
from fxpooch.simulator import simulate
from fxpooch.timing import ProfileOptions, measure_profile

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from fxpooch.capture import GraphPair  # noqa: E402
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
    graphs: list[float]  # thread CPU time inside the graph calls, per step


class GraphClock:
    """Thread CPU time spent inside the compiled graphs' calls (forward and backward), the part of a
    step the profile times; the rest is the Python, dynamo and autograd code around them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.forward, self.backward = GraphPair.call_forward, GraphPair.call_backward

    def __enter__(self) -> GraphClock:
        GraphPair.call_forward = self._timed(self.forward)
        GraphPair.call_backward = self._timed(self.backward)
        return self

    def __exit__(self, *exc: Any) -> None:
        GraphPair.call_forward, GraphPair.call_backward = self.forward, self.backward

    def _timed(self, call: Callable) -> Callable:
        def timed(pair: GraphPair, args: list) -> Any:
            c0 = time.thread_time()
            try:
                return call(pair, args)
            finally:
                self.seconds += time.thread_time() - c0
        return timed


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
    with GraphClock() as graphs:
        t0, c0 = time.perf_counter(), time.thread_time()
        cfg.compiled(*cfg.inputs).backward()
        cfg.wall.append(time.perf_counter() - t0)
        cfg.cpu.append(time.thread_time() - c0)
    cfg.graphs.append(graphs.seconds)
    zero(cfg.module)


def run(names: list[str], rounds: int) -> list[dict[str, Any]]:
    return [row for name in names for row in run_model(name, rounds)]


def run_model(name: str, rounds: int) -> list[dict[str, Any]]:
    """The model's configurations compiled, then stepped in interleaved rounds right away (the profile
    the plans were made from is seconds old, not minutes), each round also profiling the step in situ
    once more (:func:`profile_pass`)."""
    case = MODELS[name]
    torch.manual_seed(0)
    module, inputs = WithLoss(case.build()), case.inputs()
    in_core = fxpooch.compile(module, inputs, "1TiB", profile="measure")
    peak = in_core.plan.in_core_peak_bytes
    configs: list[Config] = []
    rows: list[dict[str, Any]] = []
    for share in SHARES:
        try:
            cm = in_core if share == 1.0 else fxpooch.compile(module, inputs, int(share * peak),
                                                               profile=in_core.plan.profile)
        except fxpooch.InfeasibleMemoryLimit as e:  # parameters and their gradients are most of the step
            print(f"{name} at {share:.1f}x: infeasible, at the floor ({e.min_feasible_bytes / peak:.2f}x)")
            cm = fxpooch.compile(module, inputs, e.min_feasible_bytes, profile=in_core.plan.profile)
        plan = cm.plan
        cfg = Config(name, share, cm, module, inputs, [], [], [])
        step(cfg)  # warm-up
        cfg.wall.clear(), cfg.cpu.clear(), cfg.graphs.clear()
        configs.append(cfg)
        rows.append({"model": name, "size": case.size, "asked": share,
                     "share": 1.0 if cm is in_core else plan.mem_limit / peak,
                     "in_core_peak": peak, "limit": plan.mem_limit,
                     "planned_peak": plan.static_peak_bytes, "measured_peak": measured_peak(cm, module, inputs),
                     "predicted_s": plan.step_time, "in_core_predicted_s": plan.in_core_time,
                     "counts": plan.counts(), "profile": plan.profile.source, "link": plan.profile.link.name})
        print(f"{name} at {share:.1f}x: planned {plan.counts()}", flush=True)
    traced = fxpooch.trace_step(module, inputs)
    samples: dict[str, list[float]] = {}
    loads = []
    for r in range(rounds):
        for cfg in configs:
            step(cfg)
        for key, seconds in profile_pass(traced, in_core.plan.profile).op_times.items():
            samples.setdefault(key, []).append(seconds)
        loads.append(os.getloadavg()[0])
        gc.collect()
        print(f"{name}: round {r + 1}/{rounds}", flush=True)
    now = Profile(in_core.plan.profile.source, in_core.plan.profile.link,
                  {key: statistics.median(s) for key, s in samples.items()}, in_core.plan.profile.fingerprint)
    for row, cfg in zip(rows, configs):
        plan = cfg.compiled.plan
        row["measured_s"] = statistics.median(cfg.wall)
        row["measured_cpu_s"] = statistics.median(cfg.cpu)
        row["measured_graphs_s"] = statistics.median(cfg.graphs)
        row["walls_s"], row["cpus_s"], row["graphs_s"] = cfg.wall, cfg.cpu, cfg.graphs
        row["load"] = statistics.median(loads)  # 1-minute load average over the rounds
        row["resimulated_s"] = simulate(plan.graph, plan.schedule, now.costs(plan.graph)).step_time
        row["ratio"] = row["predicted_s"] / row["measured_s"]
        row["ratio_cpu"] = row["predicted_s"] / row["measured_cpu_s"]
        row["ratio_now"] = row["resimulated_s"] / row["measured_cpu_s"]
        row["within_target"] = abs(row["ratio"] - 1) <= TARGET
        row["within_target_cpu"] = abs(row["ratio_cpu"] - 1) <= TARGET
    return rows


def profile_pass(traced: Any, made_with: Profile) -> Profile:
    """The traced step profiled in situ as ``compile`` profiled it (same clock and link), one timed run
    after a warm-up: in each round, next to the steps, so it meets the load they meet."""
    profile = measure_profile(traced.graph, traced.table, traced.inputs, made_with.link,
                              ProfileOptions("in-situ", repeats=1))
    if profile.fingerprint != made_with.fingerprint or profile.source != made_with.source:
        raise RuntimeError(f"the step traced again has other graphs or another clock ({profile.source}) than "
                           f"the plans' profile ({made_with.source})")
    return profile


def table(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    return tabulate([[r["model"], f"{r['share']:.2f}x", r["counts"], f"{r['predicted_s'] * 1e3:.1f}",
                      f"{r['measured_s'] * 1e3:.1f}", f"{r['measured_cpu_s'] * 1e3:.1f}",
                      f"{r['measured_graphs_s'] * 1e3:.1f}" if "measured_graphs_s" in r else "-",
                      f"{r['resimulated_s'] * 1e3:.1f}" if "resimulated_s" in r else "-", f"{r['ratio']:.3f}",
                      f"{r['ratio_cpu']:.3f}", f"{r['ratio_now']:.3f}" if "ratio_now" in r else "-", "yes" if r["within_target"] else "NO",
                      "yes" if r["within_target_cpu"] else "NO",
                      f"{r['planned_peak'] / mib:.2f}", f"{r['measured_peak'] / mib:.2f}",
                      f"{r['load']:.1f}" if "load" in r else "-"] for r in rows],
                    headers=["model", "limit", "keep/swap/recompute", "pred ms", "meas ms", "meas cpu ms", "in graphs cpu ms",
                             "pred now ms",
                             "pred/meas", "pred/cpu", "now/cpu", f"within {TARGET:.0%}", "cpu within", "planned MiB",
                             "measured MiB", "load"])


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
