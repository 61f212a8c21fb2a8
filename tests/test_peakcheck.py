"""The measured peak of a compiled plan (``fxpooch.peakcheck``): inductor's code for a small conv net
takes more memory than the plan counts (channels-last layouts and weight copies no graph node has);
the check re-plans until the step, measured by the profiler's allocator events, fits the limit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxpooch
from fxpooch.memory import Margin
from fxpooch import peakcheck
from fxpooch.peakcheck import StepOutOfMemory, allocator_peak, fit_measured
from memprofile import step_peak

MiB = 2**20
#: fxpooch + inductor against torch.compile's inductor: the same kernels, a swapped activation's host
#: copy keeps the traced layout, so a weight gradient may be summed in another order (observed 1e-5)
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-4)


class ConvNet(nn.Module):
    """A bottleneck without its shortcut, the loss inside: 1 MiB activations (256 channels of 8x8 at
    batch 16) and a 2.25 MiB 3x3 weight, which inductor relays channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(),
                                  nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(),
                                  nn.Conv2d(256, 64, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


def conv_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ConvNet().train(), torch.randn(16, 64, 8, 8)


def measured(cm: fxpooch.CompiledModule, x: torch.Tensor) -> int:
    """The second step's peak (the first fills the host pool), resident bytes included."""
    peaks = []
    for _ in range(2):
        cm.model.zero_grad(set_to_none=True)
        peaks.append(cm.plan.graph.resident_bytes + step_peak(lambda: cm(x).backward()))
    return peaks[1]


LIMIT = 15 * MiB  # above the in-core plan (11.2 MiB), below what its compiled step takes (15.7 MiB)


def test_inductor_step_fits_the_limit_once_its_measured_peak_is_checked():
    model, x = conv_net()
    unchecked = fxpooch.compile(copy.deepcopy(model), x, LIMIT, codegen="inductor", peak_check_rounds=0)
    # the premise: the compiled in-core plan takes more than it counts, above the limit
    assert unchecked.plan.counts()["keep"] == len(unchecked.plan.decisions)
    assert unchecked.plan.peak_bytes <= LIMIT < measured(unchecked, x)

    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    cm = fxpooch.compile(model, x, LIMIT, codegen="inductor")
    assert cm.plan.margin_bytes > 0 and cm.plan.counts()["keep"] < len(cm.plan.decisions)
    # the check's own steps left no trace: the buffers are as before them
    for b, r in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, r)
    assert all(p.grad is None for p in model.parameters())
    assert measured(cm, x) <= LIMIT
    for m in (reference, eager):  # as many steps as the measurement ran: BatchNorm's statistics advance alike
        for _ in range(2):
            m(x).backward()
    compiled = torch.compile(reference, backend="inductor")
    losses = []
    for m in (cm, compiled, eager):
        getattr(m, "model", m).zero_grad(set_to_none=True)
        loss = m(x)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], **INDUCTOR_TOL)
    for p, q, r in zip(model.parameters(), reference.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **INDUCTOR_TOL)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-3)
    for b, r in zip(model.buffers(), reference.buffers()):  # BatchNorm's running statistics, one step on
        torch.testing.assert_close(b, r, **INDUCTOR_TOL)


def test_a_limit_no_checked_plan_meets_names_one_that_does():
    model, x = conv_net()
    # the in-core plan fits 12 MiB on paper; its compiled step does not, nor does any plan with what
    # the code took above it kept free
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:
        fxpooch.compile(copy.deepcopy(model), x, 12 * MiB, codegen="inductor")
    floor = e.value.min_feasible_bytes
    assert floor > 12 * MiB and "more than its plan counts" in str(e.value)
    cm = fxpooch.compile(model, x, floor, codegen="inductor")
    assert measured(cm, x) <= floor


def _plan_of_mlp(limit: int) -> fxpooch.Plan:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(512, 512), nn.Tanh())]
    return fxpooch.plan(nn.Sequential(*layers), torch.randn(1024, 512), limit, hardware="v100-pcie3")


