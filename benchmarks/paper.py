"""Reproduce the PoocH paper's evaluation (section 5) in simulation, on the analytic cost model.

    python benchmarks/paper.py            # every figure's points (about 15 minutes on 2 cores)
    python benchmarks/paper.py --quick    # fewer models and points

Every number is *simulated*: models are traced on the meta device (no memory, no arithmetic),
op times come from the roofline of the V100 presets (``v100-pcie3`` = the paper's x86 machine,
``v100-nvlink2`` = its POWER9 machine) and each plan is judged by fxpooch's timeline simulator
with ``mem_limit`` = the preset's 16 GiB. Prints tables and writes ``benchmarks/results/paper.json``.

* Fig. 15/16: speed of every planner relative to swap-all (w/o scheduling).
* Fig. 17/18: ResNet-50 images/s vs batch size; Fig. 21/22: ResNeXt-101 3D vs input size.
* Table 3: keep / swap / recompute counts, ResNet-50 batch 512.
* Planning time vs graph size.

Each plan runs in a forked worker, time-boxed (``--timeout``); a plan that exceeds the limit
prints "fails" (the paper's wording), one that runs out of time "timeout".
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # a checkout without install

from fxpooch.models import MODELS  # noqa: E402

from fxpooch import _torch_compat as compat  # noqa: E402
from fxpooch.errors import InfeasibleMemoryLimit  # noqa: E402
from fxpooch.hardware import get_hardware  # noqa: E402
from fxpooch.pipeline import TracedStep, plan_graph, profile_step, trace_step  # noqa: E402
from fxpooch.profile import Profile  # noqa: E402
from fxpooch.schedule import Decision, build_schedule  # noqa: E402
from fxpooch.simulator import simulate  # noqa: E402

log = logging.getLogger("fxpooch.bench.paper")

PRESETS = ("v100-pcie3", "v100-nvlink2")
FIG15_PLANNERS = ("swap-all-nosched", "swap-all", "swap-opt", "pooch", "superneurons", "checkpoint",
                  "checkpoint-all", "in-core")
FIG17_PLANNERS = ("in-core", "superneurons", "pooch")
#: activations at least this large count as "feature maps" (BN statistics and the like do not)
FEATURE_MAP_BYTES = 2**20
GiB = 2**30
#: Table 3 of the paper: (#keep, #swap, #recompute), ResNet-50 batch 512
PAPER_TABLE3 = {("pooch", "v100-pcie3"): (66, 12, 27), ("superneurons", "v100-pcie3"): (66, 21, 18),
                ("pooch", "v100-nvlink2"): (66, 36, 3), ("superneurons", "v100-nvlink2"): (66, 21, 18)}


@dataclass(frozen=True)
class Point:
    """One captured step (a model at one input size) and the planners run on it."""

    model: str
    batch: int
    params: dict
    figures: tuple[str, ...]
    planners: tuple[str, ...]

    @property
    def label(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.model}[b={self.batch}{extra}]"


def points(quick: bool) -> list[Point]:
    """What to capture and which planners to run on it, longest plans first (they overlap the
    captures that follow). ResNet-50 appears in Fig. 15/16 at 208 (in-core just over 16 GiB;
    swap-all fits on PCIe) and 384 (swap-all fits on NVLink only). --quick: no ResNeXt (its plans
    take minutes), no ResNet-50 in Fig. 15/16, three batch sizes in Fig. 17/18."""
    if quick:
        fig15, batches, video = [("alexnet", 4608), ("vgg16", 224)], (640, 512, 128), ()
    else:
        fig15 = [("resnet50", 384), ("resnet50", 208), ("alexnet", 4608), ("vgg16", 224)]
        batches, video = (640, 512, 384, 256, 128), ((128, 448), (128, 384), (128, 320))
    video_points = [Point("resnext101_3d", 1, {"frames": t, "image_size": s}, ("fig21",), FIG17_PLANNERS)
                    for t, s in video]
    merged: dict[tuple, Point] = {}
    for point in [*video_points[:2], *(Point("resnet50", b, {}, ("fig17",), FIG17_PLANNERS) for b in batches),
                  *(Point(m, b, {}, ("fig15",), FIG15_PLANNERS) for m, b in fig15), *video_points[2:]]:
        key = (point.model, point.batch, tuple(sorted(point.params.items())))
        if key in merged:  # one capture serves several figures
            old = merged[key]
            point = Point(old.model, old.batch, old.params, old.figures + point.figures,
                          tuple(dict.fromkeys(old.planners + point.planners)))
        merged[key] = point
    return list(merged.values())


# -- capture (main process) ----------------------------------------------------------------
def capture(point: Point) -> tuple[TracedStep, dict[str, Profile]]:
    """Trace one training step on meta tensors; analytic profiles for every preset."""
    spec = MODELS[point.model]
    with torch.device("meta"):
        model = spec.build()
        x = spec.make_input(point.batch, **point.params)
    step = trace_step(model, (x,), undo_copies=False)  # the bare step, as the paper plans it
    profiles = {p: profile_step(step, "analytic", hardware=p) for p in PRESETS}
    compat.reset_compile_caches()
    return step, profiles


# -- planning (forked workers, time-boxed) -------------------------------------------------
def _plan(conn, step: TracedStep, profile: Profile, limit: int, planner: str) -> None:
    """Worker body: plan, send a plain dict back."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out: dict = {}
    try:
        plan = plan_graph(step.graph, step.table, profile, limit, planner=planner)
        counts = {d.value: 0 for d in Decision}
        large = dict(counts)
        for d, act in zip(plan.schedule.decisions, step.graph.activations):
            counts[d.value] += 1
            if act.transfer_bytes >= FEATURE_MAP_BYTES:
                large[d.value] += 1
        out = {"status": "ok", "step_time": plan.step_time, "peak_bytes": plan.peak_bytes,
               "counts": counts, "counts_feature_maps": large}
    except InfeasibleMemoryLimit as e:
        out = {"status": "fails", "min_feasible_bytes": e.min_feasible_bytes}
    except Exception as e:  # reported, not fatal: the other planners still run
        out = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    out["cpu_s"] = time.process_time() - cpu0
    out["wall_s"] = time.perf_counter() - wall0
    conn.send(out)
    conn.close()


