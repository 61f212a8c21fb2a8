"""``fxpooch.backend(...)``: fxpooch as a ``torch.compile`` backend, so every graph dynamo compiles is planned.

    model = torch.compile(model, backend=fxpooch.backend(mem_limit="16GiB"))
    model = torch.compile(model, backend="fxpooch", options={"mem_limit": "16GiB", "planner": "local"})
    FXPOOCH_MEM_LIMIT=16GiB  # read when no mem_limit is given (e.g. Trainer's torch_compile_backend="fxpooch")

Dynamo hands the backend one graph at a time and AOTAutograd partitions it into a forward and a
backward (a :class:`~fxpooch.capture.GraphPair`, captured by the same
:class:`~fxpooch.capture.Recorder` as :func:`fxpooch.compile`'s). A training step is the pairs whose
forwards run until the first one's backward has run. Planning follows the step:

* the first time a pair runs in a step that no plan covers, it is planned alone, before it runs,
  counting as resident what the step holds at that moment: the storages of its real inputs and the
  still-alive inputs and outputs of the step's earlier pairs (their kept activations included);
* once a step's backward is done, the step is planned again as one step over all its pairs, and the
  following steps run that plan; a step whose pairs match no plan (dynamo recompiled a graph, or the
  graph breaks differ) is planned the same way, its new pairs first alone, then as one step.

A pair whose backward is still to run is never re-bound, and each plan runs on its own
:class:`~fxpooch.runtime.Runtime` (slot table), so a step that switches plans halfway keeps every
forward with its own backward. Costs are analytic (the roofline of ``hardware``, the host preset
on CPU) or a saved :class:`~fxpooch.profile.Profile`: a graph is planned before it first runs, so it
cannot be timed in situ. The rewritten graphs are compiled by inductor by default (``codegen``).

Inductor's code takes memory no graph node has, so with it each whole-step plan's second step is
measured (:class:`~fxpooch.peakcheck.LiveCheck`: the allocator's peak, read as the next step starts)
and, while it is above the limit, the following steps run a plan made again with the excess kept
free (``peak_check_rounds``).
"""
from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import _torch_compat as compat
from . import peakcheck
from .api import _Planned, _profile_and_plan
from .capture import GraphPair, Recorder
from .codegen import compile_inference, decompositions
from .errors import InvalidMemoryLimit, InvalidOption, ReplanLimitExceeded, UnsupportedModel
from .graph import build_step_graph
from .limits import resolve_limit
from .memory import MemoryModel
from .options import CompileOptions
from .pipeline import TracedStep
from .plan import Plan
from .planned import sharing_code
from .runtime import HostPool, Runtime
from .units import parse_bytes, parse_limit

log = logging.getLogger("fxpooch.backend")

#: the environment variable read for the limit when none is given
ENV_MEM_LIMIT = "FXPOOCH_MEM_LIMIT"
#: what the backend defaults differ in from :class:`CompileOptions`'
BACKEND_DEFAULTS = {"codegen": "inductor", "profile": "analytic"}


@dataclass
class _Storages:
    """Storages seen in a step, by identity: bytes, and a weak reference that says whether it still lives."""

    memory: MemoryModel
    device: torch.device
    live: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)

    def add(self, values: Any) -> None:
        for t in compat.tree_leaves(values):
            if isinstance(t, torch.Tensor) and t.device == self.device:  # host copies are not device memory
                key = compat.storage_key(t)
                if key not in self.live:
                    self.live[key] = (weakref.ref(t.untyped_storage()), self.memory.storage_bytes(t))
                grad = t.grad if t.is_leaf and t.requires_grad else None
                if grad is not None:  # an accumulated gradient stays resident through the step
                    self.add(grad)

    def bytes(self, exclude: set[int] = frozenset()) -> int:
        return sum(n for k, (ref, n) in self.live.items() if k not in exclude and ref() is not None)


