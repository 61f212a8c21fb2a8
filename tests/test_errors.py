"""Bad input: each case raises a typed error whose message says what to do."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpooch


def linear():
    torch.manual_seed(0)
    return nn.Linear(8, 8), torch.randn(4, 8)


def frozen():
    m, x = linear()
    m.requires_grad_(False)
    return m, x


def meta_model_cpu_input():
    with torch.device("meta"):
        m = nn.Linear(8, 8)
    return m, torch.randn(4, 8)


CASES = [
    # (id, model factory, example input override, mem_limit, kwargs, error type, message fragment)
    ("bad-string", linear, None, "16 gigs", {}, fxpooch.InvalidMemoryLimit, "16GiB"),
    ("negative", linear, None, -5, {}, fxpooch.InvalidMemoryLimit, "positive"),
    ("zero", linear, None, 0, {}, fxpooch.InvalidMemoryLimit, "positive"),
    ("bool", linear, None, True, {}, fxpooch.InvalidMemoryLimit, "bool"),
    ("float", linear, None, 1.5e9, {}, fxpooch.InvalidMemoryLimit, "int"),
    ("below-floor", linear, None, 1, {}, fxpooch.InfeasibleMemoryLimit, "smallest feasible limit"),
    ("no-trainable-params", frozen, None, "1GiB", {}, fxpooch.UnsupportedModel, "require grad"),
    ("input-type", linear, [torch.randn(4, 8)], "1GiB", {}, fxpooch.UnsupportedModel, "tuple"),
    ("devices-differ", meta_model_cpu_input, None, "1GiB", {}, fxpooch.UnsupportedModel, "different devices"),
    ("unknown-planner", linear, None, "1GiB", {"planner": "magic"}, fxpooch.UnknownName, "pooch"),
    ("unknown-hardware", linear, None, "1GiB", {"profile": "analytic", "hardware": "tpu"}, fxpooch.UnknownName,
     "v100-pcie3"),
    ("bad-profile", linear, None, "1GiB", {"profile": "nonsense"}, fxpooch.InvalidProfile, "'measure'"),
    # a planner passed as a function that ignores the limit: its plan is refused, not run above it
    ("planner-over-limit", linear, None, 1, {"planner": lambda problem: in_core(problem)}, fxpooch.InvalidOption,
     "within Problem.mem_limit"),
]


def in_core(problem):
    """Every activation kept, whatever the limit."""
    from fxpooch.planners import Evaluator
    from fxpooch.schedule import Decision

    return Evaluator(problem).evaluate([Decision.KEEP] * len(problem.graph.activations))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case):
    _, factory, override, limit, kwargs, error, fragment = case
    model, x = factory()
    with pytest.raises(error) as info:
        fxpooch.compile(model, x if override is None else override, limit, **kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, fxpooch.FxpoochError)


def test_cuda_limit_above_device_memory_is_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, x = linear()
    with pytest.raises(fxpooch.InvalidMemoryLimit, match="more than"):
        fxpooch.compile(model.cuda(), x.cuda(), "100TiB")


def test_module_hooks_are_honoured():
    model, x = linear()
    model = nn.Sequential(model, nn.ReLU(), nn.Linear(8, 8))
    calls = []
    # the forward hook changes the output (the gradients show it ran); it appends nothing, since a
    # list that the compiled forward appends to is a guard that fails at every call
    model[0].register_forward_hook(lambda mod, inputs, out: out * 2)
    model[2].register_full_backward_hook(lambda mod, gin, gout: calls.append("backward"))
    import copy

    eager = copy.deepcopy(model)
    cm = fxpooch.compile(model, x, "1GiB", profile="analytic", hardware="v100-pcie3")
    calls.clear()
    cm(x).sum().backward()
    assert calls == ["backward"]
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_double_backward_is_refused():
    model, x = linear()
    cm = fxpooch.compile(model, x, "1GiB", profile="analytic", hardware="v100-pcie3")
    (g,) = torch.autograd.grad(cm(x).sum(), model.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_demo_asks_for_cuda_without_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from fxpooch.__main__ import main

    assert main(["demo", "--device", "cuda"]) == 2
