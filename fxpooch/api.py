"""``fxpooch.compile``: capture -> profile -> plan -> rewrite -> run, one plan per input shape."""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat
from .debug import dump_graphs
from .capture import GraphPair, Recorder, capture_step
from .errors import InfeasibleMemoryLimit, InvalidMemoryLimit, InvalidProfile, UnsupportedModel
from .graph import NodeTable, StepGraph, build_step_graph
from .hardware import Hardware, Link, get_hardware
from .memory import Margin, MemoryModel
from .plan import Plan, activation_meta, activation_names
from .planners import Problem, get_planner
from .profile import Profile, ProfileOptions, analytic_profile, measure_link, measure_profile
from .runtime import HostPool, using_pool
from .schedule import build_schedule
from .simulator import simulate
from .units import parse_bytes

log = logging.getLogger("fxpooch.compile")


@dataclass(frozen=True)
class CompileOptions:
    """How to profile, plan and run.

    ``profile``: "measure" (CUDA events / CPU timer), "analytic" (roofline of ``hardware``), a
    :class:`Profile`, or a path to a saved one. ``profile_mode`` (when measuring): "in-situ",
    "per-node", or "auto" (in situ when the in-core step fits under the limit, else each node
    alone). ``margin``: device memory kept out of the plan for the allocator's fragmentation, a
    :class:`~fxpooch.memory.Margin`, bytes, or None: 5% of the limit on CUDA, 0 on CPU and meta.
    ``host_pool_limit``: bytes the pinned pool of host copies may hold (None: unbounded);
    exceeding it raises :class:`~fxpooch.errors.HostPoolExhausted`.
    """

    planner: str = "local"
    profile: str | Profile | os.PathLike = "measure"
    hardware: str | Hardware | None = None  # analytic costs and the default link
    link: Link | None = None  # overrides the hardware's link
    profile_mode: str = "auto"
    margin: Margin | int | str | None = None
    host_pool_limit: int | str | None = None

    def __post_init__(self) -> None:
        ProfileOptions(self.profile_mode)  # fail fast on an unknown mode

    def margin_for(self, device: torch.device) -> Margin:
        if self.margin is None:
            return Margin.default_for(device)
        if isinstance(self.margin, Margin):
            return self.margin
        return Margin(nbytes=parse_bytes(self.margin))


_entries = itertools.count()


def _compile_entry(model: nn.Module, recorder: Recorder) -> Any:
    entry = compat.fresh_entry(model, f"fxpooch_step_{next(_entries)}")
    return torch.compile(entry, backend=recorder.backend, dynamic=False)


def _split_example(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_input, torch.Tensor):
        return (example_input,), {}
    if isinstance(example_input, tuple):
        return example_input, {}
    if isinstance(example_input, Mapping) and all(isinstance(k, str) for k in example_input):
        return (), dict(example_input)
    raise UnsupportedModel(
        f"example_input must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(example_input).__name__}")


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    leaves, spec = compat.tree_flatten((args, kwargs))
    return (str(spec),) + tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)
        for x in leaves)


def _modes(model: nn.Module) -> tuple[bool, ...]:
    """Every module's ``training`` flag: ``model.bn.eval()`` alone changes the graphs too."""
    return tuple(m.training for m in model.modules())


