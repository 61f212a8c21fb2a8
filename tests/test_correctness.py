"""The zoo trained through fxpooch at three limits: same gradients and buffers as eager, and a
peak that an independent storage counter confirms."""
from __future__ import annotations

import copy
import pytest
import torch

import fxpooch
from measure import Limits, find_limits, measured_step_peak
from zoo import ZOO

RTOL, ATOL = 1e-5, 1e-6
#: BatchNorm's running-stat updates are graph outputs the plan keeps until the step ends;
#: AOTAutograd copies them into the buffers and frees them earlier (a few hundred bytes).
BN_SLACK = {"cnn_bn": 1024, "resnet_small": 1024}


def compile_zoo(name: str, limit) -> tuple[torch.nn.Module, torch.Tensor, fxpooch.CompiledModule]:
    model, x = ZOO[name]()
    return model, x, fxpooch.compile(model, x, limit, profile="analytic", hardware="v100-pcie3")


_limits: dict[str, Limits] = {}


def limits(name: str) -> Limits:
    if name not in _limits:
        _limits[name] = find_limits(lambda limit: compile_zoo(name, limit)[2])
    return _limits[name]


def two_steps_match_eager(model: torch.nn.Module, x: torch.Tensor, cm: fxpooch.CompiledModule, slack: int = 0) -> None:
    """Two steps of ``cm`` (which wraps ``model``) beside eager on a copy: the independent
    counter sees the planned program-order peak (less up to ``slack`` bytes) each step, and the
    gradients, output and buffers equal eager's."""
    eager = copy.deepcopy(model)
    plan = cm.plan
    limit = plan.mem_limit
    for seed in range(2):  # two steps: the second reuses the plan, pool and graphs
        for m in (model, eager):  # the plan is for a step that starts without gradients
            m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        measured = measured_step_peak(cm, (x,), plan.graph.resident_bytes)
        torch.manual_seed(seed)
        eager_out = eager(x)
        eager_out.backward(torch.ones_like(eager_out))
        # the independent counter sees exactly the planned program-order peak
        assert plan.static_peak_bytes - slack <= measured <= plan.static_peak_bytes
        assert plan.static_peak_bytes <= plan.peak_bytes <= limit
    # seed 1 was the last step of both: compare its effects
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"grad of {n}: {m}")
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = cm(x)
    torch.manual_seed(1)
    torch.testing.assert_close(out, eager(x), rtol=RTOL, atol=ATOL)
    for (n, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"buffer {n}: {m}")


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("which", ["in_core", "middle", "floor"])
def test_zoo_matches_eager(name: str, which: str):
    limit = getattr(limits(name), which)
    model, x, cm = compile_zoo(name, limit)
    plan = cm.plan
    assert plan.peak_bytes <= limit
    counts = plan.counts()
    if which == "in_core":
        assert counts["swap"] == counts["recompute"] == 0
    else:
        assert counts["swap"] + counts["recompute"] > 0
    two_steps_match_eager(model, x, cm, BN_SLACK.get(name, 0))


@pytest.mark.parametrize("name, hardware, fraction", [("resnet_small", "v100-pcie3", 0.1),
                                                     ("transformer_block", "v100-pcie3", 0.1)])
def test_a_plan_sharing_its_chains_in_part_matches_eager(name, hardware, fraction):
    """Near the floor the plan sets some recompute chains apart (``Schedule.apart``: rebuilt alone,
    kept by no other chain) and shares the others: gradients equal eager's (dropout's output
    rebuilt from its mask in the transformer block) and the counter sees the planned peak."""
    model, x = ZOO[name]()
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.compile(model, x, 1, profile="analytic", hardware=hardware)
    floor = info.value.min_feasible_bytes
    in_core = fxpooch.plan(model, x, "1TiB", planner="in-core", profile="analytic", hardware=hardware).in_core_peak_bytes
    cm = fxpooch.compile(model, x, int(floor + fraction * (in_core - floor)), profile="analytic", hardware=hardware)
    schedule = cm.plan.schedule
    recomputed = {a for a, d in enumerate(schedule.decisions) if d is fxpooch.schedule.Decision.RECOMPUTE}
    assert schedule.apart and schedule.apart < recomputed and schedule.shared
    two_steps_match_eager(model, x, cm, BN_SLACK.get(name, 0))


def test_a_tight_limit_mixes_swap_and_recompute():
    lim = limits("transformer_block")
    model, x, cm = compile_zoo("transformer_block", lim.floor + (lim.in_core - lim.floor) // 5)
    counts = cm.plan.counts()
    assert counts["swap"] > 0 and counts["recompute"] > 0, counts
    eager = copy.deepcopy(model)
    for m in (cm, eager):
        torch.manual_seed(0)
        out = m(x)
        out.backward(torch.ones_like(out))
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_slow_link_recomputes_more_than_fast_link():
    """The paper's Table 3: with PCIe3 PoocH recomputes more than with NVLink2."""
    model, x = ZOO["resnet_small"]()
    counts = {}
    for hw in ("v100-pcie3", "v100-nvlink2"):
        with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
            fxpooch.compile(model, x, 1, profile="analytic", hardware=hw)
        limit = (info.value.min_feasible_bytes + limits("resnet_small").in_core) // 2
        counts[hw] = fxpooch.compile(model, x, limit, profile="analytic", hardware=hw).plan.counts()
    assert counts["v100-pcie3"]["recompute"] > counts["v100-nvlink2"]["recompute"], counts
    assert counts["v100-nvlink2"]["swap"] > counts["v100-pcie3"]["swap"], counts


def test_infeasible_limit_names_the_floor():
    floor = limits("mlp").floor
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        compile_zoo("mlp", floor - 1)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.min_feasible_bytes == floor
    assert f"({floor} bytes)" in str(err)
    _, _, cm = compile_zoo("mlp", floor)  # the floor itself is feasible
    assert cm.plan.peak_bytes <= floor
