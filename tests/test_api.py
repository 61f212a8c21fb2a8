"""The public contract of fxpooch.compile: inputs, outputs, side effects, plans, profiles."""
from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxpooch
from zoo import ZOO

ANALYTIC = dict(profile="analytic", hardware="v100-pcie3")


def test_passes_ship_inside_the_package_only(tmp_path):
    import fxpooch.passes

    assert hasattr(fxpooch.passes, "rewrite_pair")
    env = {**os.environ, "PYTHONPATH": ""}
    r = subprocess.run([sys.executable, "-c", "import passes"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'passes'" in r.stderr


def test_compile_leaves_model_state_and_rng_untouched():
    model, x = ZOO["cnn_bn"]()  # BatchNorm buffers change in a training forward
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor


class BreakingModel(nn.Module):
    """A graph break, a keyword input and a dataclass output."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512)

    def forward(self, x, *, scale: float = 1.0):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        h = torch.relu(self.b(h)) * scale
        return Output(self.c(h), h.sum())


@pytest.mark.parametrize("limit", ["1GiB", "19MiB"])
def test_graph_breaks_kwargs_and_dataclass_outputs(limit):
    torch.manual_seed(0)
    model, x = BreakingModel(), torch.randn(1024, 512)
    eager = copy.deepcopy(model)
    cm = fxpooch.compile(model, {"x": x, "scale": 2.0}, limit, **ANALYTIC)
    assert len(cm.forward_graphs) == 2  # planned as one step
    assert cm.plan.peak_bytes <= fxpooch.units.parse_bytes(limit)
    out = cm(x=x, scale=2.0)
    assert isinstance(out, Output)
    (out.logits.sum() + out.aux).backward()
    ref = eager(x, scale=2.0)
    (ref.logits.sum() + ref.aux).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_positional_tuple_example_input():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, a, b):
            return self.l(a) * b

    model = Two()
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    cm = fxpooch.compile(model, (a, b), "1GiB", **ANALYTIC)
    torch.testing.assert_close(cm(a, b), model(a, b))


def test_new_shape_plans_again_and_is_cached(caplog):
    model, x = ZOO["mlp"]()
    cm = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    first = cm.plan
    with caplog.at_level("INFO", logger="fxpooch"):
        cm(x[:1024]).sum().backward()
    assert any("planning again" in r.message for r in caplog.records)
    assert cm.plan is not first and cm.plan.in_core_peak_bytes < first.in_core_peak_bytes
    caplog.clear()
    with caplog.at_level("INFO", logger="fxpooch"):
        for batch in (x, x[:1024]):
            model.zero_grad(set_to_none=True)  # a plan per gradient state: keep it the same
            cm(batch).sum().backward()
    assert not any("planning" in r.message for r in caplog.records)


def test_profile_round_trips_through_json(tmp_path):
    model, x = ZOO["mlp"]()
    cm = fxpooch.compile(model, x, "40MiB", profile="measure", hardware="v100-pcie3")
    path = tmp_path / "profile.json"
    cm.plan.profile.save(path)
    loaded = fxpooch.Profile.load(path)
    assert loaded == cm.plan.profile
    again = fxpooch.compile(model, x, "40MiB", profile=str(path))
    assert again.plan.decisions == cm.plan.decisions
    assert again.plan.step_time == cm.plan.step_time and again.plan.peak_bytes == cm.plan.peak_bytes


def test_profile_of_other_graphs_is_rejected(tmp_path):
    model, x = ZOO["mlp"]()
    path = tmp_path / "profile.json"
    fxpooch.compile(model, x, "1GiB", **ANALYTIC).plan.profile.save(path)
    other, y = ZOO["cnn_bn"]()
    with pytest.raises(fxpooch.InvalidProfile, match="profile this model again"):
        fxpooch.compile(other, y, "1GiB", profile=str(path))


def test_plan_reports_contract_fields():
    model, x = ZOO["transformer_block"]()
    cm = fxpooch.compile(model, x, "24MiB", **ANALYTIC)
    plan = cm.plan
    assert plan.mem_limit == 24 * 2**20
    assert set(plan.decisions.values()) <= {"keep", "swap", "recompute"}
    assert len(plan.decisions) == len(plan.graph.activations)
    assert plan.peak_bytes <= plan.mem_limit < plan.in_core_peak_bytes
    assert plan.step_time >= plan.in_core_time > 0
    text = plan.table(fold=False)  # print(plan) sums up the small activations in one line
    for name, decision in plan.decisions.items():
        assert any(name in line and decision in line for line in text.splitlines()), name


def test_planning_on_meta_uses_no_memory():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()) for _ in range(6)])
        x = torch.randn(65536, 4096)  # 1 GiB per activation
    plan = fxpooch.plan(model, x, "9GiB", hardware="h100-pcie5")
    assert plan.in_core_peak_bytes > 9 * 2**30 >= plan.peak_bytes


class _GradientsMetaKernelsDropped(nn.Module):
    """Ops that torch also gives Python meta kernels, which under AOTAutograd's tracing on meta
    used to take the place of their decomposition, and so of their gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)
        self.scale = nn.Parameter(torch.ones(512))

    def forward(self, x, target):
        h, scale = torch.broadcast_tensors(nn.functional.relu6(self.a(x)), self.scale)
        h = torch.where(h > 1, h, 0.0) * scale + h.var(dim=-1, keepdim=True)
        return nn.functional.cross_entropy(nn.functional.selu(self.b(h)), target)


def test_a_step_traced_on_meta_has_the_backward_it_has_on_cpu():
    steps = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            model, x = _GradientsMetaKernelsDropped(), torch.randn(512, 512)
            target = torch.zeros(512, dtype=torch.long)
        graph = fxpooch.plan(model, (x, target), "1TiB", planner="in-core", hardware="h100-pcie5").graph
        steps[device] = ([(op.graph, op.phase, op.target) for op in graph.ops], [a.name for a in graph.activations])
    assert steps["meta"] == steps["cpu"]
    assert ("aten._log_softmax_backward_data.default" in {target for _, _, target in steps["meta"][0]})


def test_unknown_planner_lists_choices():
    model, x = ZOO["mlp"]()
    with pytest.raises(fxpooch.UnknownName, match="pooch"):
        fxpooch.compile(model, x, "1GiB", planner="nope")


def test_stage_functions_make_the_plan_plan_makes_and_replan_equals_planning_anew():
    model, x = ZOO["cnn_bn"]()
    whole = fxpooch.plan(model, x, "60%", planner="pooch", margin=0, **ANALYTIC)
    step = fxpooch.trace_step(model, (x,))
    profile = fxpooch.profile_step(step, **ANALYTIC)
    staged = fxpooch.plan_graph(step.graph, step.table, profile, whole.mem_limit, planner="pooch")
    assert staged.decisions == whole.decisions and staged.schedule == whole.schedule
    assert (staged.peak_bytes, staged.step_time) == (whole.peak_bytes, whole.step_time)
    # the same graph and costs under another planner and limit: as if planned so from the start
    limit = (whole.in_core_peak_bytes + whole.mem_limit) // 2
    again = fxpooch.replan(staged, planner="swap-all", mem_limit=limit)
    anew = fxpooch.plan_graph(step.graph, step.table, profile, limit, planner="swap-all")
    assert again.planner == "swap-all" and again.mem_limit == limit
    assert again.decisions == anew.decisions and again.timeline == anew.timeline
    assert again.in_core_time == staged.in_core_time


@pytest.mark.parametrize("enabled", [True, False])
def test_planners_run_without_the_cyclic_gc_and_leave_it_as_found(enabled):
    import gc
    from fxpooch.planners import get_planner

    seen = []

    def spy(problem):  # a planner function: records the collector's state, then plans as in-core does
        seen.append(gc.isenabled())
        return get_planner("in-core")(problem)

    def failing(problem):
        seen.append(gc.isenabled())
        raise RuntimeError("planner failed")

    model, x = ZOO["mlp"]()
    step = fxpooch.trace_step(model, (x,))
    profile = fxpooch.profile_step(step, **ANALYTIC)
    (gc.enable if enabled else gc.disable)()
    try:
        plan = fxpooch.plan_graph(step.graph, step.table, profile, 2**30, planner=spy)
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError, match="planner failed"):
            fxpooch.plan_graph(step.graph, step.table, profile, 2**30, planner=failing)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == [False, False] and plan.planner == "spy"


def test_compile_options_are_keyword_only_and_checked_when_built(tmp_path):
    with pytest.raises(TypeError):
        fxpooch.CompileOptions("local")  # noqa: the planner by position
    with pytest.raises(fxpooch.UnknownName, match="pooch"):
        fxpooch.CompileOptions(planner="poch")
    with pytest.raises(fxpooch.UnknownName):
        fxpooch.CompileOptions(hardware="tpu")
    with pytest.raises(fxpooch.InvalidProfile, match="no such file"):
        fxpooch.CompileOptions(profile=str(tmp_path / "typo.json"))
