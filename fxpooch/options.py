"""``CompileOptions``: how to profile, plan and run, checked and resolved when built."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .codegen import check_codegen
from .errors import InvalidOption, InvalidProfile
from .hardware import Hardware, Link, get_hardware
from .limits import default_margin
from .memory import Margin
from .planners import Planner, resolve_planner
from .profile import Profile
from .timing import ProfileOptions
from .units import parse_bytes

#: the profile sources named by a string
PROFILE_KINDS = ("analytic", "measure")


def resolve_profile_source(profile: str | Profile | os.PathLike) -> str | Profile:
    """``"analytic"``, ``"measure"`` or a :class:`Profile` (a path is loaded now); anything else raises
    :class:`~fxpooch.errors.InvalidProfile`."""
    if isinstance(profile, Profile) or profile in PROFILE_KINDS:
        return profile
    if isinstance(profile, (str, os.PathLike)) and os.path.exists(profile):
        return Profile.load(profile)
    raise InvalidProfile(f"profile={profile!r}: no such file; pass 'measure', 'analytic', a Profile "
                         "or the path of a saved profile")


def resolve_hardware(hardware: str | Hardware | None) -> Hardware | None:
    """A preset name as its :class:`Hardware` (an unknown one raises :class:`~fxpooch.errors.UnknownName`)."""
    return get_hardware(hardware) if isinstance(hardware, str) else hardware


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How to profile, plan and run; built by keyword.

    ``planner``: a registered name (``fxpooch.PLANNERS``) or a function ``Problem -> Candidate``.
    ``profile``: "measure" (CUDA events / CPU timer), "analytic" (roofline of ``hardware``), a
    :class:`Profile`, or a path to a saved one (loaded here). ``profile_mode`` (when measuring): "in-situ",
    "per-node", or "auto" (in situ when the in-core step fits under the limit, else each node
    alone). ``margin``: device memory kept out of the plan for the allocator's fragmentation, a
    :class:`~fxpooch.memory.Margin`, bytes, or None: 5% of the limit on CUDA, 0 on CPU and meta.
    ``host_pool_limit``: bytes the pinned pool of host copies may hold (None: the host memory
    available when compiling; a plan needing more is warned about); exceeding it raises
    :class:`~fxpooch.errors.HostPoolExhausted`. ``max_plans``: how many plans (one per set of
    graphs dynamo compiles for a step, input signature and gradient state) a compiled module makes
    before it raises :class:`~fxpooch.errors.ReplanLimitExceeded`. ``outputs_held``: the caller holds
    the model's outputs until its backward ends (True: each is planned until the step ends), or
    drops them before calling backward (False, e.g. ``model(ids, labels=ids).loss.backward()``, where
    the logits come back next to the loss: each is planned until the forward returns; autograd's zero
    gradient for it is planned either way). ``codegen``: how the rewritten graphs run, "fx" (op by
    op) or "inductor" (compiled; see :mod:`fxpooch.codegen`). ``peak_check_rounds`` (``fxpooch.compile``
    with inductor, or any code generator on CUDA: :meth:`checks_peak`): the compiled plan runs steps on
    the example inputs, its measured time calibrates
    the op times and its measured peak is checked against the limit; above it, the plan is made again
    with the excess kept free, at most this many times (:mod:`fxpooch.peakcheck`); 0 skips both. The
    ``torch.compile`` backend plans a graph before it first runs and never runs a step of its own, so
    it does not check. A bad planner, hardware preset,
    ``margin``, ``host_pool_limit``, ``max_plans``, ``codegen``, ``peak_check_rounds`` or profile path is reported here,
    before anything runs.
    """

    planner: str | Planner = "local"
    profile: str | Profile | os.PathLike = "measure"
    hardware: str | Hardware | None = None  # analytic costs and the default link
    link: Link | None = None  # overrides the hardware's link
    profile_mode: str = "auto"
    margin: Margin | int | str | None = None
    host_pool_limit: int | str | None = None
    max_plans: int = 8
    outputs_held: bool = True
    codegen: str = "fx"
    peak_check_rounds: int = 3
    #: ``profile`` resolved: "analytic", "measure" or a Profile
    profile_source: str | Profile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resolve_planner(self.planner)  # fail fast on an unknown name
        resolve_hardware(self.hardware)  # ... an unknown preset
        ProfileOptions(self.profile_mode)  # ... an unknown mode
        self.margin_for(torch.device("cpu"))  # ... a malformed margin
        object.__setattr__(self, "profile_source", resolve_profile_source(self.profile))
        check_codegen(self.codegen)
        if self.host_pool_limit is not None:
            parse_bytes(self.host_pool_limit, "host_pool_limit")
        if isinstance(self.max_plans, bool) or not isinstance(self.max_plans, int) or self.max_plans < 1:
            raise InvalidOption(f"max_plans={self.max_plans!r}: pass a whole number of plans, at least 1")
        if isinstance(self.peak_check_rounds, bool) or not isinstance(self.peak_check_rounds, int) \
                or self.peak_check_rounds < 0:
            raise InvalidOption(f"peak_check_rounds={self.peak_check_rounds!r}: pass a whole number of plans made "
                                "again after the measured peak, 0 or more (0: no check)")
        if not isinstance(self.outputs_held, bool):
            raise InvalidOption(f"outputs_held={self.outputs_held!r}: pass True (the caller holds the outputs "
                                "through the backward) or False (it drops them before calling backward)")

    def checks_peak(self, device: torch.device) -> bool:
        """Whether a compiled plan's measured peak is checked on ``device``: with inductor (its kernels
        take buffers and scratch the profiled ops did not), and on CUDA with either code generator (an
        op's workspace is not in an analytic profile, and a swapped buffer is freed when its copy
        ends, whose time the plan only predicts)."""
        return bool(self.peak_check_rounds) and (self.codegen == "inductor" or device.type == "cuda") \
            and device.type in ("cpu", "cuda")

    def margin_for(self, device: torch.device) -> Margin:
        if self.margin is None:
            return default_margin(device, self.hardware)
        if isinstance(self.margin, Margin):
            return self.margin
        return Margin() if self.margin in (0, "0") else Margin(nbytes=parse_bytes(self.margin, "margin"))
