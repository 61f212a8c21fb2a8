"""How far are the planners from the optimum? One command: ``python benchmarks/planners.py [--quick]``.

``--part gap``: for each model x hardware preset x limit (the floor, the smallest feasible limit,
and 1/4 and 1/2 of the way from it to the in-core peak) it plans with ``pooch``,
``superneurons`` and ``local`` on the SAME captured graph and costs, and reports the simulated
step time of each; the lower bounds: the cut bound (``planners/bounds.py``), its LP relaxation
(``planners/lp.py``) and the same model with integral decisions (``planners/milp.py``, HiGHS
stopped after ``MILP_SECONDS``: then its proved dual bound); the optimum where it is known:
the budgeted exact search (``search.exact_search``, ``EXACT_WORK`` op-simulations: a plan and a
proved bound, the optimum where nothing is left open; on graphs of at most
``EXACT_IN_GAP_UP_TO`` activations, larger ones with ``--part exact``), or a plan no slower than the best bound
(the bound proves it optimal); and the default planner's gap to the optimum (a range, from the
exact search's best plan to its proved bound, where the optimum stays open) and to the best
bound. Planning times are CPU seconds
of this process, so other load does not inflate them (HiGHS's limit is wall-clock).
Models: the test zoo (tests/zoo.py), GPT-2 at 2 and 6 layers (HuggingFace, as the sweep), an
8-layer convnet; ``--models a,b`` runs a subset (also ``resnet50``, ``gpt2``... of ``fxpooch.models``).
All figures are simulated on the analytic cost model of the named hardware; tracing runs on
meta tensors (no memory used). Writes benchmarks/results/planners.json and the gap table in
benchmarks/PLANNERS.md.

``--part sweep`` (also part of the default ``all``) runs ``planners_sweep.py``: the default
planner over GPT-2 depths, ResNet-50 and the test zoo at limits from the floor to in-core on
three presets, its gap to the best plan and the bound, and planning time vs graph size
(results/planners_sweep.json, results/planners_time.svg). The best plan counts the baselines and
``local`` with 8x its work on graphs of up to 4,500 ops (``planners_sweep.LONG``): what the
default budget leaves on the table; ``--part sweep-longer`` adds ``local`` with 64x its work on
the saved rows of graphs of up to 1,400 ops (``planners_sweep.LONGER``), counted the same way.
``--part sweep-planners``, ``--part sweep-bounds`` and ``--part sweep-long`` make the planners'
columns, the bound columns or the 8x search's again on the saved rows. Where the gap table ran the
same row (the test zoo and GPT-2 2L and 6L at the floor, 1/4 and 1/2), the sweep's bound is the
higher of its own and the gap table's (its MILP or exact search's proved bound), and the exact
search's plan counts among the best; ``--part sweep-summary`` reads the gap table again without
re-running the sweep.

``--part exact`` runs only the exact search on the rows of the saved gap part that have no
optimum and no exact search with today's settings (``exact_settings``), in ``--jobs`` processes,
and rewrites the JSON and the gap table in benchmarks/PLANNERS.md. ``--part bounds`` re-runs the cut, LP and MILP
bounds alone on every saved row (after the model changed), the same way; ``--part milp
--milp-seconds S`` the MILP alone with a longer time limit on the rows without an optimum where
it stopped at its limit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from itertools import groupby

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fxpooch import models as zoo  # noqa: E402
import planners_sweep  # noqa: E402
from gap_table import gap_table  # noqa: E402

import fxpooch  # noqa: E402
from fxpooch.errors import InfeasibleMemoryLimit  # noqa: E402
from fxpooch.pipeline import problem_of  # noqa: E402
from fxpooch.planners import PLANNERS, Evaluator  # noqa: E402
from fxpooch.planners.bounds import lower_bound  # noqa: E402
from fxpooch.planners.lp import Families, lp_lower_bound  # noqa: E402
from fxpooch.planners.milp import milp_lower_bound  # noqa: E402
from fxpooch.planners.search import SearchOptions, exact_search  # noqa: E402

POINTS = (0.0, 0.25, 0.5)  # limit = floor + point * (in-core - floor)
#: the budgeted exact search's work per row, in op-simulations (a simulation of an n-op step
#: counts n; a bound evaluated or an LP solved counts as a simulation): seconds to a few minutes
#: a row on this project's machine
EXACT_WORK = 3_000_000
#: the exact search prunes with the LP after probing (``planners/fixed.py``) on graphs of at most
#: this many activations, the ones the ``exact`` planner takes. On test:resnet_small's 29 it proves
#: the optimum 1/4 of the way to in-core over NVLink2 in 2,520 units of work (open after 15,079
#: without), but the four rows left open here stay open at the same bounds, at 750-950 CPU s a
#: row instead of 60-130; on GPT-2 2L's 49 a solve takes 5 to 40 s
EXACT_LP_UP_TO = SearchOptions().max_exact
#: the LP and the MILP run on graphs of at most this many activations (the cut bound on all)
MILP_UP_TO = 150
#: HiGHS's wall-clock limit per MILP; past it the bound it has proved is used (GPT-2 at 2 layers,
#: 49 activations, proves its floor's MILP in about 280 s)
MILP_SECONDS = 300.0
#: the MILP's model is built up to this many nonzeros (the LP's up to ``lp.MAX_NONZEROS``): at
#: GPT-2 6L's floors the one with the chains' work (``lp.CUT_CHAINS``, 2.8M) lifts the bound from
#: 1.111x in-core (``lp.LARGE``'s, proved) to 1.189x within 600 s, ``local`` 1.199x
MILP_NONZEROS = 3_000_000
#: the gap part runs the exact search on graphs of at most this many activations (the test zoo:
#: seconds to minutes a row); on larger ones, ``--part exact``
EXACT_IN_GAP_UP_TO = 30
TEST_ZOO = ["test:cnn_bn", "test:mlp", "test:resnet_small", "test:transformer_block"]
FULL = [("convnet-8", 32), ("gpt2-2L", 8), ("gpt2-6L", 8), *((name, 0) for name in TEST_ZOO)]
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
    if name in ("gpt2-2L", "gpt2-6L") or name.startswith("test:"):
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
            print(f"{name}{f' b{batch}' if batch else ''} on {hw}: {len(graph.ops)} ops, {len(graph.activations)} activations, "
                  f"captured in {capture_s:.1f} s", file=sys.stderr, flush=True)
            for point, limit in limits(base):
                row = {"model": name, "batch": batch, "hardware": hw, "point": point,
                       "fraction": limit / base.in_core_peak_bytes, "ops": len(graph.ops),
                       "activations": len(graph.activations)}
                row.update(planner_columns(base, limit, planners))
                row.update(bound_columns(base, limit))
                rows.append(row)
    return rows


def planner_columns(base, limit: int, planners) -> dict:
    """Each planner's simulated step relative to in-core (None: infeasible) and its CPU seconds."""
    out: dict = {}
    for p in planners:
        t0 = time.process_time()
        try:
            out[p] = fxpooch.replan(base, planner=p, mem_limit=limit).step_time / base.in_core_time
        except InfeasibleMemoryLimit:
            out[p] = None
        out[f"{p}_s"] = time.process_time() - t0
    return out