def _step_device(model: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in [*model.parameters(), *compat.tree_leaves((args, kwargs))]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class CompiledModule(nn.Module):
    """Runs ``model`` through the planned graphs; called exactly like ``model``."""

    def __init__(self, model: nn.Module, mem_limit: int, options: CompileOptions):
        super().__init__()
        self.model = model
        self.mem_limit = mem_limit
        self.options = options
        self._recorder = Recorder()
        self._compiled = _compile_entry(model, self._recorder)
        self._plans: dict[tuple, _Planned] = {}
        self._current: _Planned | None = None
        limit = options.host_pool_limit
        self.host_pool = HostPool(limit_bytes=None if limit is None else parse_bytes(limit))

    # -- public inspection -----------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        if self._current is None:
            raise RuntimeError("no plan yet: call the compiled module once")
        return self._current.plan

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of host (pinned on CUDA) memory this module's pool holds for swapped activations."""
        return self.host_pool.total_bytes

    @property
    def forward_graphs(self) -> list[torch.fx.GraphModule]:
        """The rewritten forward GraphModules of the current plan, in execution order."""
        return [p.run_forward for p in self._current.pairs]

    @property
    def backward_graphs(self) -> list[torch.fx.GraphModule]:
        return [p.run_backward for p in self._current.pairs]

    # -- running ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if compat.is_cuda_graph_capturing():
            raise UnsupportedModel("fxpooch cannot run under CUDA graph capture: its copies use side streams and "
                                   "host memory; capture the model without fxpooch, or run fxpooch eagerly")
        if compat.dispatch_mode_active():
            log.warning("a TorchDispatchMode is active: dynamo runs the model eagerly, without fxpooch's plan")
        if not torch.is_grad_enabled():
            # no_grad / inference_mode (evaluation): no backward, nothing saved, nothing to plan
            with compat.dynamo_limits():
                return self._compiled(*args, **kwargs)
        key = (_modes(self.model), _signature(args, kwargs))
        planned = self._plans.get(key)
        if planned is None:
            if self._plans:
                log.info("new input signature: planning again (%d plans cached)", len(self._plans))
            planned = self._plan_for(args, kwargs)
            self._plans[key] = planned
        if planned is not self._current:
            planned.bind()
            self._current = planned
        with using_pool(self.host_pool), compat.dynamo_limits():
            return self._compiled(*args, **kwargs)

    def _plan_for(self, args: tuple, kwargs: dict) -> _Planned:
        return _make_plan(self._compiled, self._recorder, self.model, args, kwargs, self.mem_limit, self.options)


def _resolve_profile(options: CompileOptions, graph: StepGraph, table: NodeTable, inputs: list,
                     device: torch.device, budget: int) -> Profile:
    hardware = options.hardware
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    if isinstance(options.profile, Profile):
        profile = options.profile
    elif options.profile not in ("analytic", "measure") and isinstance(options.profile, (str, os.PathLike)) \
            and os.path.exists(options.profile):
        profile = Profile.load(options.profile)
    elif options.profile == "analytic" or device.type == "meta":
        hw = hardware or get_hardware("cpu" if device.type == "cpu" else "h100-pcie5")
        profile = analytic_profile(graph, table, hw)
    elif options.profile == "measure":
        link = options.link or (hardware.link if hardware else None)
        if link is None:
            link = measure_link(device) if device.type == "cuda" else get_hardware("cpu").link
        profile = measure_profile(graph, table, inputs, link, ProfileOptions(options.profile_mode), budget)
    else:
        raise InvalidProfile(
            f"profile={options.profile!r}: pass 'measure', 'analytic', a Profile or the path of a saved profile")
    return profile.with_link(options.link) if options.link else profile


def _make_plan(compiled: Any, recorder: Recorder, model: nn.Module, args: tuple, kwargs: dict, mem_limit: int,
               options: CompileOptions) -> _Planned:
    """Capture one step, profile it, plan it. Nothing is rewritten or bound yet."""
    device = _step_device(model, args, kwargs)
    memory = MemoryModel.for_device(device)
    with compat.dynamo_limits():
        pairs, pair_inputs = capture_step(compiled, recorder, model, args, kwargs)
    resident = memory.resident_bytes(
        [*model.parameters(), *model.buffers(),
         *(t for t in compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))])
    graph, table = build_step_graph(pairs, memory, resident)
    margin = options.margin_for(device)
    reserve = margin.of(mem_limit)
    profile = _resolve_profile(options, graph, table, pair_inputs, device, mem_limit - reserve)
    del pair_inputs
    costs = profile.costs(graph)
    name = options.planner
    try:
        candidate = get_planner(name)(Problem(graph, costs, mem_limit - reserve))
    except InfeasibleMemoryLimit as e:
        if not reserve:
            raise
        raise InfeasibleMemoryLimit(mem_limit, margin.limit_for(e.min_feasible_bytes), e.live, e.planner,
                                    margin_bytes=reserve) from None
    in_core = simulate(graph, build_schedule(graph, [d.KEEP for d in candidate.decisions]), costs)
    plan = Plan(
        planner=name, mem_limit=mem_limit, peak_bytes=candidate.timeline.peak_bytes,
        step_time=candidate.step_time, in_core_time=in_core.step_time, in_core_peak_bytes=in_core.peak_bytes,
        decisions={n: d.value for n, d in zip(activation_names(graph), candidate.decisions)},
        graph=graph, schedule=candidate.schedule, timeline=candidate.timeline, profile=profile,
        activation_meta=activation_meta(graph, table), margin_bytes=reserve,
    )
    log.info("planned with %s: peak %d bytes (limit %d), %s", name, plan.peak_bytes, mem_limit, plan.counts())
    return _Planned(plan, graph, table, pairs)


