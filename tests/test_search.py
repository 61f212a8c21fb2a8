"""The search planners: the exact optimum bounds the heuristics, local search never loses to PoocH."""
from __future__ import annotations

import pytest

import fxpooch
from fxpooch.planners import Evaluator, Problem, get_planner
from fxpooch.planners.search import SearchOptions, lower_bound, plan_exact
from zoo import ZOO


def problem(name: str, fraction: float, hardware: str = "v100-pcie3") -> Problem:
    model, x = ZOO[name]()
    base = fxpooch.plan(model, x, "1TiB", planner="in-core", profile="analytic", hardware=hardware)
    graph = base.graph
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        get_planner("pooch")(Problem(graph, base.profile.costs(graph), 1))
    floor = info.value.min_feasible_bytes
    return Problem(graph, base.profile.costs(graph), int(floor + fraction * (base.in_core_peak_bytes - floor)))


@pytest.mark.parametrize("hardware", ["v100-pcie3", "v100-nvlink2"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_exact_is_optimal_and_heuristics_are_within_it(hardware, fraction):
    prob = problem("mlp", fraction, hardware)
    best = plan_exact(prob)
    assert best.fits
    for name in ("pooch", "swap-opt", "local"):
        c = get_planner(name)(prob)
        assert c.fits
        assert c.step_time >= best.step_time * (1 - 1e-12), name
    assert get_planner("local")(prob).step_time <= best.step_time * 1.03  # within 3% of the optimum
    assert best.step_time >= lower_bound(Evaluator(prob)) * (1 - 1e-12)


def test_exact_refuses_large_graphs():
    prob = problem("resnet_small", 0.5)
    with pytest.raises(ValueError, match="max_exact"):
        plan_exact(prob, SearchOptions(max_exact=9))


@pytest.mark.parametrize("name", ["transformer_block", "resnet_small"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_local_search_never_slower_than_pooch(name, fraction):
    prob = problem(name, fraction)
    pooch, local = get_planner("pooch")(prob), get_planner("local")(prob)
    assert local.fits and local.timeline.peak_bytes <= prob.mem_limit
    assert local.step_time <= pooch.step_time
