"""``program_memory`` is the program-order memory of the schedule it does not build, exactly; the
evaluator builds no schedule for a plan it shows over the limit."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from stepgraphs import MiB, chain
from test_search import _two_graphs, problem

from fxpooch.footprint import program_memory
from fxpooch.planners import Evaluator
from fxpooch.planners import common
from fxpooch.planners.sharing import least_closures, partly_shared
from fxpooch.schedule import Decision, build_schedule
from fxpooch.segments import chain_inputs, member_owner, plan_recomputes
from fxpooch.simulator import static_memory

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


def _graphs():
    for name in ("mlp", "cnn_bn", "resnet_small", "transformer_block"):
        yield name, problem(name, 0.0).graph
    yield "two_graphs", _two_graphs("v100-pcie3")[0]


def _vectors(graph, count: int, seed: int):
    """Random realisable decision vectors, recompute-heavy ones among them (long shared chains)."""
    alone = Evaluator(common.Problem(graph, None, 0)).recomputable_alone
    rng = random.Random(seed)
    for i in range(count):
        weights = (1, 1, 1) if i % 2 else (1, 1, 4)
        yield [rng.choices([K, S if a.swappable else K, R if ok else K], weights)[0]
               for a, ok in zip(graph.activations, alone)]


@pytest.mark.parametrize("scratch", [False, True], ids=["no-scratch", "scratch"])
@pytest.mark.parametrize("name, graph", list(_graphs()), ids=lambda v: v if isinstance(v, str) else "")
def test_program_memory_is_the_static_memory_of_the_built_schedule(name, graph, scratch):
    if scratch:  # a few KiB of scratch on most ops, different per op
        graph = dataclasses.replace(graph, op_scratch=tuple((i * 7919) % 5 * 1024 for i in range(len(graph.ops))))
    n_forward = sum(stop - start for start, stop in graph.forward_range)
    shared = 0
    for i, decisions in enumerate(_vectors(graph, 60, seed=len(name))):
        share = i % 3 != 2
        schedule = build_schedule(graph, decisions, share=share)
        fp = program_memory(graph, decisions, share)
        np.testing.assert_array_equal(fp.memory, static_memory(schedule))
        assert fp.forward == n_forward + decisions.count(S)
        assert fp.shared == schedule.shared
        shared += schedule.shared
    if name not in ("mlp", "two_graphs"):  # chains that read one another: sharing was exercised
        assert shared > 0


def test_the_evaluator_builds_no_schedule_for_a_plan_over_the_limit(monkeypatch):
    """At the floor, keeping every activation is over the limit: its evaluation is Unjudged, built
    and simulated only when its schedule is read, and then the same as a fresh evaluator's."""
    prob = problem("transformer_block", 0.0)
    built = []
    real = common.build_schedule
    monkeypatch.setattr(common, "build_schedule", lambda *a, **k: built.append(1) or real(*a, **k))
    ev = Evaluator(prob)
    keep = ev.all_keep()
    c = ev.evaluate(keep, share=True)
    assert isinstance(c, common.Unjudged) and not c.fits and built == []
    assert int(c.program_memory.max()) + prob.graph.resident_bytes > prob.mem_limit
    # counted an eighth of a simulation until it is judged after all
    assert (ev.evaluations, ev.rejected, ev.simulations) == (1, 1, 1 // common.REJECTIONS_PER_SIMULATION)
    assert c.step_time > 0 and built == [1]  # read: built once
    assert (ev.evaluations, ev.rejected, ev.simulations) == (1, 0, 1)
    fresh = Evaluator(dataclasses.replace(prob, mem_limit=10 * prob.mem_limit)).evaluate(keep, share=True)
    assert c.schedule.instrs == fresh.schedule.instrs and c.step_time == fresh.step_time


@pytest.mark.parametrize("name, graph", list(_graphs()), ids=lambda v: v if isinstance(v, str) else "")
def test_program_memory_with_chains_apart(name, graph):
    """Chains set apart (``plan_recomputes(apart=...)``): the set is closed over readers, none of
    them is kept by another chain, all of them apart is the unshared schedule, and the program
    memory is still the built schedule's, exactly, with no copy held for sharing where none is
    shared."""
    readers = {c: [a for a in range(len(graph.activations)) if c in chain_inputs(graph, a, member_owner(graph))]
               for c in range(len(graph.activations))}
    rng = random.Random(len(name))
    held = 0
    for decisions in _vectors(graph, 40, seed=len(name) + 1):
        recomputed = [a for a, d in enumerate(decisions) if d is R]
        recomputes = plan_recomputes(graph, decisions, True, rng.sample(recomputed, len(recomputed) // 3))
        apart = recomputes.apart
        assert all(r in apart for a in apart for r in readers[a] if decisions[r] is R)
        assert not any(a in made[1:] for made in recomputes.materialises.values() for a in apart)
        schedule = build_schedule(graph, decisions, recomputes=recomputes)
        fp = program_memory(graph, decisions, True, recomputes)
        np.testing.assert_array_equal(fp.memory, static_memory(schedule))
        assert schedule.apart == apart
        shared = program_memory(graph, decisions, True)
        held += any(len(shared.copies.held_at(i)) for i in range(len(shared.memory)))
        every = plan_recomputes(graph, decisions, True, recomputed)
        alone = program_memory(graph, decisions, False)
        assert every.chains == alone.recomputes.chains and every.materialises == alone.recomputes.materialises
        np.testing.assert_array_equal(program_memory(graph, decisions, True, every).memory, alone.memory)
        assert not any(len(alone.copies.held_at(i)) for i in range(len(alone.memory)))
    if name not in ("mlp", "two_graphs"):  # copies were held for sharing: what apart sets release
        assert held > 0


@pytest.mark.parametrize("limit_mib, apart, memories", [(5, set(), 0), (4, {2, 3}, 1), (3, {0, 1, 2, 3}, 2)])
def test_chains_set_apart_in_part_from_the_last_copy_of_a_run(limit_mib, apart, memories):
    """Four recomputed 1 MiB activations a1..a4 of a chain (a_i's chain reads a_(i-1)). Shared, a4's
    chain at g4 rebuilds a1..a3 and holds them for their own readers: 5 MiB at its peak
    (a1..a4 and g4's gradient). Setting a_i apart sets apart a_i..a4 (their chains read it), so
    the sets are nested and only a3's, {a3, a4}, is tried: 4 MiB (a1 and a2 held, a3's chain runs
    again at g3). Under 3 MiB it misses, and the next peak holds a1 only: all four apart. There
    setting a2 apart first, {a2, a3, a4}, would have fitted with one fewer (3 MiB): the rule
    trades that for a memory per run of copies instead of one per copy."""
    graph, _ = chain([1] * 4, [1] * 4, [1] * 4, [(1, 1)] * 4)
    R = Decision.RECOMPUTE
    decisions = [R] * 4
    shared = program_memory(graph, decisions, True)
    assert int(shared.memory.max()) == 5 * MiB
    assert least_closures(graph, decisions, frozenset(), [0, 1, 2]) == [frozenset({2, 3})]
    assert least_closures(graph, decisions, frozenset({2, 3}), [0]) == [frozenset({0, 1, 2, 3})]
    recomputes, tried = partly_shared(graph, decisions, shared, lambda m: int(m.max()) <= limit_mib * MiB)
    assert (set(recomputes.apart), tried) == (apart, memories)
    fewer = program_memory(graph, decisions, True, plan_recomputes(graph, decisions, True, {1}))
    assert (set(fewer.recomputes.apart), int(fewer.memory.max())) == ({1, 2, 3}, 3 * MiB)