@dataclass
class _Step:
    """The pairs of the step running now, what they read and what they returned."""

    memory: MemoryModel
    device: torch.device
    pairs: list[GraphPair] = field(default_factory=list)
    inputs: _Storages = None  # type: ignore[assignment]
    outputs: _Storages = None  # type: ignore[assignment]  # all of them: user outputs and saved values
    made: set[int] = field(default_factory=set)  # storages of the user outputs (the next graphs' inputs)
    check: peakcheck.LiveCheck | None = None  # measuring this step's peak, if its pairs are the checked plan's

    def __post_init__(self) -> None:
        self.inputs, self.outputs = _Storages(self.memory, self.device), _Storages(self.memory, self.device)

    def returned(self, pair: GraphPair, out: Any) -> None:
        self.outputs.add(out)
        self.made.update(compat.storage_key(t) for t in compat.tree_leaves(list(out)[:pair.num_user_outputs])
                         if isinstance(t, torch.Tensor))

    def reads_made(self, args: list[Any]) -> bool:
        """Whether ``args`` include a user output of this step's pairs that is still alive (a graph run
        on what the step made; a dead one's storage key may have been reused)."""
        for t in compat.tree_leaves(args):
            key = compat.storage_key(t) if isinstance(t, torch.Tensor) else None
            entry = self.outputs.live.get(key) if key in self.made else None
            if entry is not None and entry[0]() is not None:
                return True
        return False

    def held_bytes(self, args: list[Any]) -> int:
        """What is resident for a pair about to run with ``args``: what the step holds, and its inputs."""
        held = _Storages(self.memory, self.device, {**self.inputs.live, **self.outputs.live})
        held.add(args)
        return held.bytes()

    def resident_bytes(self) -> int:
        """What was resident before the step: its pairs' inputs that no earlier pair returned."""
        return self.inputs.bytes(exclude=self.made)


