"""GPU benchmark: fxpooch's planners (and code generators) against in-core, torch.compile in-core,
torch.compile's activation budget, ``save_on_cpu`` and full activation checkpointing, under a real
device-memory limit.

    python benchmarks/gpu.py                      # ResNet-50 fp32 + bf16 and GPT-2, 3 batches each
    python benchmarks/gpu.py --quick              # ResNet-50 fp32 and GPT-2, limit = 1/3 of in-core, the default planner (local) only
    python benchmarks/gpu.py --dry-run [--quick]  # no GPU: batches and floors planned on meta

The limit (``--limit``, 8 GiB) is enforced with ``torch.cuda.set_per_process_memory_fraction``
for every method but in-core, so an over-limit method really fails (reported "fails"). Batches
are chosen so that the measured in-core peak is 3x, 2x and 1.5x the limit. See benchmarks/GPU.md
for the columns and targets. Every figure comes from the GPU this runs on; nothing is simulated
except the "pred" columns (fxpooch's plan).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

import fxpooch
from fxpooch import _torch_compat as compat
from fxpooch import models as zoo
from fxpooch.codegen import CODEGENS
from fxpooch.memory import Margin
from fxpooch.units import format_bytes, parse_bytes

from streams import trace_step


log = logging.getLogger("fxpooch.bench.gpu")
HERE = Path(__file__).resolve().parent

RATIOS = (3.0, 2.0, 1.5)  # in-core peak / limit; 3x first: the targets are there
SLOWDOWN_TARGET = {"resnet50": 1.15, "gpt2": 1.05}  # the default planner's step time / in-core at limit = in-core / 3
TIME_TOL, PEAK_TOL = 0.10, 0.05  # |pred - meas| / meas; meas <= pred <= (1 + PEAK_TOL) * meas
MODEL_DTYPES = {"resnet50": ("fp32", "bf16"), "gpt2": ("fp32",)}
FIT_BATCHES = {"resnet50": (8, 16), "gpt2": (1, 2)}  # in-core peak measured here, then extrapolated
CUDA_MARGIN = Margin.default_for("cuda")  # what compile keeps free on the GPU; --dry-run plans on meta with it
#: segments that grow and shrink in place: under a capped allocator, the default fixed-size segments
#: left fxpooch's ResNet-50 plan (8 GiB limit, 5% margin) out of memory at an allocated peak under the limit
ALLOC_CONF = "expandable_segments:True"
NO_CUDA = "benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run to plan on meta"


@dataclass(frozen=True)
class Config:
    """One model, dtype ("fp32", or "bf16" autocast), batch and limit; ratio: nominal in-core peak / limit."""

    model: str
    dtype: str
    batch: int
    ratio: float
    limit: int

    @property
    def name(self) -> str:
        return f"{self.model}-{self.dtype}"


class WithLoss(nn.Module):
    """``net(x)`` then mean cross-entropy against ``y``, inside the module so every method (and
    fxpooch's plan) covers the loss. Written as log_softmax + gather (same value as
    F.cross_entropy), which also traces on the meta device."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = self.net(x).flatten(0, -2).float().log_softmax(-1)
        return -logp.gather(1, y.reshape(-1, 1)).mean()