class Runner:
    """At most ``workers`` planning processes at a time, each killed after ``timeout`` seconds."""

    def __init__(self, workers: int, timeout: float):
        self.ctx = mp.get_context("fork")
        self.workers, self.timeout = workers, timeout
        self.queue: list[tuple[tuple, tuple]] = []
        self.running: dict[tuple, tuple] = {}  # key -> (process, conn, started)
        self.results: dict[tuple, dict] = {}
        self.submitted: list[tuple] = []  # the keys in the order asked, for a JSON that diffs

    def submit(self, key: tuple, step: TracedStep, profile: Profile, limit: int, planner: str) -> None:
        self.queue.append((key, (step, profile, limit, planner)))
        self.submitted.append(key)
        self.poll()

    def poll(self) -> None:
        now = time.perf_counter()
        for key, (proc, conn, started) in list(self.running.items()):
            if conn.poll():
                self.results[key] = conn.recv()
            elif proc.is_alive() and now - started < self.timeout:
                continue
            elif proc.is_alive():
                proc.kill()  # our own worker, by its handle
                self.results[key] = {"status": "timeout", "cpu_s": None, "wall_s": now - started}
            else:
                self.results.setdefault(key, {"status": "error", "error": f"worker exit {proc.exitcode}"})
            proc.join()
            conn.close()
            del self.running[key]
        while self.queue and len(self.running) < self.workers:
            key, args = self.queue.pop(0)
            parent, child = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_plan, args=(child, *args), daemon=True)
            proc.start()
            child.close()
            self.running[key] = (proc, parent, time.perf_counter())

    def drain(self) -> None:
        while self.queue or self.running:
            self.poll()
            time.sleep(0.05)


