"""What the plan counts for a user output next to the loss, measured to the byte.

A model that returns ``(loss, out)`` (as a language model returns the loss and its logits) is
trained as a caller does it, either holding ``out`` through the backward or dropping it before
calling ``loss.backward()``. Autograd then hands the backward a zero gradient for ``out`` (real
memory, ``aten.zeros``), so the plan counts that gradient either way; the output itself lives
until the step ends when held (``outputs_held=True``, the default) and until the forward returns
when dropped (``outputs_held=False``). The peak an independent counter measures around the whole
step (:class:`measure.StepCounter`, resident storages included) equals the planned one exactly.
Sizes are whole MiB: a (2048, 512) fp32 activation is 4 MiB.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxpooch
from fxpooch import _torch_compat as compat
from fxpooch.errors import InvalidOption
from measure import HOST_OPS, StepCounter
from memcount import resident_bytes
from zoo import MiB, WIDTH

ANALYTIC = dict(profile="analytic", hardware="cpu")
BATCH = 2048  # (BATCH, WIDTH) fp32 = 4 MiB: activations outweigh the 1 MiB weights, so a limit below in-core fits
OUT = 4 * MiB  # bytes of the output (and of its gradient)


class LossAndOutput(nn.Module):
    """Tanh layers, then a last Linear whose output (the "logits") is returned next to a loss whose
    backward does not read it (as log_softmax's does not read its input): autograd does not hold it."""

    def __init__(self, layers: int = 6):
        super().__init__()
        tanh = (m for _ in range(layers - 1) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh()))
        self.body = nn.Sequential(*tanh, nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(x)
        return out.mean(), out


def model_and_input() -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LossAndOutput(), torch.randn(BATCH, WIDTH)


def measured_peak(cm, model: nn.Module, x: torch.Tensor, held: str) -> int:
    """Resident bytes plus the peak of one step. ``held``: "gradient" (``out`` held and given a
    gradient the caller holds), "output" (``out`` held, only the loss backpropagated: autograd's
    zeros for ``out`` die after their last reader), "none" (``out`` dropped before the backward)."""
    counter = StepCounter(host_ops=HOST_OPS)
    counter.seed(model, (x,))
    resident = resident_bytes(model, [x])
    with counter:
        loss, out = cm(x)
        if held == "gradient":
            grad = torch.zeros_like(out)
            torch.autograd.backward((loss, out), (None, grad))
        else:
            if held == "none":
                del out
            loss.backward()
    return resident + counter.peak_bytes


def test_in_core_peak_of_a_held_output_is_the_measured_one():
    model, x = model_and_input()
    cm = fxpooch.compile(model, x, "1TiB", **ANALYTIC)
    assert measured_peak(cm, model, x, "gradient") == cm.plan.in_core_peak_bytes
    model.zero_grad(set_to_none=True)
    # held without a gradient of the caller's: autograd's zeros die after their last reader, the plan
    # holds a gradient through the backward call (whoever passed it may), so it is above by less than one
    # (on torch 2.11 and 2.12 AOTAutograd holds them until the backward returns: the plan's peak)
    if compat.missing_gradients_held():
        assert measured_peak(cm, model, x, "output") == cm.plan.in_core_peak_bytes
    else:
        assert cm.plan.in_core_peak_bytes - OUT < measured_peak(cm, model, x, "output") < cm.plan.in_core_peak_bytes


def test_in_core_peak_of_a_dropped_output_is_the_measured_one():
    model, x = model_and_input()
    cm = fxpooch.compile(model, x, "1TiB", outputs_held=False, **ANALYTIC)
    assert measured_peak(cm, model, x, "none") == cm.plan.in_core_peak_bytes


def test_a_dropped_output_is_planned_one_output_lower_and_its_floor_not_higher():
    model, x = model_and_input()
    held = fxpooch.plan(model, x, "1TiB", **ANALYTIC)
    dropped = fxpooch.plan(model, x, "1TiB", outputs_held=False, **ANALYTIC)
    # at most out and its gradient held through the backward call, at least the output at the peak
    assert OUT <= held.in_core_peak_bytes - dropped.in_core_peak_bytes <= 2 * OUT

    def floor(outputs_held: bool) -> int:
        with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
            fxpooch.plan(model, x, 1, outputs_held=outputs_held, **ANALYTIC)
        return info.value.min_feasible_bytes

    assert floor(False) <= floor(True)


def test_out_of_core_with_a_dropped_output_meets_its_plan_and_eager():
    model, x = model_and_input()
    eager = copy.deepcopy(model)
    in_core = fxpooch.plan(model, x, "1TiB", outputs_held=False, **ANALYTIC).in_core_peak_bytes
    cm = fxpooch.compile(model, x, int(0.8 * in_core), outputs_held=False, **ANALYTIC)
    assert cm.plan.counts()["keep"] < len(cm.plan.decisions)  # out of core
    assert measured_peak(cm, model, x, "none") == cm.plan.static_peak_bytes <= cm.plan.mem_limit
    eager(x)[0].backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_outputs_held_must_be_a_bool():
    model, x = model_and_input()
    with pytest.raises(InvalidOption, match="outputs_held='no'"):
        fxpooch.compile(model, x, "1TiB", outputs_held="no", **ANALYTIC)