class Backend:
    """A ``torch.compile`` backend that plans, rewrites and compiles each graph it is given.

    Call :func:`backend` to make one. Inspection mirrors :class:`~fxpooch.api.CompiledModule`:
    ``plan`` (the plan of the last step that ran), ``forward_graphs`` / ``backward_graphs`` (its
    rewritten GraphModules), ``graph_code`` (what runs), ``plans`` (every plan made) and ``replans``.
    """

    def __init__(self, mem_limit: int | str, options: CompileOptions):
        self.mem_limit = mem_limit
        self.options = options
        limit = options.host_pool_limit
        self.host_pool = HostPool() if limit is None else HostPool(limit_bytes=parse_bytes(limit, "host_pool_limit"))
        self.recorder = Recorder(decompositions(options.codegen), on_run=self._on_forward,
                                 after_backward=self._after_backward)
        if options.codegen == "inductor":  # evaluation graphs (no_grad) are compiled too, unplanned
            self.recorder.inference = compile_inference
        #: whole-step plans, by the step's pairs
        self.plans: dict[tuple[GraphPair, ...], _Planned] = {}
        self._alone: dict[GraphPair, _Planned] = {}  # each pair planned alone, when it first ran
        self._runtimes: dict[int, Runtime] = {}  # id(planned) -> its slot table
        self._current: _Planned | None = None
        self._last: _Planned | None = None
        self._step: _Step | None = None
        self._done: tuple[tuple[GraphPair, ...], int] | None = None  # a finished step still to plan as one
        #: with inductor, the measured-step check of each whole-step plan (:class:`~fxpooch.peakcheck.LiveCheck`:
        #: its ``measured`` steps, its ``result`` once one fits the limit)
        self.checks: dict[tuple[GraphPair, ...], peakcheck.LiveCheck] = {}
        self._variants: dict[tuple[GraphPair, ...], list[_Planned]] = {}  # the plans each check compiled
        self._ended: tuple[tuple[GraphPair, ...], peakcheck.LiveCheck] | None = None  # a measured step to read
        #: plans made after the first one
        self.replans = 0

    # -- the dynamo backend ----------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        if any(_symbolic(v) for v in example_inputs):
            raise UnsupportedModel(
                "dynamo compiled this graph with dynamic shapes (it has seen inputs of several sizes), and "
                "fxpooch plans the bytes of fixed sizes: compile with torch.compile(model, backend=..., "
                "dynamic=False); each input size then gets its own plan (up to max_plans)")
        return self.recorder.backend(gm, example_inputs)

    # -- inspection ------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise RuntimeError("no plan yet: run a training step of the compiled model first")
        return self._last.plan

    @property
    def forward_graphs(self) -> list[fx.GraphModule]:
        """The rewritten forwards of the last plan used, in order (the inputs of the code that runs)."""
        return [f for f, _, _ in self._bound(self._last)]

    @property
    def backward_graphs(self) -> list[fx.GraphModule]:
        return [b for _, b, _ in self._bound(self._last)]

    @property
    def graph_code(self) -> list[tuple[Any, Any]]:
        return [c for _, _, c in self._bound(self._last)]

    def _bound(self, planned: _Planned | None) -> list[tuple]:
        if planned is None or planned.rewritten is None:
            raise RuntimeError("no plan yet: run a training step of the compiled model first")
        return planned.rewritten

    # -- planning --------------------------------------------------------------------------
    def _on_forward(self, pair: GraphPair, args: list[Any]) -> Callable[[list[Any]], Any]:
        device = _device(args)
        if self._ended is not None:
            (pairs, check), self._ended = self._ended, None
            self._measured(pairs, check)
        if self._step is not None and pair in self._step.pairs and self._step.reads_made(args):
            raise _repeated_graph_error(pair)
        if self._step is None or pair in self._step.pairs:  # a new step (the last one's backward never ran)
            if self._step is not None and self._step.check is not None:
                self._step.check.abandon()
            self._step = _Step(MemoryModel.for_device(device), device)
        step = self._step
        if not step.pairs and self._done is not None:
            self._plan_finished_step(device)
        planned = self._covering(step.pairs, pair)
        check = self.checks.get(planned.key[0]) if not step.pairs and planned is not None else None
        if check is not None and check.result is None:  # a step of a plan still to measure
            step.check = check
            check.begin()
        if planned is None:
            planned = self._plan_alone(pair, device, step.held_bytes(args))
        planned.bind(only=pair, runtime=self._runtime_of(planned))
        self._last = planned
        step.inputs.add(args)
        step.pairs.append(pair)

        def run(inputs: list[Any]) -> Any:
            out = pair.code[0](inputs)
            step.returned(pair, out)
            return out

        return run

    def _after_backward(self, pair: GraphPair) -> None:
        step = self._step
        if step is not None and step.pairs and pair is step.pairs[0]:  # the step's last backward
            self._done = (tuple(step.pairs), step.resident_bytes())
            self._step = None
            if step.check is not None:  # read before the next step, outside the backward
                step.check.end()
                self._ended = tuple(step.pairs), step.check

    def _covering(self, ran: list[GraphPair], pair: GraphPair) -> _Planned | None:
        """A whole-step plan whose pairs start with ``ran`` then ``pair`` (the current one first)."""
        prefix = [*ran, pair]
        candidates = [self._current] if self._current is not None else []
        for planned in [*candidates, *self.plans.values()]:
            if list(planned.pairs[:len(prefix)]) == prefix:
                self._current = planned
                return planned
        return None

    def _plan_alone(self, pair: GraphPair, device: torch.device, resident: int) -> _Planned:
        known = self._alone.get(pair)
        if known is None:
            log.info("planning graph %d alone before it first runs (%d resident bytes)", pair.index, resident)
            known = self._alone[pair] = self._make([pair], device, resident)
        return known

    def _plan_finished_step(self, device: torch.device) -> None:
        (pairs, resident), self._done = self._done, None
        if pairs in self.plans:
            return
        log.info("planning the %d graph(s) of the last step as one step", len(pairs))
        self._current = self.plans[pairs] = planned = self._make(list(pairs), device, resident)
        options = self.options
        if options.checks_peak(device):
            self.checks[pairs] = peakcheck.LiveCheck(planned.plan, device, rounds=options.peak_check_rounds,
                                                     planner=options.planner, margin=options.margin_for(device))
            self._variants[pairs] = [planned]

    def _measured(self, pairs: tuple[GraphPair, ...], check: peakcheck.LiveCheck) -> None:
        """A step that ``check`` measured (or not) has ended: from the next step on, run the plan it
        chose; raises :class:`~fxpooch.errors.InfeasibleMemoryLimit` when no plan fits."""
        if self.checks.get(pairs) is not check:  # the step ran other graphs than the plan measured
            check.abandon()
            return
        try:
            plan = check.collect()
        except Exception:
            del self.checks[pairs]
            raise
        if check.result is not None:
            log.info("the step measured %d bytes, within the limit of %d", check.result.peak_bytes, check.plan.mem_limit)
        if plan is not None:
            self._current = self.plans[pairs] = sharing_code(self.plans[pairs], plan, self._variants[pairs])

    def _make(self, pairs: list[GraphPair], device: torch.device, resident: int) -> _Planned:
        made = len(self.plans) + len(self._alone)
        if made >= self.options.max_plans:
            raise ReplanLimitExceeded(made, f"dynamo compiled graph {pairs[-1].index} "
                                            f"({self.recorder.causes.get(pairs[-1], 'a new graph')})")
        self.replans += made > 0
        memory = MemoryModel.for_device(device)
        graph, table = build_step_graph(pairs, memory, resident)
        step = TracedStep(graph, table, pairs, [], [], (), device)
        limit = resolve_limit(self.mem_limit, device, self.options.hardware)
        planned = _Planned.of(_profile_and_plan(step, limit, self.options), step, self.options.codegen)
        self.host_pool.check_plan(planned.plan.host_bytes)
        return planned

    def _runtime_of(self, planned: _Planned) -> Runtime:
        runtime = self._runtimes.get(id(planned))
        if runtime is None:
            runtime = self._runtimes[id(planned)] = Runtime(self.host_pool)
        return runtime