# -- the run -------------------------------------------------------------------------------
def run(quick: bool, workers: int, timeout: float) -> dict:
    limit = {p: get_hardware(p).memory_bytes for p in PRESETS}
    runner = Runner(workers, timeout)
    meta: list[dict] = []
    t0 = time.perf_counter()
    for point in points(quick):
        c0 = time.perf_counter()
        step, profiles = capture(point)
        graph = step.graph
        info = {"label": point.label, "model": point.model, "batch": point.batch, "params": point.params,
                "figures": list(point.figures), "ops": len(graph.ops), "activations": len(graph.activations),
                "feature_maps": sum(a.transfer_bytes >= FEATURE_MAP_BYTES for a in graph.activations),
                "capture_s": time.perf_counter() - c0, "in_core": {}}
        keep = build_schedule(graph, [Decision.KEEP] * len(graph.activations))
        for p in PRESETS:
            tl = simulate(graph, keep, profiles[p].costs(graph))
            info["in_core"][p] = {"step_time": tl.step_time, "peak_bytes": tl.peak_bytes}
            for planner in point.planners:
                runner.submit((point.label, p, planner), step, profiles[p], limit[p], planner)
        meta.append(info)
        log.info("captured %s in %.1f s (%d ops)", point.label, info["capture_s"], info["ops"])
        runner.poll()
    runner.drain()
    results = [{"point": label, "preset": preset, "planner": planner, **runner.results[(label, preset, planner)]}
               for label, preset, planner in runner.submitted]
    return {"simulated": True, "cost_model": "analytic (roofline of the hardware preset)",
            "quick": quick, "presets": {p: {"mem_limit_bytes": limit[p], "link": get_hardware(p).link.name}
                                        for p in PRESETS},
            "feature_map_min_bytes": FEATURE_MAP_BYTES, "timeout_s": timeout, "workers": workers,
            "wall_s": time.perf_counter() - t0, "points": meta, "results": results}


# -- report --------------------------------------------------------------------------------
class Index:
    """Look-ups over a run's JSON: results by (point, preset, planner), points by figure."""

    def __init__(self, data: dict):
        self.data = data
        self.res = {(r["point"], r["preset"], r["planner"]): r for r in data["results"]}
        self.points = data["points"]

    def get(self, point: dict, preset: str, planner: str) -> dict:
        return self.res.get((point["label"], preset, planner), {"status": "not run"})

    def of(self, figure: str) -> list[dict]:
        """The figure's points, smallest input first."""
        return sorted((p for p in self.points if figure in p["figures"]),
                      key=lambda p: (p["model"], p["batch"], sorted(p["params"].items())))

    def time(self, point: dict, preset: str, planner: str) -> float | None:
        r = self.get(point, preset, planner)
        return r["step_time"] if r["status"] == "ok" else None


def _cell(r: dict, value: str) -> str:
    return value if r["status"] == "ok" else r["status"]


def _input(p: dict) -> str:
    if p["params"]:
        return f"{p['params']['frames']}x{p['params']['image_size']}^2"
    return str(p["batch"])