def refresh_planners(path: str, planners, only: set[str] | None) -> list[dict]:
    """The saved gap rows with the planners' columns made again (the bounds, MILP and exact search, which
    no planner's plan enters, stay as saved); the caller computes the gaps."""
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    for (name, batch, hw), todo in groupby(rows, key=lambda r: (r["model"], r["batch"], r["hardware"])):
        todo = [r for r in todo if only is None or name in only]
        if not todo:
            continue
        model, x = build(name, batch)
        base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hw)
        at = dict(limits(base))
        for r in todo:
            r.update(planner_columns(base, at[r["point"]], planners))
        print(f"{name} {hw}: planners re-run", file=sys.stderr, flush=True)
    return rows


def bound_columns(base, limit: int, exact: bool = True) -> dict:
    """The bounds relative to in-core (None where none ran or no plan fits), their CPU seconds, and
    (``exact``) the optimum where the exact search runs."""
    ic, n = base.in_core_time, len(base.graph.activations)
    out: dict = {}
    for key, fn in (("cut", lower_bound), ("lp", lp_lower_bound if n <= MILP_UP_TO else None),
                    ("milp", (lambda ev: milp_lower_bound(ev, MILP_SECONDS, MILP_NONZEROS)) if n <= MILP_UP_TO else None)):
        t0 = time.process_time()
        value = None if fn is None else fn(Evaluator(problem_of(base, limit)))
        if key == "milp" and value is not None:
            out["milp_proved"], out["milp_seconds"] = value.proved, MILP_SECONDS
            value = value.bound
        out[key] = None if value is None or value == math.inf else value / ic
        out[f"{key}_s"] = time.process_time() - t0
        if value == math.inf:
            out["no_plan_fits"] = True
    out.setdefault("no_plan_fits", False)
    out["bound_families"] = families_on()
    if not exact:
        return out
    if n <= EXACT_IN_GAP_UP_TO:
        out.update(exact_columns(base, limit))
    else:
        out["optimum"], out["optimum_from"] = None, None
    return out