class Checkpointed(nn.Module):
    """One block run under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: WithLoss) -> WithLoss:
    """Full activation checkpointing: every element of the net's Sequential/ModuleList children
    (ResNet's bottlenecks, GPT's decoder blocks) is checkpointed, in place."""
    for child in model.net.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            for i, block in enumerate(child):
                child[i] = Checkpointed(block)
    return model


def build(model: str, batch: int, device: str, gpt_layers: int) -> tuple[WithLoss, tuple[torch.Tensor, ...]]:
    """The model (seeded, same weights every time) and its ``(inputs, targets)``."""
    torch.manual_seed(0)
    with torch.device(device):
        if model == "resnet50":
            net, x = zoo.resnet50(), zoo.image_input(batch, device=device)
            y = torch.randint(zoo.IMAGENET_CLASSES, (batch,), device=device)
        else:
            net, x = zoo.gpt_decoder(n_layer=gpt_layers), zoo.token_input(batch, device=device)
            y = zoo.token_input(batch, seed=1, device=device)
    return WithLoss(net), (x, y)


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


# -- measuring ----------------------------------------------------------------------------------
def clean() -> None:
    """Free everything the previous method left (a compiled module's pinned pool dies with it):
    cached device and pinned memory."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    compat.empty_host_cache()
    torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def memory_cap(limit: int | None) -> Iterator[None]:
    """The caching allocator may hold at most ``limit`` bytes (None: no cap)."""
    if limit is None:
        yield
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def timed_steps(fn: Callable, model: nn.Module, inputs: tuple, dtype: str, cap: int | None, warmup: int,
                steps: int, around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                trace: Path | None = None) -> dict[str, Any]:
    """Median step time (CUDA events) and peaks of ``steps`` forward+backward steps after ``warmup``;
    ``issue_s``: the median host time to issue a step (near ``step_s``: the host, not the GPU, sets the pace);
    with ``trace``, one more step under the profiler: its Chrome trace there, ``streams`` its summary."""
    params = list(model.parameters())

    def step() -> None:
        with autocast(dtype), around():
            loss = fn(*inputs)
        loss.backward()
        for p in params:
            p.grad = None

    clean()
    with memory_cap(cap):
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()  # parameters, inputs and what earlier steps left (workspaces)
        before = allocator_counts()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        issued = []
        for start, end in events:
            start.record()
            t0 = time.perf_counter()
            step()
            issued.append(time.perf_counter() - t0)
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
        after = allocator_counts()
        out = {"status": "ok", "step_s": statistics.median(times), "steps_s": times,
               "issue_s": statistics.median(issued), "peak": torch.cuda.max_memory_allocated(),
               "reserved": torch.cuda.max_memory_reserved(), "held": held, "allocator": {k: after[k] - before[k] for k in ALLOCATOR_COUNTS}}
        if trace is not None:  # after the measured steps: a trace that fails loses none of them
            try:
                out.update(streams=trace_step(step, trace), trace=str(trace))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory under the cap
                out["trace_error"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return out


#: caching-allocator events over the timed steps: a retry frees the cache (and synchronizes) to satisfy
#: an allocation, and device allocations or frees mean the cache did not hold the step's blocks
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def attempt(row: dict[str, Any], thunk: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
    """Run one method; an OOM under the cap is "fails", an infeasible plan "infeasible"."""
    t0 = time.perf_counter()
    try:
        row.update(thunk() or {})
    except torch.OutOfMemoryError as e:
        row.update(status="fails", error=" ".join(str(e).split())[:700], peak=torch.cuda.max_memory_allocated(),
                   reserved=torch.cuda.max_memory_reserved())
    except fxpooch.InfeasibleMemoryLimit as e:
        row.update(status="infeasible", floor=e.min_feasible_bytes)
    except Exception as e:  # noqa: BLE001 - one method failing must not stop the others
        log.exception("%s %s failed", row["config"], row["method"])
        row.update(status="error", error=" ".join(f"{type(e).__name__}: {e}".split())[:300])
    row["wall_s"] = time.perf_counter() - t0
    clean()
    row["leftover"] = torch.cuda.memory_allocated()  # bytes held after the method: constant, or something leaks
    log.info("%s %s b=%d: %s, step %s s, peak %s, reserved %s, pred %s s / %s, %.0f s wall", row["config"], row["method"],
             row["batch"], row["status"], row.get("step_s"), row.get("peak"), row.get("reserved"), row.get("pred_s"),
             row.get("pred_peak"), row["wall_s"])
    return row


# -- methods ------------------------------------------------------------------------------------
#: run in passes, each method over all configurations (3x first) before the next method, so the time
#: budget cuts the least important (on an H200, inductor's ResNet-50 row once took 270 s of a 265 s
#: budget, before GPT-2 had a row); fxpooch rows are "fxpooch:<planner>", or "fxpooch:<planner>
#: <codegen>" for a code generator but the default one (``fxpooch.codegen.CODEGENS``)
LEAD = "local"  # the default planner: first in every pass, and the one run with inductor too
INDUCTOR_LEAD = f"fxpooch:{LEAD} {CODEGENS[1]}"
PASSES = (("in-core", "torch.compile", f"fxpooch:{LEAD}", INDUCTOR_LEAD),
          ("save_on_cpu", "checkpoint", "torch.compile budget"))


class Run:
    """One benchmark invocation: options, deadline, rows, and each configuration's measured profile."""

    def __init__(self, args: argparse.Namespace, out: Path | None = None):
        self.args, self.out, self.started = args, out, time.time()
        self.deadline = time.monotonic() + args.time_budget if args.time_budget > 0 else float("inf")
        self.rows: dict[tuple[Config, str], dict[str, Any]] = {}
        # a profile's fingerprint does not see shapes, so one is only ever reused for its own batch, and
        # only by its own code generator (what runs, and so each op's time, depends on it)
        self.profiles: dict[tuple[Config, str], fxpooch.Profile] = {}

    @property
    def planners(self) -> list[str]:
        # "exact" is a reference for graphs of a few activations, not a planner for these models
        names = self.args.planners.split(",") if self.args.planners else [
            p for p in fxpooch.PLANNERS if p not in ("in-core", "exact")]
        return [LEAD] + [p for p in names if p != LEAD and p in fxpooch.PLANNERS]

    def run(self, cfgs: list[Config]) -> list[dict[str, Any]]:
        passes = [*PASSES, [f"fxpooch:{p}" for p in self.planners[1:]]]  # then the other planners
        for names in passes:  # each method for every configuration before the next method
            for name in names:
                for cfg in cfgs:
                    row = {"config": cfg.name, "model": cfg.model, "dtype": cfg.dtype, "batch": cfg.batch,
                           "ratio": cfg.ratio, "limit": cfg.limit, "method": name, "status": "skipped (time budget)"}
                    self.rows[cfg, name] = row
                    if name in self.args.skip:
                        row["status"] = "skipped (--skip)"
                    elif time.monotonic() < self.deadline:
                        attempt(row, lambda cfg=cfg, row=row: self.method(cfg, row))
                        self.save(list(self.rows.values()))  # a run stopped from outside keeps what it measured
        for cfg in cfgs:  # fxpooch's own prediction of the in-core step, next to the measured one
            lead, in_core = self.rows[cfg, f"fxpooch:{LEAD}"], self.rows[cfg, "in-core"]
            if "pred_in_core_s" in lead:
                in_core.update(pred_s=lead["pred_in_core_s"], pred_peak=lead["pred_in_core_peak"])
        rows = [self.rows[c, m] for c in cfgs for names in passes for m in names]
        judge(rows)
        self.save(rows)
        return rows

    def save(self, rows: list[dict[str, Any]]) -> None:
        """The JSON of ``rows`` so far (rewritten after every method); none without ``out``."""
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "fxpooch": fxpooch.__version__,
            "limit": self.args.limit, "args": vars(self.args),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "started": self.started,
            "duration_s": time.time() - self.started, "note": "measured on this GPU; pred_* are fxpooch's simulated plan",
            "targets": {"slowdown": SLOWDOWN_TARGET, "time_tol": TIME_TOL, "peak_tol": PEAK_TOL},
            "rows": rows,
            # each configuration's measured profile: fxpooch.Profile.from_json replays its plans anywhere
            "profiles": {f"{c.name} b={c.batch} {cg}": p.to_json() for (c, cg), p in self.profiles.items()}},
            indent=1, default=str))

    def method(self, cfg: Config, row: dict[str, Any]) -> dict[str, Any]:
        name, cap = row["method"], cfg.limit
        model, inputs = build(cfg.model, cfg.batch, "cuda", self.args.gpt_layers)
        if name.startswith("fxpooch:"):
            planner, _, cg = name.removeprefix("fxpooch:").partition(" ")
            return self.fxpooch(cfg, planner, cg or CODEGENS[0], model, inputs, row)
        if name == "torch.compile budget":
            return self.compile_budget(cfg, model, inputs, row)
        if name == "in-core":
            return self.steps(model, model, inputs, cfg, None, trace=self.trace_path(cfg, name))
        if name == "torch.compile":  # inductor, in-core (uncapped, as in-core is)
            fn = torch.compile(compat.fresh_entry(model, f"bench_{cfg.name}_{cfg.batch}_compile".replace("-", "_")))
            return self.steps(fn, model, inputs, cfg, None)
        if name == "save_on_cpu":
            return self.steps(model, model, inputs, cfg, cap,
                              around=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        model = checkpoint_blocks(model)
        return self.steps(model, model, inputs, cfg, cap)

    def steps(self, fn: Callable, model: nn.Module, inputs: tuple, cfg: Config, cap: int | None, **kw) -> dict:
        return timed_steps(fn, model, inputs, cfg.dtype, cap, self.args.warmup, self.args.steps, **kw)

    def trace_path(self, cfg: Config, method: str) -> Path | None:
        """Where ``--trace-dir`` keeps the profiler trace of ``method``'s step in ``cfg`` (None: no traces)."""
        if not self.args.trace_dir:
            return None
        return Path(self.args.trace_dir) / re.sub(r"[^A-Za-z0-9.]+", "-", f"{cfg.name}-{cfg.batch}-{method}.json.gz")

    def fxpooch(self, cfg: Config, planner: str, cg: str, model: WithLoss, inputs: tuple, row: dict[str, Any]) -> dict:
        t0 = time.perf_counter()
        clean()
        # captured and profiled under the cap too: capture holds no activations, the profile is per node
        with memory_cap(cfg.limit), autocast(cfg.dtype):
            cm = fxpooch.compile(model, inputs, cfg.limit, codegen=cg, planner=planner,
                                      profile=self.profiles.get((cfg, cg), "measure"))
            row["compile_peak"] = torch.cuda.max_memory_allocated()
        plan = cm.plan
        self.profiles.setdefault((cfg, cg), plan.profile)
        row.update(plan_s=time.perf_counter() - t0, pred_s=plan.step_time, pred_peak=plan.peak_bytes,
                   pred_static_peak=plan.static_peak_bytes, pred_in_core_s=plan.in_core_time,
                   pred_in_core_peak=plan.in_core_peak_bytes, counts=plan.counts(), resident=plan.graph.resident_bytes,
                   margin=plan.margin_bytes, profile=plan.profile.source, host_bytes=plan.host_bytes,
                   link=plan.profile.link.to_json(), releases=len(plan.releases))
        out = self.steps(cm, model, inputs, cfg, cfg.limit, trace=self.trace_path(cfg, row["method"]))
        if planner == LEAD:
            # the same plan without the cap (what the capped allocator costs it), then capped with every
            # offloaded buffer freed by record_stream instead of in stream order (what the releases save)
            keys = ("step_s", "issue_s", "peak", "reserved", "allocator")
            out["uncapped"] = {k: v for k, v in self.steps(cm, model, inputs, cfg, None).items() if k in keys}
            cm.runtime.stream_ordered = False
            try:
                out["record_stream"] = {k: v for k, v in self.steps(cm, model, inputs, cfg, cfg.limit).items()
                                        if k in keys}
            except torch.OutOfMemoryError as e:
                out["record_stream"] = {"status": f"out of memory: {str(e)[:200]}"}
            finally:
                cm.runtime.stream_ordered = True
        return {**out, "host_pool": cm.host_pool_bytes}

    def compile_budget(self, cfg: Config, model: WithLoss, inputs: tuple, row: dict[str, Any]) -> dict:
        """torch.compile (inductor) with activation_memory_budget bisected until its measured peak
        reaches the default planner's lowest measured peak over its code generators (the limit where it did not run)."""
        lead, in_core = self.rows[cfg, f"fxpooch:{LEAD}"], self.rows[cfg, "in-core"]
        peaks = [r["peak"] for r in (lead, self.rows[cfg, INDUCTOR_LEAD]) if r["status"] == "ok"]
        target = min(peaks, default=cfg.limit)
        peak_in, resident = in_core.get("peak", int(cfg.ratio * cfg.limit)), lead.get("resident", 0)
        lo, hi = 0.0, 1.0
        budget = min(1.0, max(0.02, (target - resident) / max(1, peak_in - resident)))
        tried: list[tuple[float, int | None]] = []
        for _ in range(self.args.budget_iters):
            compat.reset_compile_caches()
            fn = torch.compile(model)
            with compat.activation_memory_budget(budget):
                try:
                    peak = timed_steps(fn, model, inputs, cfg.dtype, None, 1, 1)["peak"]
                except torch.OutOfMemoryError:
                    peak = None
            tried.append((budget, peak))
            lo, hi = (budget, hi) if peak is not None and peak <= target else (lo, budget)
            if lo >= 1.0 or hi - lo < 0.01 or time.monotonic() > self.deadline:
                break
            budget = (lo + hi) / 2
        best = max((b for b, p in tried if p is not None and p <= target), default=min(b for b, _ in tried))
        if best != tried[-1][0]:  # dynamo was reset since: compile the chosen budget again
            compat.reset_compile_caches()
            fn = torch.compile(model)
        row.update(budget=best, budget_tried=tried, method=f"torch.compile budget={best:.3f}")
        with compat.activation_memory_budget(best):
            return self.steps(fn, model, inputs, cfg, cfg.limit)


# -- batches ------------------------------------------------------------------------------------
def fit_batches(model: str, limit: int, ratios: tuple[float, ...], peak_of: Callable[[int], int]
                ) -> tuple[list[int], tuple[float, float]]:
    """Batches whose in-core peak is ``ratio * limit``: peak(b) = a + s*b fitted at two small batches."""
    b1, b2 = FIT_BATCHES[model]
    p1, p2 = peak_of(b1), peak_of(b2)
    s = max(1.0, (p2 - p1) / (b2 - b1))
    a = p1 - s * b1
    return [max(1, round((r * limit - a) / s)) for r in ratios], (a, s)


def in_core_peak(model: str, dtype: str, gpt_layers: int, hardware: str | None) -> Callable[[int], int]:
    """One step's in-core peak at a batch: measured on CUDA, or fxpooch's in-core plan on meta (``hardware``)."""
    def peak(batch: int) -> int:
        net, inputs = build(model, batch, "meta" if hardware else "cuda", gpt_layers)
        if hardware:
            return fxpooch.plan(net, inputs, "1TiB", planner="in-core", hardware=hardware).in_core_peak_bytes
        return timed_steps(net, net, inputs, dtype, None, 1, 1)["peak"]
    return peak


def configs(args: argparse.Namespace, hardware: str | None = None) -> list[Config]:
    """The configurations to run; batches from in-core peaks measured (or, with ``hardware``, planned on meta)."""
    ratios = RATIOS[:1] if args.quick else RATIOS
    out: list[Config] = []
    for model in args.models:
        for dtype in MODEL_DTYPES[model][:1 if args.quick else None]:
            batches, (a, s) = fit_batches(model, args.limit, ratios, in_core_peak(model, dtype, args.gpt_layers, hardware))
            log.info("%s-%s in-core peak ~ %s + %s/sample", model, dtype, format_bytes(int(a)), format_bytes(int(s)))
            out += [Config(model, dtype, b, r, args.limit) for b, r in zip(batches, ratios)]
    return sorted(out, key=lambda c: -c.ratio)  # the 3x configs of every model first


def dry_run(args: argparse.Namespace) -> int:
    """Plan on meta (analytic ``--hardware`` costs): the configurations, each one's fxpooch floor and,
    with ``--dry-run-plan``, every planner's predicted peak and slowdown (slow on a CPU)."""
    rows, planners = [], Run(args).planners
    for cfg in configs(args, args.hardware):
        net, inputs = build(cfg.model, cfg.batch, "meta", args.gpt_layers)
        floor = 0
        try:
            fxpooch.plan(net, inputs, 1, hardware=args.hardware, margin=CUDA_MARGIN)
        except fxpooch.InfeasibleMemoryLimit as e:
            floor = e.min_feasible_bytes
        in_core = in_core_peak(cfg.model, cfg.dtype, args.gpt_layers, args.hardware)(cfg.batch)
        row = [cfg.name + (" (fp32 shapes)" if cfg.dtype == "bf16" else ""), cfg.batch, f"{in_core / cfg.limit:.2f}",
               format_bytes(floor), "yes" if floor <= cfg.limit else "NO (fxpooch rows: infeasible)"]
        planned = []
        for planner in planners if args.dry_run_plan else []:
            try:
                p = fxpooch.plan(net, inputs, cfg.limit, planner=planner, hardware=args.hardware, margin=CUDA_MARGIN)
                planned.append(f"{planner}: {format_bytes(p.peak_bytes)}, {p.step_time / p.in_core_time:.2f}x")
            except fxpooch.InfeasibleMemoryLimit as e:
                planned.append(f"{planner}: infeasible (floor {format_bytes(e.min_feasible_bytes)})")
        rows.append(row + (["; ".join(planned)] if planned else []))
    print(f"dry run on meta: limit {format_bytes(args.limit)}, analytic costs of {args.hardware} (simulated); "
          f"methods per configuration: in-core, torch.compile, fxpooch:{{{','.join(planners)}}}, {INDUCTOR_LEAD} "
          f"save_on_cpu, "
          "checkpoint, torch.compile budget")
    print(tabulate(rows, headers=["config", "batch", "in-core/limit", "fxpooch floor", "fits"]
                   + (["planned peak, predicted slowdown"] if args.dry_run_plan else [])))
    return 0


# -- report -------------------------------------------------------------------------------------
def judge(rows: list[dict[str, Any]]) -> None:
    """Throughput relative to in-core and the issue's pass/fail columns, in place."""
    in_core = {(r["config"], r["batch"]): r for r in rows if r["method"] == "in-core"}
    for r in rows:
        base = in_core.get((r["config"], r["batch"]), {})
        if r.get("status") == "ok" and base.get("status") == "ok":
            r["slowdown"] = r["step_s"] / base["step_s"]
            r["in_core_ratio"] = base["peak"] / r["limit"]
        if r["method"] in (f"fxpooch:{LEAD}", INDUCTOR_LEAD) and r["ratio"] == RATIOS[0]:
            r["target"] = SLOWDOWN_TARGET[r["model"]]
            r["slowdown_ok"] = "slowdown" in r and r["slowdown"] <= r["target"]
        if r["method"].startswith("fxpooch:") and r.get("status") == "ok":
            r["time_ok"] = abs(r["pred_s"] - r["step_s"]) <= TIME_TOL * r["step_s"]
            r["peak_ok"] = r["peak"] <= r["pred_peak"] <= (1 + PEAK_TOL) * r["peak"]


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "" if v is None else fmt.format(v)

    def ok(v: Any) -> str:
        return "" if v is None else ("PASS" if v else "FAIL")
    g = 2 ** 30
    out = [[r["config"], r["batch"], f(r.get("in_core_ratio"), "{:.2f}"), r["method"], r["status"],
            f(r.get("step_s") and 1e3 * r["step_s"], "{:.1f}"), f(r.get("slowdown") and 1 / r["slowdown"], "{:.3f}"),
            f(r.get("peak") and r["peak"] / g, "{:.2f}"), f(r.get("pred_s") and 1e3 * r["pred_s"], "{:.1f}"),
            f(r.get("pred_s") and r.get("step_s") and r["pred_s"] / r["step_s"], "{:.2f}"),
            f(r.get("pred_peak") and r["pred_peak"] / g, "{:.2f}"),
            f(r.get("pred_peak") and r.get("peak") and r["pred_peak"] / r["peak"], "{:.3f}"),
            f(r.get("target"), "<={:.2f}x"), ok(r.get("slowdown_ok")), ok(r.get("time_ok")), ok(r.get("peak_ok"))]
           for r in rows]
    return tabulate(out, headers=["config", "batch", "in-core/limit", "method", "status", "step ms", "thr vs in-core",
                                  "peak GiB", "pred ms", "pred/meas t", "pred peak GiB", "pred/meas peak",
                                  "target", "slowdown ok", f"time ±{TIME_TOL:.0%}", "peak >=meas,+5%"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="each model's first dtype, limit = in-core/3, the default planner (local) only")
    p.add_argument("--models", default="resnet50,gpt2", help="comma list of: " + ",".join(MODEL_DTYPES))
    p.add_argument("--limit", default="8GiB", help="device memory limit of every method but in-core (8GiB)")
    p.add_argument("--planners", default=None, help="comma list (default: all of fxpooch.PLANNERS but in-core and exact)")
    p.add_argument("--gpt-layers", type=int, default=12, help="decoder blocks of the GPT-2 model (12)")
    defaults = {"budget-iters": (3, 1, "torch.compile budget bisection steps"), "warmup": (2, 1, "warm-up steps"),
                "steps": (5, 3, "timed steps per method"),
                "time-budget": (480, 240, "seconds; later methods are 'skipped (time budget)'; 0 = no limit")}
    for flag, (full, quick, what) in defaults.items():
        p.add_argument(f"--{flag}", type=float if flag == "time-budget" else int, help=f"{what} ({full}; quick {quick})")
    p.add_argument("--alloc-conf", default=ALLOC_CONF,
                   help=f"PYTORCH_CUDA_ALLOC_CONF of every method ({ALLOC_CONF}; '' = the default allocator), "
                        "unless the environment already sets it")
    p.add_argument("--skip", default="", help="comma list of methods not to run, e.g. 'torch.compile,save_on_cpu' "
                   "(the names of the table's method column; 'torch.compile budget' for the bisected budget)")
    p.add_argument("--trace-dir", default=None,
                   help="write a profiler trace (Chrome JSON, gzipped) of one step of in-core and each fxpooch row "
                        "there, and its per-stream summary into the row (benchmarks/streams.py)")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/gpu-<device>.json)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: plan the configurations on meta and print them")
    p.add_argument("--dry-run-plan", action="store_true", help="with --dry-run: also run every planner on meta")
    p.add_argument("--hardware", default="h100-pcie5", help="analytic preset of --dry-run (h100-pcie5)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    q = args.quick
    args.models = [m for m in args.models.split(",") if m]
    args.skip = [m.strip() for m in args.skip.split(",") if m.strip()]
    if unknown := [m for m in args.models if m not in MODEL_DTYPES]:
        p.error(f"unknown model(s) {unknown}: choose from {list(MODEL_DTYPES)}")
    args.limit = parse_bytes(args.limit)
    args.planners = LEAD if q and args.planners is None else args.planners
    for flag, (full, quick, _) in defaults.items():
        if getattr(args, name := flag.replace("-", "_")) is None:
            setattr(args, name, quick if q else full)
    args.budget_iters = max(1, args.budget_iters)
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)  # read when CUDA's allocator starts, below
    device = torch.cuda.get_device_name()
    out = Path(args.out or HERE / "results" / f"gpu-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json")
    run = Run(args, out)
    rows = run.run(configs(args))
    print(f"{device}, torch {torch.__version__}, limit {format_bytes(args.limit)} "
          f"(set_per_process_memory_fraction; in-core runs uncapped)")
    print(table(rows))
    for r in rows:  # the lead's plan run otherwise (step ms, peak GiB): what the cap and the releases cost
        if r["method"] == f"fxpooch:{LEAD}" and r.get("status") == "ok":
            other = {k: r.get(k, {}) for k in ("uncapped", "record_stream")}
            print(f"{r['config']} b={r['batch']}: {r.get('releases')} of {r['counts'].get('swap', 0)} swaps released "
                  "in stream order; " + "; ".join(
                      f"{k} {1e3 * v['step_s']:.1f} ms, peak {v['peak'] / 2**30:.2f} GiB" if "step_s" in v
                      else f"{k} {v.get('status', 'not run')}" for k, v in other.items()))
    checks = [r[k] for r in rows for k in ("slowdown_ok", "time_ok", "peak_ok") if k in r]
    print(f"targets: {sum(checks)} pass, {len(checks) - sum(checks)} fail; {time.time() - run.started:.0f} s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
