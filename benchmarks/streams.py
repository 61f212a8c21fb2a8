"""What each CUDA stream did in one training step, from the PyTorch profiler's trace: where a step's
time goes when it is slower than its plan (compute stream idle, copies serialized, the host waiting).

    summary = trace_step(step, Path("trace.json.gz"))   # one step under torch.profiler, on a GPU
    summarize(json.load(open("trace.json")))            # the same figures from any Chrome trace

``summarize`` reads a Chrome trace (the profiler's ``export_chrome_trace``): per device stream, the
kernels and copies that ran there, their busy time (the union of their intervals) and the
stream's span; the step's span on the device; and the host's time in the CUDA runtime calls that
wait or allocate (synchronizations, ``cudaMalloc``/``cudaFree``, pinned allocations, event waits).
"""
from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: trace categories of device work
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: host runtime calls that wait for the device or allocate: their time says the host, not a stream, held the step
HOST_CALLS = ("Synchronize", "Malloc", "Free", "HostAlloc", "HostRegister", "StreamWaitEvent", "EventQuery")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals.

    >>> busy_us([(0, 10), (5, 12), (20, 25)])
    17
    """
    total, end = 0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Per stream (``"stream N"``): ``kernels``, ``copies`` (count and bytes per copy kind, e.g.
    ``"Memcpy DtoH (Device -> Pinned)"``), ``busy_ms`` and ``span_ms``; ``span_ms`` of all device
    work; ``host_calls``: count and milliseconds per runtime call named in :data:`HOST_CALLS`."""
    streams: dict[str, dict[str, Any]] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}
    host: dict[str, dict[str, float]] = {}
    first, last = float("inf"), float("-inf")
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat, name, ts, dur = ev.get("cat", ""), ev.get("name", ""), float(ev.get("ts", 0)), float(ev.get("dur", 0))
        if cat in DEVICE_CATEGORIES:
            key = f"stream {ev.get('args', {}).get('stream', '?')}"
            s = streams.setdefault(key, {"kernels": 0, "copies": {}})
            if cat == "kernel":
                s["kernels"] += 1
            else:
                c = s["copies"].setdefault(name, {"count": 0, "bytes": 0, "ms": 0.0})
                c["count"] += 1
                c["bytes"] += int(ev.get("args", {}).get("bytes", 0))
                c["ms"] += dur / 1e3
            intervals.setdefault(key, []).append((ts, ts + dur))
            first, last = min(first, ts), max(last, ts + dur)
        elif cat in ("cuda_runtime", "cuda_driver") and any(k in name for k in HOST_CALLS):
            h = host.setdefault(name, {"count": 0, "ms": 0.0})
            h["count"] += 1
            h["ms"] += dur / 1e3
    for key, ivs in intervals.items():
        streams[key]["busy_ms"] = busy_us(ivs) / 1e3
        streams[key]["span_ms"] = (max(e for _, e in ivs) - min(s for s, _ in ivs)) / 1e3
    return {"span_ms": max(0.0, last - first) / 1e3, "streams": streams, "host_calls": host}


def trace_step(step: Callable[[], None], path: Path) -> dict[str, Any]:
    """Run ``step`` once under the profiler (CPU and CUDA activities), write its Chrome trace
    gzipped to ``path`` and return :func:`summarize` of it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        summary = summarize(json.loads(raw.read_text()))
        path.parent.mkdir(parents=True, exist_ok=True)
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return summary
