"""The gap table of ``planners.py``: one row per model, preset and limit, the planners' simulated
step times relative to in-core beside the bounds, the optimum and the default planner's gaps."""
from __future__ import annotations

from tabulate import tabulate


def gap_table(rows: list[dict], planners, markdown: bool = False) -> str:
    """Simulated step times relative to in-core, the bounds, the optimum and the default's gaps."""
    def fmt(v):
        return "-" if v is None else f"{v:.3f}x"

    def pct(v):
        return "-" if v is None else f"{v:.1f}%"

    def optimum(r):
        if r["optimum"] is not None:
            return fmt(r["optimum"]) + ("" if r["optimum_from"] == "exact" else " (bound)")
        if r.get("exact_best") is None:
            return "-"
        return f"open: {r['bound']:.3f}-{r['best_known']:.3f}x"

    def local_gap(r):
        if r["local_gap"] is not None or r.get("local_gap_low") is None:
            return pct(r["local_gap"])
        return f"{r['local_gap_low']:.1f}-{r['local_gap_high']:.1f}%"

    table = []
    for r in rows:
        milp = "-" if r["milp"] is None else fmt(r["milp"]) + ("" if r.get("milp_proved") else "*")
        row = [r["model"], r["hardware"], f"{r['fraction']:.2f}", r["activations"],
               *(fmt(r[p]) if r[p] is not None else "fails" for p in planners),
               "none fits" if r["no_plan_fits"] else fmt(r["cut"]), fmt(r["lp"]), milp, optimum(r),
               local_gap(r), pct(r["local_gap_bound"]), "-" if r.get("exact_s") is None else f"{r['exact_s']:.1f}"]
        if not markdown:
            row.append(" / ".join(f"{r[f'{p}_s']:.1f}" for p in planners) + f" / {r['milp_s']:.1f}")
        table.append(row)
    headers = ["model", "hardware", "limit", "acts", *planners, "cut bound", "LP bound", "MILP bound", "optimum",
               "local gap to optimum", "local gap to bound", "exact CPU s"]
    if not markdown:
        headers.append("planning CPU s (" + " / ".join(planners) + " / MILP)")
    title = ("Simulated step time relative to in-core (analytic cost model, not measured); limit as a fraction of "
             "in-core, from the floor up; * a MILP stopped at its time limit (its proved bound); (bound) an "
             "optimum proved by the bound; open: the best bound and the fastest plan known where the exact search's budget ran out:")
    if markdown:
        return tabulate(table, headers=headers, tablefmt="github")
    return title + "\n" + tabulate(table, headers=headers)