def _repeated_graph_error(pair: GraphPair) -> UnsupportedModel:
    return UnsupportedModel(
        f"dynamo graph {pair.index} runs twice in one step, the second time on what the step made (a compiled "
        "module called in a loop, or identical blocks compiled one by one, which share one graph: FSDP2's "
        "torch.compile per block): fxpooch plans each graph once per step. Compile the whole model (with "
        "FSDP2: fully_shard each block and the root, then fxpooch.compile(root, ...))")


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))


def _device(args: list[Any]) -> torch.device:
    for t in args:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def backend(mem_limit: int | str | None = None, **options: Any) -> Backend:
    """A ``torch.compile`` backend that plans every graph dynamo compiles to fit ``mem_limit``.

    ``mem_limit`` as in :func:`fxpooch.compile` (None: the ``FXPOOCH_MEM_LIMIT`` environment
    variable). ``options``: the fields of :class:`~fxpooch.options.CompileOptions` (``planner``,
    ``hardware``, ``link``, ``margin``, ``host_pool_limit``, ``max_plans``, ``codegen``, and
    ``profile``: "analytic" or a saved Profile), with ``codegen="inductor"`` and ``profile="analytic"``
    by default. Use one backend per model: it follows the steps of the graphs it compiled.
    """
    if mem_limit is None:
        mem_limit = os.environ.get(ENV_MEM_LIMIT)
        if mem_limit is None:
            raise InvalidMemoryLimit(f"no mem_limit: pass fxpooch.backend(mem_limit='16GiB'), torch.compile(..., "
                                     f"backend='fxpooch', options={{'mem_limit': '16GiB'}}), or set {ENV_MEM_LIMIT}")
    parse_limit(mem_limit)
    unknown = set(options) - {f for f in CompileOptions.__dataclass_fields__ if f != "profile_source"}
    if unknown:
        raise InvalidOption(f"unknown fxpooch backend option(s) {sorted(unknown)}: pass fields of "
                            "fxpooch.CompileOptions (planner, hardware, link, margin, host_pool_limit, max_plans, "
                            "codegen, profile)")
    resolved = CompileOptions(**{**BACKEND_DEFAULTS, **options})
    if resolved.profile_source == "measure":
        raise InvalidOption("profile='measure': the backend plans each graph before it first runs, so it cannot time "
                            "it; pass profile='analytic' (with hardware=...) or a Profile saved by fxpooch.compile")
    return Backend(mem_limit, resolved)


#: one backend per set of options given to the registered name, so the graphs of one model share it
_NAMED: dict[str, Backend] = {}


def registered(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
               mode: str | None = None) -> Callable:
    """The ``"fxpooch"`` backend name: ``torch.compile(model, backend="fxpooch", options={...})``.

    ``options`` holds ``mem_limit`` and the keyword arguments of :func:`backend`; without
    ``mem_limit`` the ``FXPOOCH_MEM_LIMIT`` environment variable is read. Models compiled with equal
    options share one backend; to compile two models at once, give each its own :func:`backend`.
    """
    if mode not in (None, "default"):
        raise InvalidOption(f"mode={mode!r}: the fxpooch backend takes no torch.compile mode; pass its options "
                            "with options={...}")
    return named_backend(options)(gm, example_inputs)


def named_backend(options: dict[str, Any] | None = None) -> Backend:
    """The :class:`Backend` that ``torch.compile(..., backend="fxpooch", options=options)`` uses (made
    now if no graph was compiled with these options yet), to inspect its plans."""
    options = dict(options or {})
    key = repr(sorted(options.items())) + os.environ.get(ENV_MEM_LIMIT, "")
    if key not in _NAMED:
        _NAMED[key] = backend(options.pop("mem_limit", None), **options)
    return _NAMED[key]


compat.register_backend("fxpooch", registered)

__all__ = ["ENV_MEM_LIMIT", "Backend", "backend", "named_backend", "registered"]