def exact_settings(activations: int) -> dict:
    """How the exact search runs on a graph of ``activations``: its op-simulation budget, and the
    LP of ``planners/fixed.py`` at every node up to :data:`EXACT_LP_UP_TO` activations (at the
    floors only the LP lifts the bound: test:cnn_bn's PCIe5 floor is proved in 23,605 units of
    work with it, and stays at the root's bound after 32,258 without); with the LP, the families
    of inequalities its model has (``lp.Families``), after probing. Up to :data:`EXACT_IN_GAP_UP_TO`
    activations its evaluator shares recompute chains in part wherever the shared schedule is over
    the limit (``SearchOptions.exact_shares_in_part``; larger graphs, far from searched whole,
    spend the budget on more plans instead)."""
    lp_bounds = activations <= EXACT_LP_UP_TO
    out = {"work": EXACT_WORK, "lp_bounds": lp_bounds}
    if activations <= EXACT_IN_GAP_UP_TO:
        out["share_in_part"] = "always"
    if lp_bounds:
        out["families"] = families_on()
        out["probing"] = True
    return out


def families_on() -> list[str]:
    """The families of inequalities near the floor the LP and MILP have (``lp.Families``)."""
    return [f.name for f in dataclasses.fields(Families) if getattr(Families(), f.name)]


