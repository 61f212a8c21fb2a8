"""The pipeline as public stages: trace a step, profile it, plan it, re-plan a plan.

Every caller (``fxpooch.compile``, ``fxpooch.plan``, ``python -m fxpooch``, the benchmarks) runs
these, so the pipeline reads in one place::

    import torch, fxpooch
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    x = torch.randn(512, 512)
    step = fxpooch.trace_step(model, (x,))                           # Step 1: capture -> StepGraph
    profile = fxpooch.profile_step(step, "analytic", hardware="cpu")  # Step 2: seconds per op
    plan = fxpooch.plan_graph(step.graph, step.table, profile, 16 * 2**20)  # Step 3: Problem -> Plan
    swaps = fxpooch.replan(plan, planner="swap-all")                 # same graph and costs, no capture

Nothing here rewrites a graph or runs the plan: that is :func:`fxpooch.compile`'s job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat
from .capture import GraphPair, Recorder, capture_step
from .bytesize import format_bytes
from .errors import InfeasibleMemoryLimit, InvalidOption
from .fsdp import local_tensor
from .graph import NodeTable, StepGraph, build_step_graph
from .hardware import Hardware, Link, get_hardware
from .limits import DEFAULT_META_HARDWARE, HOST_PRESET
from .memory import Margin, MemoryModel
from .options import resolve_hardware, resolve_profile_source
from .plan import Plan, activation_meta, activation_names, module_paths
from .planners import Candidate, Planner, Problem, resolve_planner
from .calibrate import measure_host_link, measure_link
from .profile import Profile, analytic_profile
from .timing import ProfileOptions, measure_profile
from .progress import stage
from .schedule import Decision, build_schedule
from .simulator import in_core_peak_bytes, simulate

log = logging.getLogger("fxpooch.pipeline")

_entries = itertools.count()


@dataclass
class TracedStep:
    """One captured training step, as the later stages read it.

    ``graph`` / ``table``: the framework-free :class:`StepGraph` and its map back to FX nodes.
    ``pairs``: the captured graph pairs, in the order their forwards ran. ``inputs``: each pair's
    captured forward inputs (a measured profile reads them in situ; :func:`profile_step` drops
    them). ``changed_buffers``: the module buffers the forward changes. ``grads``: which
    parameters held a ``.grad``. ``device``: where the step runs.
    """

    graph: StepGraph
    table: NodeTable
    pairs: list[GraphPair]
    inputs: list[list[Any]]
    changed_buffers: list[tuple[nn.Module, str]]
    grads: tuple[bool, ...]
    device: torch.device

    @property
    def key(self) -> tuple:
        """What a plan of this step is cached by: its graph pairs and gradient state."""
        return tuple(self.pairs), self.grads


def compile_entry(model: nn.Module, recorder: Recorder) -> Any:
    """``model`` under ``torch.compile`` with ``recorder`` as the backend, as a fresh dynamo entry."""
    entry = compat.fresh_entry(model, f"fxpooch_step_{next(_entries)}")
    return torch.compile(entry, backend=recorder.backend, dynamic=False)


def grad_state(model: nn.Module) -> tuple[bool, ...]:
    """Which parameters already hold a ``.grad`` (gradient accumulation keeps them resident)."""
    return tuple(p.grad is not None for p in model.parameters())


def step_device(model: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in [*model.parameters(), *compat.tree_leaves((args, kwargs))]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def trace_step(model: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None, *,
               compiled: Any = None, recorder: Recorder | None = None, undo_copies: bool = True,
               outputs_held: bool = True, held_bytes: int = 0, gradients_reduced: bool = False) -> TracedStep:
    """Step 1: run one training step of ``model(*args, **kwargs)`` to capture its graphs (without
    holding its activations; buffers and RNG state are put back) and build its :class:`StepGraph`.

    ``compiled`` / ``recorder``: an entry from :func:`compile_entry` to capture through (a compiled
    module keeps one for all its steps); by default a fresh one. ``undo_copies``: count as resident
    the copies a compiled module keeps of the buffers the forward changes (to undo a step that an
    unplanned graph stops); the benchmarks, which plan the bare step, leave them out. Works on the
    ``meta`` device. ``outputs_held``: the caller holds the model's outputs until the step ends
    (the default), or drops them before the backward (:func:`fxpooch.graph.build_step_graph`).
    ``held_bytes``: device memory a wrapper holds through the step beyond the model's tensors
    (DDP's gradient buckets, :func:`fxpooch.distributed.held_bytes`; FSDP's gathered parameters,
    :func:`fxpooch.fsdp.held_bytes`), counted as resident. ``gradients_reduced``: FSDP frees each
    backward graph's gradients once it returns (:func:`fxpooch.graph.build_step_graph`).

    >>> import torch, fxpooch
    >>> step = fxpooch.trace_step(torch.nn.Linear(512, 512), (torch.randn(512, 512),))
    >>> len(step.pairs), step.graph.resident_bytes > 0
    (1, True)
    """
    kwargs = {} if kwargs is None else kwargs
    if recorder is None:
        recorder = Recorder()
        compiled = compile_entry(model, recorder)
    changed: list[tuple[nn.Module, str]] = []
    with compat.dynamo_limits(), stage("capturing the training step"):
        pairs, inputs = capture_step(compiled, recorder, model, args, kwargs, changed)
    device = step_device(model, args, kwargs)
    # resident through the step: parameters, buffers, existing gradients (accumulated into), inputs,
    # and the copies of the buffers the forward changes (kept to undo a step that an unplanned graph stops)
    # (a parameter FSDP shards counts as the rank's shard)
    resident = [*map(local_tensor, model.parameters()), *model.buffers(),
                *(local_tensor(p.grad) for p in model.parameters() if p.grad is not None),
                *(t for t in compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                *(torch.empty_like(mod._buffers[name]) for mod, name in changed if undo_copies)]
    memory = MemoryModel.for_device(device)
    graph, table = build_step_graph(pairs, memory, memory.resident_bytes(resident) + held_bytes,
                                    outputs_held=outputs_held, gradients_reduced=gradients_reduced)
    return TracedStep(graph, table, pairs, inputs, changed, grad_state(model), device)


def profile_step(step: TracedStep, profile: str | Profile | os.PathLike = "analytic", *,
                 hardware: str | Hardware | None = None, link: Link | None = None, mode: str = "auto",
                 mem_limit: int | None = None, fused: bool = False) -> Profile:
    """Step 2: seconds per op of ``step`` (and the link's copy times).

    ``profile``: "analytic" (roofline of ``hardware``; always so on the meta device), "measure"
    (times each node: in situ on the captured inputs when the in-core step fits ``mem_limit``, else
    each node alone; ``mode`` forces one), a :class:`Profile` or the path of a saved one. ``link``
    overrides the profile's link. ``fused``: analytic times as a fusing compiler runs the graphs
    (``codegen="inductor"``: a pointwise chain is one kernel). The captured inputs are dropped from
    ``step`` afterwards.

    >>> import torch, fxpooch
    >>> step = fxpooch.trace_step(torch.nn.Linear(512, 512), (torch.randn(512, 512),))
    >>> fxpooch.profile_step(step, "analytic", hardware="v100-pcie3").source
    'analytic:v100-pcie3'
    """
    source, hardware, device = resolve_profile_source(profile), resolve_hardware(hardware), step.device
    inputs, step.inputs = step.inputs, []
    if isinstance(source, Profile):
        result = source
    elif source == "analytic" or device.type == "meta":
        hw = hardware or get_hardware(HOST_PRESET if device.type == "cpu" else DEFAULT_META_HARDWARE)
        result = analytic_profile(step.graph, step.table, hw, fused)
    else:
        options = ProfileOptions(mode)
        measured_link = link or (hardware.link if hardware else None)
        if measured_link is None:
            measured_link = measure_link(device) if device.type == "cuda" else measure_host_link(options=options)
        peak = in_core_peak_bytes(step.graph) if options.mode == "auto" else None
        result = measure_profile(step.graph, step.table, inputs, measured_link, options, mem_limit, peak)
    return result.with_link(link) if link else result


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cyclic garbage collector off inside (reference counting still frees memory).

    A planner allocates millions of small tuples (schedules) while its evaluator holds a few
    hundred plans: each full collection walks them all. On GPT-2 at 12 layers ``local``'s 5 full
    collections took 1.0 of 4.8 s, and with the collector off it planned in 2.6 to 3.5 s against
    4.5 to 5.0 s. Nothing a planner makes needs the collector until it returns.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _solve(graph: StepGraph, profile: Profile, mem_limit: int, planner: str | Planner,
           margin: Margin) -> tuple[str, Candidate, int]:
    """Run the planner on the limit less the margin; an infeasible limit is reported with the margin."""
    name, solve = resolve_planner(planner)
    reserve = margin.of(mem_limit)
    try:
        with _cyclic_gc_paused():
            candidate = solve(Problem(graph, profile.costs(graph), mem_limit - reserve))
    except InfeasibleMemoryLimit as e:
        if not reserve:
            raise
        raise InfeasibleMemoryLimit(mem_limit, margin.limit_for(e.min_feasible_bytes), e.live, e.planner,
                                    margin_bytes=reserve) from None
    budget = mem_limit - reserve
    if candidate.timeline.peak_bytes > budget:  # a planner passed as a function may return any plan
        raise InvalidOption(
            f"planner {name!r} returned a plan whose peak ({format_bytes(candidate.timeline.peak_bytes)}) is above "
            f"the {format_bytes(budget)} it was given (mem_limit less the margin): a planner returns a plan "
            "within Problem.mem_limit, or raises InfeasibleMemoryLimit")
    return name, candidate, reserve


def _decisions(graph: StepGraph, candidate: Candidate) -> dict[str, str]:
    return {n: d.value for n, d in zip(activation_names(graph), candidate.decisions)}


def plan_graph(graph: StepGraph, table: NodeTable, profile: Profile, mem_limit: int, *,
               planner: str | Planner = "local", margin: Margin = Margin()) -> Plan:
    """Step 3: decide keep / swap / recompute for every activation of ``graph`` to fit ``mem_limit``
    bytes (``margin`` of it kept for the allocator), and simulate the result: a :class:`Plan`. The
    plan's graph is ``graph`` with ``profile``'s scratch bytes per op (:meth:`Profile.charged`).

    ``planner``: a registered name or a function ``Problem -> Candidate``. An impossible limit
    raises :class:`~fxpooch.errors.InfeasibleMemoryLimit` with the smallest feasible one.

    >>> import torch, fxpooch
    >>> step = fxpooch.trace_step(torch.nn.Linear(512, 512), (torch.randn(512, 512),))
    >>> profile = fxpooch.profile_step(step, "analytic", hardware="v100-pcie3")
    >>> plan = fxpooch.plan_graph(step.graph, step.table, profile, 2**30)
    >>> plan.peak_bytes <= plan.mem_limit
    True
    """
    label = planner if isinstance(planner, str) else resolve_planner(planner)[0]
    graph = profile.charged(graph)  # the ops' scratch bytes, charged while each op runs
    with stage(f"planning with {label} ({len(graph.activations)} activations)"):
        name, candidate, reserve = _solve(graph, profile, mem_limit, planner, margin)
    costs = profile.costs(graph)
    in_core = simulate(graph, build_schedule(graph, [Decision.KEEP for _ in candidate.decisions]), costs)
    plan = Plan(
        planner=name, mem_limit=mem_limit, peak_bytes=candidate.timeline.peak_bytes,
        step_time=candidate.step_time, in_core_time=in_core.step_time, in_core_peak_bytes=in_core.peak_bytes,
        decisions=_decisions(graph, candidate), graph=graph, schedule=candidate.schedule,
        timeline=candidate.timeline, profile=profile, activation_meta=activation_meta(graph, table),
        margin_bytes=reserve, module_paths=module_paths(graph, table),
    )
    log.info("planned with %s: peak %d bytes (limit %d), %s", name, plan.peak_bytes, mem_limit, plan.counts())
    return plan


def problem_of(plan: Plan, mem_limit: int | None = None) -> Problem:
    """The :class:`Problem` a planner sees for ``plan``'s graph and costs under ``mem_limit`` bytes
    (default: the plan's limit less its margin), for the evaluator, bounds and exact search."""
    limit = plan.mem_limit - plan.margin_bytes if mem_limit is None else mem_limit
    return Problem(plan.graph, plan.profile.costs(plan.graph), limit)


def replan(plan: Plan, *, planner: str | Planner | None = None, mem_limit: int | None = None,
           margin: Margin = Margin()) -> Plan:
    """``plan``'s graph and costs planned again with another ``planner`` and/or ``mem_limit`` (no
    new capture or profile); the in-core figures carry over. ``margin`` as in :func:`plan_graph`.

    >>> import torch, fxpooch
    >>> plan = fxpooch.plan(torch.nn.Linear(512, 512), torch.randn(512, 512), "1GiB", hardware="v100-pcie3")
    >>> fxpooch.replan(plan, planner="swap-all").planner
    'swap-all'
    """
    planner = plan.planner if planner is None else planner
    mem_limit = plan.mem_limit if mem_limit is None else mem_limit
    name, candidate, reserve = _solve(plan.graph, plan.profile, mem_limit, planner, margin)
    return dataclasses.replace(
        plan, planner=name, mem_limit=mem_limit, peak_bytes=candidate.timeline.peak_bytes,
        step_time=candidate.step_time, schedule=candidate.schedule, timeline=candidate.timeline,
        decisions=_decisions(plan.graph, candidate), margin_bytes=reserve)


__all__ = ["TracedStep", "compile_entry", "plan_graph", "problem_of", "profile_step", "replan", "trace_step"]
