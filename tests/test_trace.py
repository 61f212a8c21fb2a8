"""The Chrome trace (and the memory SVG) of a plan's simulated step."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import defaultdict

import pytest
import zoo

import fxpooch
from fxpooch.svg import memory_svg
from fxpooch.trace import LIMIT_COUNTER, MEMORY_COUNTER, chrome_trace, write_chrome_trace

HW = "v100-pcie3"
EPS_US = 1e-6  # float slack when comparing microsecond sums


@pytest.fixture(scope="module", params=["swap-all", "checkpoint-all", "pooch"])
def plan(request) -> fxpooch.Plan:
    model, x = zoo.resnet_small()
    limit = "1TiB" if request.param != "pooch" else 12 * 2**20  # pooch must mix decisions to fit
    return fxpooch.plan(model, x, limit, planner=request.param, profile="analytic", hardware=HW)


@pytest.fixture(scope="module")
def trace(plan, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("trace") / "plan.trace.json"
    assert write_chrome_trace(plan, path) == str(path)
    with open(path) as f:
        return json.load(f)


def test_trace_events_have_the_required_fields(trace):
    events = trace["traceEvents"]
    assert events
    for e in events:
        assert {"ph", "pid", "name"} <= set(e)
        if e["ph"] == "X":
            assert {"ts", "dur", "tid", "cat"} <= set(e) and e["dur"] > 0 and e["ts"] >= 0
        elif e["ph"] == "C":
            assert "ts" in e and all(isinstance(v, (int, float)) for v in e["args"].values())
        else:
            assert e["ph"] == "M"


def test_lanes_are_named(trace):
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    labels = " ".join(names.values())
    assert "compute" in labels and "D2H" in labels and "H2D" in labels
    x_tids = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert x_tids <= set(names)


def test_x_events_do_not_overlap_within_a_lane(trace):
    lanes = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lanes[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - EPS_US


def test_memory_counter_peaks_at_the_planned_peak(plan, trace):
    memory = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert max(memory) == plan.peak_bytes
    assert memory[0] == plan.graph.resident_bytes
    limits = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == LIMIT_COUNTER]
    assert limits and set(limits) == {plan.mem_limit}


def test_times_are_microseconds(plan, trace):
    ends = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(ends) == pytest.approx(plan.step_time * 1e6, rel=1e-9)


def test_decisions_show_on_their_lanes(plan):
    events = [e for e in chrome_trace(plan)["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in events}
    counts = plan.counts()
    assert ("offload" in cats and "prefetch" in cats) == (counts["swap"] > 0 and plan.host_bytes > 0)
    assert ("recompute" in cats) == (counts["recompute"] > 0)
    assert {"forward", "backward"} <= cats


def test_memory_svg(plan, tmp_path):
    path = tmp_path / "plan.svg"
    svg = memory_svg(plan, path)
    assert path.read_text() == svg
    root = ET.fromstring(svg)  # well-formed XML
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for label in ("limit", "in-core", "planned peak", "time (ms)", "device memory (MiB)", "D2H", "H2D"):
        assert label in text
    assert len([p for p in root.iter() if p.tag.endswith("path")]) >= 3  # in-core, plan fill, plan line


def test_trace_and_svg_name_the_module_of_each_copy(plan):
    model, _ = zoo.resnet_small()
    modules = dict(model.named_modules())
    copies = [e for e in chrome_trace(plan)["traceEvents"] if e.get("cat") in ("offload", "prefetch", "stall")]
    for e in copies:
        module = e["args"]["module"]
        assert module in modules and e["name"].endswith(f"{e['args']['activation']} ({module})")
    root = ET.fromstring(memory_svg(plan))
    tips = [t.text for t in root.iter() if t.tag.endswith("title")][1:]  # the first is the picture's title
    kinds = {"swap-all": ("offload", "prefetch"), "checkpoint-all": ("recompute",), "pooch": ("offload", "recompute")}
    for kind in kinds[plan.planner]:
        tip = next(t for t in tips if t.startswith(f"{kind}: "))
        name, _, module = tip.removeprefix(f"{kind}: ").split(",")[0].partition(" (")
        assert module.rstrip(" .)") in modules and name in plan.decisions
