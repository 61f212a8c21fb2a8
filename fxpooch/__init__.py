"""fxpooch: train models whose activations exceed device memory, by planning swap and recompute.

    cm = fxpooch.compile(model, example_input, mem_limit="16GiB")
    loss = loss_fn(cm(x)); loss.backward(); opt.step()

or inside torch.compile (every graph dynamo compiles is planned; see :mod:`fxpooch.torch_backend`)::

    model = torch.compile(model, backend=fxpooch.backend(mem_limit="16GiB"))

The stages, one call each (see :mod:`fxpooch.pipeline`): ``trace_step`` -> ``profile_step`` ->
``plan_graph`` -> ``Plan``; ``replan`` plans a Plan's graph again for another planner or limit.
"""
from __future__ import annotations

import warnings as _warnings

import torch as _torch

from . import _torch_compat
from . import runtime as _runtime  # noqa: F401  (registers the fxpooch:: ops)
from .api import CompiledModule, CompileOptions, compile, plan
from .torch_backend import Backend, backend, named_backend
from .errors import (FxpoochError, HostPoolExhausted, InfeasibleMemoryLimit, InvalidMemoryLimit, InvalidOption, InvalidProfile,
                     PendingBackward, ReplanLimitExceeded, UnknownName, UnsupportedModel, UntestedTorchWarning)
from .memory import Margin
from .hardware import PRESETS as HARDWARE_PRESETS
from .hardware import Hardware, Link
from .pipeline import TracedStep, plan_graph, profile_step, replan, trace_step
from .plan import Plan
from .planners import PLANNERS
from .profile import Profile

__version__ = "0.1.0"

if (_untested := _torch_compat.untested_torch(_torch.__version__)) is not None:
    _warnings.warn(_untested, UntestedTorchWarning, stacklevel=2)

__all__ = [
    "HARDWARE_PRESETS", "PLANNERS", "Backend", "CompileOptions", "CompiledModule", "FxpoochError", "Hardware",
    "HostPoolExhausted", "InfeasibleMemoryLimit", "Margin", "InvalidMemoryLimit", "InvalidOption", "InvalidProfile", "Link", "Plan", "Profile",
    "PendingBackward", "ReplanLimitExceeded", "TracedStep", "UnknownName", "UnsupportedModel", "UntestedTorchWarning", "backend", "compile", "named_backend", "plan",
    "plan_graph", "profile_step", "replan", "trace_step",
]
