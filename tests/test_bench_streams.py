"""benchmarks/streams.py: a step's per-stream busy time, copies and host waits, read from a Chrome
trace (hand-written below in the profiler's format; on a GPU the profiler writes it)."""
from __future__ import annotations

import pytest

from streams import busy_us, summarize


@pytest.mark.parametrize("intervals, expected", [
    ([], 0),
    ([(0, 10)], 10),
    ([(0, 10), (5, 12), (20, 25)], 17),  # overlap counted once, gap not at all
    ([(20, 25), (0, 10), (2, 3)], 15),  # unsorted, one inside another
    ([(0, 10), (10, 20)], 20),  # touching
])
def test_busy_time_is_the_union_of_intervals(intervals, expected):
    assert busy_us(intervals) == expected


def ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_streams_copies_and_host_waits_from_a_trace():
    d2h, h2d = "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pinned -> Device)"
    trace = {"traceEvents": [
        ev("kernel", "gemm", 100, 400, stream=7),
        ev("kernel", "relu", 600, 100, stream=7),  # compute stream: busy 500 of its 600 us span
        ev("gpu_memcpy", d2h, 300, 600, stream=20, bytes=1 << 20),
        ev("gpu_memcpy", d2h, 900, 100, stream=20, bytes=1 << 19),
        ev("gpu_memcpy", h2d, 1000, 200, stream=24, bytes=1 << 20),
        ev("cuda_runtime", "cudaStreamSynchronize", 50, 700),
        ev("cuda_runtime", "cudaStreamSynchronize", 800, 100),
        ev("cuda_runtime", "cudaLaunchKernel", 90, 5),  # neither waits nor allocates: not counted
        ev("cpu_op", "aten::mm", 80, 30),  # host op: not device work
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5000},  # not a complete event
    ]}
    s = summarize(trace)
    assert s["span_ms"] == pytest.approx(1.1)  # 100 us to 1200 us
    compute, out, back = s["streams"]["stream 7"], s["streams"]["stream 20"], s["streams"]["stream 24"]
    assert (compute["kernels"], compute["busy_ms"], compute["span_ms"]) == (2, pytest.approx(0.5), pytest.approx(0.6))
    assert out["copies"] == {d2h: {"count": 2, "bytes": 3 << 19, "ms": pytest.approx(0.7)}}
    assert (out["kernels"], out["busy_ms"]) == (0, pytest.approx(0.7))
    assert back["copies"][h2d]["bytes"] == 1 << 20
    assert s["host_calls"] == {"cudaStreamSynchronize": {"count": 2, "ms": pytest.approx(0.8)}}


def test_a_trace_without_device_work():
    assert summarize({"traceEvents": [ev("cpu_op", "aten::add", 0, 10)]}) == {
        "span_ms": 0.0, "streams": {}, "host_calls": {}}
