"""What is live on the GPU at a compiled step's peak, and who allocated it: the caching allocator's
history (``torch.cuda.memory._record_memory_history``) of one step of a ``tests/zoo.py`` model planned
at its floor, the blocks live at the peak listed with the Python frames that made them, next to the
plan's own count. Shows what a plan does not count (a library's workspace, a copy the code makes).

    python3 benchmarks/cuda_peak.py [--models mlp,transformer_block] [--top 12]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import fxpooch
from fxpooch.units import format_bytes

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from zoo import ZOO  # noqa: E402

HARDWARE = "h100-pcie5"


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, list[dict]]]]:
    """The most bytes allocated at once over ``trace`` (a snapshot's device trace) above its start,
    and the blocks allocated in the trace that were live then: (size, frames)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    now = peak = 0
    at_peak: list[tuple[int, list[dict]]] = []
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    return peak, sorted(at_peak, key=lambda b: -b[0])


def where(frames: list[dict]) -> str:
    """The innermost Python frames outside torch's own files (a generated graph's code, fxpooch, the
    model); the C++ frames the history also records come first and say less."""
    python = [f for f in frames if f.get("filename", "").endswith(".py") or f.get("filename", "").startswith("<eval")]
    mine = [f for f in python if "/torch/" not in f["filename"] or "fxpooch" in f["filename"]] or python
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in mine[:3]) or "(no frames)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,transformer_block")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cuda_peak.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in args.models.split(","):
        model, x = ZOO[name]()
        model, x = model.cuda(), x.cuda()
        try:
            fxpooch.plan(model, x, 1, profile="analytic", hardware=HARDWARE)
        except fxpooch.InfeasibleMemoryLimit as e:
            floor = e.min_feasible_bytes
        cm = fxpooch.compile(model, x, floor, profile="analytic", hardware=HARDWARE, peak_check_rounds=0)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            out = cm(x)
            out.backward(torch.ones_like(out))

        step()  # warm-up: pool blocks, library workspaces, lazy kernels
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        peak, blocks = live_at_peak(trace)
        resident = cm.plan.graph.resident_bytes
        print(f"== {name} at its floor {format_bytes(floor)}: plan peak {format_bytes(cm.plan.peak_bytes)} "
              f"({cm.plan.counts()}), measured {format_bytes(resident + torch.cuda.max_memory_allocated() - before)} "
              f"(resident {format_bytes(resident)} + the step's {format_bytes(peak)} from the trace; "
              f"{format_bytes(before)} allocated before the step)")
        for size, frames in blocks[:args.top]:
            print(f"  {format_bytes(size):>12}  {where(frames)}")
        others = sum(s for s, _ in blocks[args.top:])
        print(f"  {format_bytes(others):>12}  in {max(0, len(blocks) - args.top)} more blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