def render(data: dict) -> str:
    """Every table, as text (tabulate)."""
    ix, out = Index(data), []
    for preset in PRESETS:
        rows = []
        for p in ix.of("fig15"):
            base = ix.time(p, preset, "swap-all-nosched")
            row = [p["model"], p["batch"], f"{p['in_core'][preset]['peak_bytes'] / GiB:.1f}"]
            for planner in FIG15_PLANNERS:
                r, t = ix.get(p, preset, planner), ix.time(p, preset, planner)
                row.append(_cell(r, f"{base / t:.2f}" if base and t else f"{p['batch'] / t:.0f} img/s"
                                 if t else ""))
            rows.append(row)
        out.append(f"Fig. 15/16 (simulated, {preset}): speed relative to swap-all-nosched")
        out.append(tabulate(rows, ["model", "batch", "in-core GiB", *FIG15_PLANNERS], tablefmt="simple"))
    for fig, title, unit in (("fig17", "Fig. 17/18 ResNet-50 vs batch", "images/s"),
                             ("fig21", "Fig. 21/22 ResNeXt-101 3D (batch 1) vs input TxHxW", "clips/s")):
        for preset in PRESETS:
            rows = []
            for p in ix.of(fig):
                row = [_input(p), f"{p['in_core'][preset]['peak_bytes'] / GiB:.1f}"]
                for planner in FIG17_PLANNERS:
                    r, t = ix.get(p, preset, planner), ix.time(p, preset, planner)
                    row.append(_cell(r, f"{p['batch'] / t:.1f}" if t else ""))
                sn, po = ix.time(p, preset, "superneurons"), ix.time(p, preset, "pooch")
                row.append(f"{sn / po:.2f}" if sn and po else "")
                rows.append(row)
            out.append(f"\n{title} (simulated, {preset}, {unit})")
            out.append(tabulate(rows, ["input", "in-core GiB", *FIG17_PLANNERS, "pooch/superneurons"],
                                tablefmt="simple"))
    rows = []
    for p in [p for p in ix.of("fig17") if p["batch"] == 512]:
        for planner in ("pooch", "superneurons"):
            for preset in PRESETS:
                r = ix.get(p, preset, planner)
                fm = r.get("counts_feature_maps") or {}
                every = r.get("counts") or {}
                rows.append([planner, preset, *(fm.get(k, r["status"]) for k in ("keep", "swap", "recompute")),
                             "/".join(str(every.get(k, "-")) for k in ("keep", "swap", "recompute")),
                             "/".join(map(str, PAPER_TABLE3[(planner, preset)]))])
    out.append(f"\nTable 3 (simulated): ResNet-50 batch 512, feature maps >= {FEATURE_MAP_BYTES // 2**20} MiB")
    out.append(tabulate(rows, ["planner", "preset", "#keep", "#swap", "#recomp", "all k/s/r", "paper k/s/r"],
                        tablefmt="simple"))
    planners = list(dict.fromkeys(r["planner"] for r in data["results"]))
    rows = []
    for p in sorted(ix.points, key=lambda p: (p["ops"], p["model"], p["batch"], sorted(p["params"].items()))):
        row = [p["label"], p["ops"], p["activations"], f"{p['capture_s']:.1f}"]
        for planner in planners:
            rs = [ix.get(p, preset, planner) for preset in PRESETS]
            if all(r["status"] == "not run" for r in rs):
                row.append("")
            elif any(r["status"] == "timeout" for r in rs):
                row.append(f">{data['timeout_s']:.0f} (timeout)")
            else:
                row.append(f"{max(r['cpu_s'] for r in rs):.1f}")
        rows.append(row)
    out.append("\nPlanning time vs graph size (CPU seconds, slower preset; capture = trace + profile)")
    out.append(tabulate(rows, ["point", "ops", "activations", "capture s", *planners], tablefmt="simple"))
    out.append("\nPaper's qualitative findings (simulated)")
    out.append(tabulate([[f["finding"], _says(f), f["evidence"]]
                         for f in data["findings"]], ["finding", "reproduced", "evidence"], tablefmt="simple",
                        maxcolwidths=[36, None, 90]))
    out.append(f"\ntotal wall time {data['wall_s']:.0f} s ({data['workers']} workers, "
               f"{data['timeout_s']:.0f} s per plan)")
    return "\n".join(out)


def _verdict(finding: str, checks: list[bool], evidence: list[str]) -> dict:
    """``reproduced``: True (every case), False (none or only some; ``held`` says how many), None (no case)."""
    return {"finding": finding, "reproduced": all(checks) if checks else None, "held": sum(checks),
            "cases": len(checks), "evidence": "; ".join(evidence)}


