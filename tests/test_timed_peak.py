"""``simulate`` counts the timed peak as it makes each allocation; it must be the peak of the memory
curve its changes make in time order (``Timeline.memory``), exactly, however copies delay frees
and the limit makes allocations wait."""
from __future__ import annotations

import dataclasses

import pytest
from stepgraphs import MiB, build
from test_footprint import _vectors
from test_search import problem

from fxpooch.planners import Evaluator
from fxpooch.planners.common import Problem
from fxpooch.schedule import Decision, build_schedule
from fxpooch.simulator import simulate

K, S = Decision.KEEP, Decision.SWAP


@pytest.mark.parametrize("serial", [False, True], ids=["side-streams", "serial-copies"])
@pytest.mark.parametrize("scratch", [False, True], ids=["no-scratch", "scratch"])
@pytest.mark.parametrize("name, hardware", [("cnn_bn", "v100-pcie3"), ("resnet_small", "h100-pcie5"),
                                            ("transformer_block", "v100-pcie3")])
def test_the_timed_peak_is_the_peak_of_the_memory_curve(name, hardware, scratch, serial):
    prob = problem(name, 0.25, hardware)
    if serial:
        prob = dataclasses.replace(prob, costs=dataclasses.replace(prob.costs, serial_copies=True))
    graph, delayed, waited = prob.graph, 0, 0
    if scratch:  # 0 to 4 MiB taken and freed inside an op, different per op
        graph = dataclasses.replace(graph, op_scratch=tuple((i * 7919) % 5 * 2**20 for i in range(len(graph.ops))))
    for limit in (prob.mem_limit, 2 * prob.mem_limit):  # a tight limit: allocations wait for copies
        ev = Evaluator(Problem(graph, prob.costs, limit))
        for decisions in _vectors(graph, 30, seed=len(name)):
            candidate = ev.evaluate(decisions)
            if candidate is None:
                continue
            tl = candidate.timeline  # judged even where over the limit in program order
            curve = [nbytes for _, nbytes in tl.memory]
            assert tl.peak_bytes == max([graph.resident_bytes, *curve])
            times = [when for when, _ in tl.memory]
            assert times == sorted(times)
            delayed += tl.events != sorted(tl.events)  # a free after its reader, while a copy ran
            waited += simulate(graph, candidate.schedule, prob.costs).step_time < tl.step_time
    # serial copies end before compute goes on: no free comes late, no allocation waits
    assert (delayed > 0 and waited > 0) or serial


def test_frees_at_the_time_an_allocation_waits_for_are_counted_before_it():
    """a1 goes out over 10 s, a2 and a3 (0 s copies) queue behind it: all three buffers are free at
    11 s. ``big`` (10 MiB) needs two of them freed to fit 12 MiB, so it waits until 11 s; the third
    free comes at 11 s too, before it in time order, so the peak is 1 (a4) + 10 MiB, not 12."""
    graph, costs = build(
        [("a1", ["x"], 1, 1), ("a2", ["a1"], 1, 1), ("a3", ["a2"], 1, 1), ("a4", ["a3"], 1, 1),
         ("big", ["a4"], 1, 10), ("out", ["big"], 1, 0)],
        [("g4", ["a4"], 1), ("g3", ["a3"], 1), ("g2", ["a2"], 1), ("g1", ["a1"], 1)],
        {"a1": (10.0, 1.0), "a2": (0.0, 1.0), "a3": (0.0, 1.0)})
    schedule = build_schedule(graph, [S, S, S, K])
    tl = simulate(graph, schedule, costs, 12 * MiB)
    assert tl.start[[ins.op for ins in schedule.instrs].index(5)] == 11.0  # big (op 5) waited
    assert tl.peak_bytes == max(nbytes for _, nbytes in tl.memory) == 11 * MiB