def test_fit_measured_keeps_the_measured_excess_free_and_stops_within_its_rounds():
    limit = 21 * MiB + MiB // 2  # the in-core peak is 21.01 MiB, the floor 19.01
    plan = _plan_of_mlp(limit)
    assert plan.counts()["keep"] == len(plan.decisions)
    tried = []

    def measure_over(excess: int):
        def measure(p: fxpooch.Plan) -> int:  # the code takes ``excess`` more than every plan counts
            tried.append(p)
            return p.peak_bytes + excess, p.step_time
        return measure

    found = fit_measured(plan, measure_over(2 * MiB), rounds=2, planner="local", margin=Margin(), calibrate=False)
    assert len(tried) == 2 and tried[0] is plan
    assert found.plan is tried[1] and found.peak_bytes <= limit and found.plan.margin_bytes >= 2 * MiB
    assert found.plan.mem_limit == limit and found.plan.counts()["keep"] < len(plan.decisions)

    # no round left to plan again: the most frugal plan is measured last
    tried.clear()
    found = fit_measured(plan, measure_over(2 * MiB), rounds=0, planner="local", margin=Margin(), calibrate=False)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as planned:
        _plan_of_mlp(1)
    floor = planned.value.min_feasible_bytes
    assert len(tried) == 2 and found.plan is tried[1] and found.plan.peak_bytes == floor
    assert found.peak_bytes == floor + 2 * MiB <= limit

    tried.clear()
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:  # 3 MiB kept free leaves less than the floor
        fit_measured(plan, measure_over(3 * MiB), rounds=2, planner="local", margin=Margin(), calibrate=False)
    assert len(tried) == 2 and e.value.min_feasible_bytes == floor + 3 * MiB > limit, e.value

    # at the planner's floor, a little more than planned: the limit the error names is one a plan meets
    at_floor = _plan_of_mlp(floor)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:
        fit_measured(at_floor, measure_over(4096), rounds=2, planner="local", margin=Margin(), calibrate=False)
    named = e.value.min_feasible_bytes
    assert named == at_floor.peak_bytes + 4096
    found = fit_measured(_plan_of_mlp(named), measure_over(4096), rounds=2, planner="local", margin=Margin(),
                         calibrate=False)
    assert found.peak_bytes <= named

    # with a share of the limit kept free (CUDA's default margin), the limit named leaves that share too
    cuda = Margin.default_for("cuda")
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:
        fit_measured(at_floor, measure_over(4096), rounds=2, planner="local", margin=cuda, calibrate=False)
    named = e.value.min_feasible_bytes
    assert named - cuda.of(named) == at_floor.peak_bytes + 4096
    found = fit_measured(_plan_of_mlp(named), measure_over(4096), rounds=2, planner="local", margin=cuda,
                         calibrate=False)
    assert found.peak_bytes <= named - cuda.of(named)


def test_the_measured_step_time_scales_the_costs():
    plan = _plan_of_mlp(2**40)
    found = fit_measured(plan, lambda p: (p.peak_bytes, p.step_time / 4), rounds=0, planner="local", margin=Margin())
    assert found.plan.decisions == plan.decisions and found.plan.schedule == plan.schedule
    assert found.plan.step_time == pytest.approx(plan.step_time / 4)
    assert found.plan.in_core_time == pytest.approx(plan.in_core_time / 4)
    assert "measured time" in found.plan.profile.source


def test_a_step_slower_than_predicted_keeps_the_costs():
    """Slower than its prediction, a step waited for what the costs do not hold (an allocator's
    synchronizations, a late link): its ops are not made slower."""
    plan = _plan_of_mlp(2**40)
    found = fit_measured(plan, lambda p: (p.peak_bytes, p.step_time * 1.5), rounds=0, planner="local", margin=Margin())
    assert found.plan is plan and found.seconds == pytest.approx(plan.step_time * 1.5)