def _says(f: dict) -> str:
    if f["reproduced"] is None:
        return "n/a"
    if f["reproduced"]:
        return "yes"
    return f"partly ({f['held']}/{f['cases']})" if f["held"] else "NO"


def findings(data: dict) -> list[dict]:
    """The paper's claims, checked against this run."""
    ix, out = Index(data), []
    order = ("swap-all-nosched", "swap-all", "swap-opt", "pooch")
    checks, ev = [], []
    for p in ix.of("fig15"):
        for preset in PRESETS:
            ts = [ix.time(p, preset, k) for k in order]
            floor = p["in_core"][preset]["step_time"] * (1 + 1e-9)  # nothing is faster than in-core
            # a plan already at in-core speed cannot be beaten: equal to it counts as the next step
            ok = all(t is not None for t in ts) and all(a > b or a <= floor for a, b in zip(ts, ts[1:]))
            checks.append(ok)
            ev.append(f"{p['model']}@{p['batch']}/{preset}: " + " > ".join(f"{t:.3f}" if t else "fails" for t in ts)
                      + f" (in-core {p['in_core'][preset]['step_time']:.3f})")
    out.append(_verdict("step time: swap-all-nosched > swap-all > swap-opt > pooch, or already at in-core "
                        "speed (Fig. 15/16)", checks, ev))
    checks, ev = [], []
    for p in ix.of("fig17") + ix.of("fig21"):
        for preset in PRESETS:
            if ix.time(p, preset, "in-core") is not None:
                continue
            sn, po = ix.time(p, preset, "superneurons"), ix.time(p, preset, "pooch")
            if po is None and ix.get(p, preset, "pooch")["status"] != "fails":
                continue  # timed out: no verdict
            checks.append(po is not None and (sn is None or po < sn))
            ev.append(f"{_input(p)}/{preset}: " + (f"{sn / po:.2f}x" if sn and po else
                                                   f"sn {ix.get(p, preset, 'superneurons')['status']}, "
                                                   f"pooch {ix.get(p, preset, 'pooch')['status']}"))
    out.append(_verdict("pooch faster than superneurons where in-core fails (Fig. 17/18, 21/22)", checks, ev))
    rec = {}
    for p in [p for p in ix.of("fig17") if p["batch"] == 512]:
        for preset in PRESETS:
            r = ix.get(p, preset, "pooch")
            if r["status"] == "ok":
                rec[preset] = r["counts_feature_maps"]["recompute"]
    out.append(_verdict("pooch recomputes more on PCIe than on NVLink (Table 3)",
                        [rec[PRESETS[0]] > rec[PRESETS[1]]] if len(rec) == 2 else [],
                        [f"{k}: {v} recomputed" for k, v in rec.items()]))
    largest = max(ix.of("fig17"), key=lambda p: p["batch"], default=None)
    checks, ev = [], []
    if largest is not None:
        for preset in PRESETS:
            sn, po = ix.get(largest, preset, "superneurons"), ix.get(largest, preset, "pooch")
            checks.append(sn["status"] == "fails" and po["status"] == "ok")
            ev.append(f"b={largest['batch']}/{preset}: superneurons {sn['status']}, pooch {po['status']}")
    out.append(_verdict("superneurons fails at the largest batch where pooch fits (Fig. 17)",
                        [any(checks)] if checks else [], ev))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer models and points")
    ap.add_argument("--workers", type=int, default=2, help="planning processes at a time")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per plan before it counts as 'timeout' (default 300, --quick 120)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "paper.json")
    ap.add_argument("--report", type=Path, metavar="JSON",
                    help="plan nothing: print the tables and findings of a saved run (and rewrite it)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    timeout = args.timeout or (120.0 if args.quick else 300.0)
    if args.report:
        data, args.out = json.loads(args.report.read_text()), args.report
    else:
        data = run(args.quick, max(1, args.workers), timeout)
    data["findings"] = findings(data)
    print(render(data))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