@dataclass
class _Planned:
    plan: Plan
    graph: StepGraph
    table: NodeTable
    pairs: list[GraphPair]
    bound: bool = False

    def bind(self) -> None:
        from fxpooch.passes import rewrite_pair

        from ._torch_compat import set_boxed_codegen

        for g, pair in enumerate(self.pairs):
            rewritten = rewrite_pair(g, self.graph, self.table, self.plan.schedule)
            dump_graphs(g, pair, rewritten)
            set_boxed_codegen(rewritten.forward)
            set_boxed_codegen(rewritten.backward)
            pair.bind(rewritten.forward, rewritten.backward)


def _check_call(model: nn.Module, example_input: Any, mem_limit: int | str, planner: str):
    if not isinstance(model, nn.Module):
        raise UnsupportedModel(f"model must be a torch.nn.Module, got {type(model).__name__}")
    limit = parse_bytes(mem_limit)
    get_planner(planner)  # fail fast on an unknown name
    args, kwargs = _split_example(example_input)
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModel("the model has no parameters that require grad: there is no training step "
                               "to plan (use torch.no_grad() inference instead)")
    devices = {t.device for t in [*model.parameters(), *compat.tree_leaves((args, kwargs))]
               if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise UnsupportedModel(f"the model and its example input are on different devices ({sorted(map(str, devices))});"
                               " move both to the device you train on (e.g. model.to(x.device))")
    device = next(iter(devices))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if limit > total:
            raise InvalidMemoryLimit(f"mem_limit={limit} bytes is more than {device} has ({total} bytes); "
                                     "pass at most the device's memory")
    return limit, args, kwargs


def plan(model: nn.Module, example_input: Any, mem_limit: int | str, *, planner: str = "local",
         profile: str | Profile | os.PathLike = "analytic", hardware: str | Hardware | None = None,
         link: Link | None = None, profile_mode: str = "auto", margin: Margin | int | str | None = None) -> Plan:
    """Plan without running anything: works on a model and inputs on the ``meta`` device.

    On meta tensors, bytes are counted as CUDA's allocator would and times come from the
    analytic model of ``hardware``. Nothing is rewritten; the model's state is untouched.
    The other arguments are as in :func:`compile` (see :class:`CompileOptions`).
    """
    limit, args, kwargs = _check_call(model, example_input, mem_limit, planner)
    recorder = Recorder()
    compiled = _compile_entry(model, recorder)
    return _make_plan(compiled, recorder, model, args, kwargs, limit,
                      CompileOptions(planner, profile, hardware, link, profile_mode, margin)).plan


def compile(model: nn.Module, example_input: Any, mem_limit: int | str, *, planner: str = "local",
            profile: str | Profile | os.PathLike = "measure", hardware: str | Hardware | None = None,
            link: Link | None = None, profile_mode: str = "auto", margin: Margin | int | str | None = None,
            host_pool_limit: int | str | None = None) -> CompiledModule:
    """Plan ``model``'s training step to fit ``mem_limit`` and return a module that runs that plan.

    The model's forward runs once here to trace it, without holding its activations (its
    buffers and the RNG state are put back); a measured profile times each node in situ if the
    in-core step fits, else each node alone. The returned module's backward puts gradients on
    ``model``'s parameters. ``profile_mode``, ``margin`` and ``host_pool_limit``: see
    :class:`CompileOptions`.
    """
    limit, args, kwargs = _check_call(model, example_input, mem_limit, planner)
    options = CompileOptions(planner, profile, hardware, link, profile_mode, margin, host_pool_limit)
    compiled = CompiledModule(model, limit, options)
    planned = compiled._plan_for(args, kwargs)
    compiled._plans[(_modes(model), _signature(args, kwargs))] = planned
    planned.bind()
    compiled._current = planned
    return compiled