@pytest.mark.parametrize("limit, calibrated_extra, kept", [
    # on an H200, inductor's ResNet-50 ran out of memory (no time measured) until a plan kept 1.2 GB free;
    # the costs its time calibrated were planned again with none kept free, and that plan ran out too
    (21 * MiB + MiB // 2, 1 * MiB, "calibrated"),  # calibrated, still keeping the measured excess free: fits
    (21 * MiB + MiB // 2, 3 * MiB, "measured before"),  # the calibrated plan's code takes more: the fitting one
    (20 * MiB + MiB // 2, 1 * MiB, "same schedule"),  # the calibrated costs plan the same: its costs are kept
])
def test_costs_calibrated_after_rounds_out_of_memory_keep_the_memory_found_free(limit, calibrated_extra, kept):
    plan, tried = _plan_of_mlp(limit), []

    def measure(p: fxpooch.Plan) -> tuple[int, float]:
        tried.append(p)
        peak = p.peak_bytes + (calibrated_extra if "measured time" in p.profile.source else MiB)
        return peak, (p.step_time / 10 if peak <= limit else 0.0)  # out of memory: no time

    found = fit_measured(plan, measure, rounds=2, planner="local", margin=Margin())
    assert found.peak_bytes <= limit and found.plan.margin_bytes >= MiB
    assert tried[0] is plan and tried[0].peak_bytes + MiB > limit  # the first step ran out
    if kept == "calibrated":
        assert len(tried) == 3 and found.plan is tried[2] and "measured time" in found.plan.profile.source
        assert found.plan.schedule != tried[1].schedule
    elif kept == "measured before":
        assert len(tried) == 3 and found.plan is tried[1] and "measured time" not in found.plan.profile.source
    else:
        assert len(tried) == 2 and found.plan.schedule == tried[1].schedule
        assert "measured time" in found.plan.profile.source and found.plan.step_time < tried[1].step_time


def test_a_step_out_of_memory_measures_what_it_held_and_asked_for():
    def run():
        held = torch.empty(MiB // 4)  # 1 MiB
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has ...")

    with pytest.raises(StepOutOfMemory) as e:
        allocator_peak(torch.device("cpu"), run)
    assert e.value.peak_bytes == 3 * MiB and "Tried to allocate 2.00 MiB" in str(e.value)


def test_a_step_out_of_memory_while_checked_is_planned_again_below_the_limit(monkeypatch):
    """Under a per-process cap a step can run out of memory before its allocated bytes reach the
    limit (fragmentation): the check takes it as over the limit, plans again with what it held and
    asked for kept free, and does not scale the costs by a step that did not run through."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.Tanh())])
    x, limit = torch.randn(1024, 512), 21 * MiB + MiB // 2  # the in-core plan fits (21.01 MiB)
    eager = copy.deepcopy(model)
    monkeypatch.setattr(fxpooch.CompileOptions, "checks_peak", lambda self, device: True)  # fx on a CPU too
    measured, real = [], peakcheck.measure_step

    def measure_step(*args):
        measured.append(len(measured))
        if len(measured) == 1:
            raise StepOutOfMemory(20 * MiB, "CUDA out of memory. Tried to allocate 1.00 MiB.")
        peak, _ = real(*args)
        return peak, 1e6  # slower than any prediction: only a step out of memory could scale the costs

    monkeypatch.setattr(peakcheck, "measure_step", measure_step)
    cm = fxpooch.compile(model, x, limit, hardware="v100-pcie3")
    assert len(measured) == 2
    assert cm.plan.peak_bytes < cm.plan.graph.resident_bytes + 20 * MiB and cm.plan.margin_bytes > 0
    assert cm.plan.counts()["keep"] < len(cm.plan.decisions) and "measured time" not in cm.plan.profile.source
    cm(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_peak_check_rounds_is_checked():
    with pytest.raises(fxpooch.InvalidOption, match="peak_check_rounds"):
        fxpooch.CompileOptions(peak_check_rounds=-1)


# -- the torch.compile backend: the caller's own steps are measured ---------------------------------
def train_steps(cm, model: nn.Module, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        cm(x).backward()


def backend_peak(cm, backend, model: nn.Module, x: torch.Tensor) -> int:
    """A step's peak by the benchmarks' profiler meter, resident bytes included."""
    model.zero_grad(set_to_none=True)
    return backend.plan.graph.resident_bytes + step_peak(lambda: cm(x).backward())


def test_backend_steps_fit_the_limit_once_a_step_is_measured():
    model, x = conv_net()
    # the costs and scratch of a measured profile, so that the in-core plan is the one fxpooch.compile makes
    profile = fxpooch.compile(copy.deepcopy(model), x, LIMIT, codegen="inductor", peak_check_rounds=0).plan.profile
    unchecked_model = copy.deepcopy(model)
    unchecked = fxpooch.backend(LIMIT, profile=profile, peak_check_rounds=0)
    cm = torch.compile(unchecked_model, backend=unchecked, dynamic=False)
    train_steps(cm, unchecked_model, x, 3)
    assert not unchecked.checks and unchecked.plan.counts()["swap"] == 0
    assert unchecked.plan.peak_bytes <= LIMIT < backend_peak(cm, unchecked, unchecked_model, x)

    eager = copy.deepcopy(model)
    backend = fxpooch.backend(LIMIT, profile=profile)
    cm = torch.compile(model, backend=backend, dynamic=False)
    # step 1 runs each graph's own plan, step 2 the whole-step plan, step 3 is measured (the one before
    # filled the host pool), over the limit: from step 4 a plan with the excess kept free runs, measured
    # in step 5 and read as step 6 starts
    train_steps(cm, model, x, 6)
    (check,) = backend.checks.values()
    # in core, then with something freed: swapped or recomputed, as the measured profile's times say
    # (a profile measured beside other load gave a plan that swaps nothing)
    n = len(check.measured[0].plan.decisions)
    assert [m.plan.counts()["keep"] == n for m in check.measured] == [True, False]
    assert check.measured[0].peak_bytes > LIMIT >= check.measured[1].peak_bytes
    assert check.result == check.measured[1] and backend.plan is check.result.plan
    assert backend.plan.margin_bytes > 0
    assert backend_peak(cm, backend, model, x) == check.result.peak_bytes  # the independent meter agrees
    eager.zero_grad(set_to_none=True)
    eager(x).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)


def test_backend_names_the_limit_its_measured_steps_meet():
    model, x = conv_net()
    backend = fxpooch.backend(LIMIT)  # analytic costs: no op's scratch is planned, the code takes more
    first = copy.deepcopy(model)
    cm = torch.compile(first, backend=backend, dynamic=False)
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as e:
        train_steps(cm, first, x, 8)
    floor = e.value.min_feasible_bytes
    assert floor > LIMIT and "more than its plan counts" in str(e.value)
    assert not backend.checks  # the check is over: the next steps run unchecked, as before it

    backend = fxpooch.backend(floor)
    cm = torch.compile(model, backend=backend, dynamic=False)
    # the limit is what the most frugal plan measured: the in-core plan (measured in step 3) is not
    # within it, the most frugal one (measured in step 5, read as step 6 starts) is
    train_steps(cm, model, x, 6)
    (check,) = backend.checks.values()
    assert check.result is not None and check.result.peak_bytes <= floor, (floor, check.measured)
    assert backend_peak(cm, backend, model, x) <= floor


@pytest.mark.parametrize("codegen, device, rounds, checked", [
    ("fx", "cpu", 3, False),  # the plan counts what the ops allocate, exactly
    ("inductor", "cpu", 3, True),
    ("fx", "cuda", 3, True),  # workspaces and copy-timed frees the plan only predicts
    ("inductor", "cuda", 3, True),
    ("inductor", "meta", 3, False),  # nothing to measure
    ("fx", "cuda", 0, False),
    ("inductor", "cpu", 0, False),
])
def test_which_steps_have_their_peak_checked(codegen: str, device: str, rounds: int, checked: bool):
    options = fxpooch.CompileOptions(codegen=codegen, peak_check_rounds=rounds)
    assert options.checks_peak(torch.device(device)) is checked