def exact_columns(base, limit: int) -> dict:
    """The budgeted exact search: its best plan and proved bound relative to in-core, the optimum
    where it proved one, its work and CPU seconds, and its settings."""
    ic = base.in_core_time
    settings = exact_settings(len(base.graph.activations))
    t0 = time.process_time()
    options = SearchOptions(lp_bounds=settings["lp_bounds"], exact_shares_in_part="share_in_part" in settings)
    res = exact_search(problem_of(base, limit), options,
                       work=max(1, settings["work"] // len(base.graph.ops)))
    best = None if res.best is None else res.best.step_time / ic
    return {"exact_best": best, "exact_bound": None if res.bound == math.inf else res.bound / ic,
            "exact_proved": res.proved, "exact_work": res.work, "exact_nodes": res.nodes,
            "exact_s": time.process_time() - t0,
            "exact_decisions": None if res.best is None else "".join(d.value[0] for d in res.best.decisions),
            "optimum": best if res.proved else None, "optimum_from": "exact" if res.proved and best else None,
            "exact_settings": settings}


def gaps(row: dict, planners) -> None:
    """Each planner's gap to the optimum and to the best bound; a plan (a planner's or the exact
    search's) that meets the bound is optimal. Where the optimum is open, ``_gap_low`` /
    ``_gap_high``: the gap to the fastest plan known (any planner's or the exact search's) and to
    the best bound (the optimum lies between)."""
    found = [row[p] for p in planners if row[p] is not None]
    proved = [row[k] for k in ("cut", "lp", "milp", "exact_bound") if row.get(k) is not None]
    row["bound"] = max(proved) if proved else None
    known = [v for v in (*found, row.get("exact_best")) if v is not None]
    if row["optimum"] is None and known and row["bound"] is not None and min(known) <= row["bound"] * (1 + 1e-9):
        row["optimum"], row["optimum_from"] = min(known), "bound"  # a plan meets a proved bound
    row["best_known"] = min(known) if known else None  # the fastest plan any planner or the exact search found
    for p in planners:
        for key, ref in (("gap", row["optimum"]), ("gap_bound", row["bound"]),
                         ("gap_low", row["optimum"] or row["best_known"]), ("gap_high", row["optimum"] or row["bound"])):
            row[f"{p}_{key}"] = None if row[p] is None or ref is None else round(100 * (row[p] / ref - 1), 9) + 0.0


def limits(base) -> list[tuple[float, int]]:
    """The gap part's limits: (point, bytes) from the floor towards the in-core peak."""
    floor = Evaluator(problem_of(base, base.in_core_peak_bytes)).floor().timeline.static_peak_bytes
    return [(point, int(floor + point * (base.in_core_peak_bytes - floor))) for point in POINTS]


def milp_columns(base, limit: int, seconds: float, before: dict) -> dict:
    """The MILP's bound again with a time limit of ``seconds``, where ``before`` (its row) has one
    that stopped at its limit: the higher of the two (both are proved bounds), its CPU seconds
    and the limit it ran with."""
    t0 = time.process_time()
    found = milp_lower_bound(Evaluator(problem_of(base, limit)), seconds, MILP_NONZEROS)
    bound = None if found.bound == math.inf else found.bound / base.in_core_time
    out = {"milp_s": time.process_time() - t0, "milp_seconds": seconds, "milp_proved": found.proved}
    if before.get("milp") is not None and (bound is None or before["milp"] > bound):
        bound, out["milp_proved"] = before["milp"], False
    return {**out, "milp": bound}


def _refresh_task(task: tuple) -> list[tuple[int, dict]]:
    """One model and preset of :func:`refresh`: the columns of ``part`` at each of its rows."""
    (name, batch, hw), (part, milp_seconds), rows = task
    torch.set_num_threads(1)
    model, x = build(name, batch)
    base = fxpooch.plan(model, x, "1TiB", planner="in-core", hardware=hw)
    at = dict(limits(base))
    out = []
    for i, point, before in rows:
        if part == "exact":
            out.append((i, exact_columns(base, at[point])))
            said = f"{out[-1][1]['exact_s']:.1f} s, proved {out[-1][1]['exact_proved']}"
        elif part == "milp":
            out.append((i, milp_columns(base, at[point], milp_seconds, before)))
            said = f"MILP {out[-1][1]['milp']} after {out[-1][1]['milp_s']:.1f} s, proved {out[-1][1]['milp_proved']}"
        else:
            out.append((i, bound_columns(base, at[point], exact=False)))
            said = f"MILP {out[-1][1]['milp_s']:.1f} s" if "milp_s" in out[-1][1] else ""
        print(f"{name} {hw} {point}: {said}", file=sys.stderr, flush=True)
    return out


def refresh(path: str, part: str, jobs: int, only: set[str] | None, rerun: bool = False,
            milp_seconds: float = MILP_SECONDS) -> list[dict]:
    """The saved gap rows' columns of ``part``, made again in ``jobs`` processes: ``exact``, on the
    rows that have no optimum and no exact search yet, or one run with other settings than
    :func:`exact_settings` gives now (``rerun``: every row, after the simulator or the LP /
    MILP's model changed);
    ``bounds``, the cut, LP and MILP bounds on every row; ``milp``, the MILP alone with a time
    limit of ``milp_seconds`` on the rows without an optimum where it stopped at its limit."""
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    tasks: dict[tuple, list] = {}
    for i, r in enumerate(rows):
        if only is not None and r["model"] not in only:
            continue
        stale = r["optimum"] is None and r.get("exact_settings") != exact_settings(r["activations"])
        stopped = r["optimum"] is None and r.get("milp") is not None and not r.get("milp_proved")
        if (part == "bounds" or (part == "milp" and stopped)
                or (part == "exact" and (rerun or stale) and r["activations"] <= MILP_UP_TO)):
            tasks.setdefault((r["model"], r["batch"], r["hardware"]), []).append((i, r["point"], r))
    models = f" --models {','.join(sorted(only))}" if only else ""
    if part == "exact":
        data["exact_command"] = (f"python benchmarks/planners.py --part exact (EXACT_WORK {EXACT_WORK:,} op-simulations "
                                 f"per row, the LP after probing at every node up to {EXACT_LP_UP_TO} activations)")
    elif part == "bounds":
        data["bounds_command"] = (f"python benchmarks/planners.py --part bounds{models} (MILP_SECONDS {MILP_SECONDS:g}, "
                                  f"MILP_NONZEROS {MILP_NONZEROS:,})")
    else:
        data["milp_command"] = f"python benchmarks/planners.py --part milp --milp-seconds {milp_seconds:g}{models}"
    smallest_first = sorted(((key, (part, milp_seconds), todo) for key, todo in tasks.items()), key=lambda t: (rows[t[2][0][0]]["ops"], t[0]))
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for done in pool.imap_unordered(_refresh_task, smallest_first):
            for i, cols in done:
                rows[i].update(cols)
            with open(path, "w") as f:  # each model and preset as it ends
                json.dump(data, f, indent=1)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models and fewer presets (a few minutes)")
    ap.add_argument("--models", help="comma list of the models to run (default: all of the chosen set)")
    ap.add_argument("--part", choices=("all", "gap", "sweep", "sweep-planners", "sweep-bounds", "sweep-long", "sweep-longer",
                                       "sweep-summary", "exact", "bounds", "milp", "planners"),
                    default="all",
                    help="gap: planners vs the optimum / bound; sweep: the default planner over models, "
                         "limits and presets, with planning time vs graph size; sweep-planners: the sweep's "
                         "planners alone on its saved rows (after a planner changed); sweep-bounds: the sweep's "
                         "bounds alone on its saved rows; sweep-long: on its saved rows, local at 8x its work alone "
                         "(part of the best plan); sweep-longer: the same at 64x, on graphs of up to 1,400 ops; "
                         "sweep-summary: the sweep's saved rows summarised again with the "
                         "gap table's bounds and exact plans; exact: the exact search "
                         "alone on the saved gap rows without an optimum; bounds: the bounds alone on the saved "
                         "gap rows (after the model changed); milp: the MILP alone, with --milp-seconds, on "
                         "the saved gap rows without an optimum where it stopped at its time limit; planners: the planners alone "
                         "on the saved gap rows (after a planner changed; the bounds stay)")
    ap.add_argument("--jobs", type=int, default=1, help="processes for --part exact, bounds and milp")
    ap.add_argument("--milp-seconds", type=float, default=MILP_SECONDS, help="with --part milp: HiGHS's time limit "
                    "per row (wall clock)")
    ap.add_argument("--rerun", action="store_true", help="with --part exact: every row, optimum or not "
                    "(after the simulator or the LP / MILP's model changed)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "planners.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    planners = [p for p in ("pooch", "superneurons", "local") if p in PLANNERS]
    if args.part in ("exact", "bounds", "milp", "planners"):
        only = set(args.models.split(",")) if args.models else None
        if args.part in ("exact", "bounds", "milp"):
            rows = refresh(args.out, args.part, args.jobs, only, args.rerun, args.milp_seconds)
        else:
            rows = refresh_planners(args.out, planners, only)
        for r in rows:
            gaps(r, planners)
        with open(args.out) as f:
            data = json.load(f)
        data["rows"] = rows
        if args.part == "planners":
            data["planners_command"] = "python benchmarks/planners.py --part planners" + (
                f" --models {args.models}" if args.models else "")
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        print(gap_table(rows, planners))
        write_gap_table(GAP_DOC, rows, planners)
        return 0
    if args.part in ("all", "sweep", "sweep-planners", "sweep-bounds", "sweep-long", "sweep-longer", "sweep-summary"):
        only = set(args.models.split(",")) if args.models and args.part != "all" else None
        planners_sweep.main(args.quick, os.path.join(os.path.dirname(args.out), "planners_sweep.json"), only,
                            part=args.part)
    if args.part in ("sweep", "sweep-planners", "sweep-bounds", "sweep-long", "sweep-longer", "sweep-summary"):
        return 0
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
    command = "python benchmarks/planners.py --part gap" + (" --quick" if args.quick else "")
    data = {"simulated": True, "command": command}
    if args.models and os.path.exists(args.out):  # the other models' rows stay
        rows = planners_sweep.merged(rows, args.out, list(dict.fromkeys(m[0] for m in FULL + QUICK + models)))
        with open(args.out) as f:
            data = {**json.load(f), "gap_command": f"{command} --models {args.models}"}
    print(gap_table(rows, planners))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**data, "rows": rows}, f, indent=1)
    write_gap_table(GAP_DOC, rows, planners)
    print(f"wrote {args.out}")
    return 0


GAP_DOC = os.path.join(os.path.dirname(__file__), "PLANNERS.md")
GAP_BEGIN, GAP_END = "<!-- planners-gap: begin -->", "<!-- planners-gap: end -->"


def write_gap_table(path: str, rows: list[dict], planners) -> None:
    """Replace the table between ``path``'s gap markers with one made from ``rows``."""
    note = ("`python benchmarks/planners.py --part gap` (benchmarks/results/planners.json; simulated on the analytic "
            f"cost model; * a MILP stopped at its time limit, its proved bound ({MILP_SECONDS:g} s, or where `--part "
            "milp` ran, the row's milp_seconds in the JSON); (bound) an optimum proved by the "
            "bound; the optimum column from `--part exact`, the exact search at "
            f"{EXACT_WORK:,} op-simulations per row, with the LP at every node on graphs of at most "
            f"{EXACT_LP_UP_TO} activations (after probing where the row's exact_settings say so): open, the best bound "
            "and the fastest plan known where the budget ran out, and local's gap to the optimum as the range they allow):")
    planners_sweep.replace_between(path, GAP_BEGIN, GAP_END, f"\n{note}\n\n{gap_table(rows, planners, markdown=True)}\n")


if __name__ == "__main__":
    sys.exit(main())
