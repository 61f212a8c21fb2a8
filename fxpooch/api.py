"""``fxpooch.compile``: capture -> profile -> plan -> rewrite -> run, one plan per input shape."""
from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat
from . import distributed, fsdp, peakcheck
from .capture import GraphPair, Recorder, UnplannedGraph
from .codegen import decompositions
from .errors import InvalidMemoryLimit, PendingBackward, ReplanLimitExceeded, UnsupportedModel
from .hardware import Hardware, Link
from .limits import resolve_limit
from .memory import Margin
from .options import CompileOptions
from .pipeline import TracedStep, compile_entry, grad_state, plan_graph, profile_step, step_device, trace_step
from .plan import Plan
from .planned import Planned as _Planned
from .planned import sharing_code
from .planners import Planner, resolve_planner
from .profile import Profile
from .runtime import HostPool, Runtime
from .simulator import in_core_peak_bytes
from .state import StepSnapshot
from .units import InCoreShare, parse_bytes, parse_limit

log = logging.getLogger("fxpooch.compile")


def _guards_on_own_effects(cause: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"dynamo compiles a new graph each time this step runs ({cause}): the forward changes Python state "
        "that dynamo specialises on (it appends to a list, increments a counter, ...), so no plan can be made "
        "before the graph runs. Keep such state out of the compiled forward (wrap the function that changes it "
        "in torch.compiler.disable), or make it a tensor")


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


def _autocast_state() -> tuple:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


class CompiledModule(nn.Module):
    """Runs ``model`` through the planned graphs; called exactly like ``model``.

    Every graph pair that runs with gradients enabled belongs to the plan bound for the step. A
    plan is chosen by the input signature, the modules' modes, autocast and which parameters
    already hold gradients; if dynamo still compiles a graph the plan does not hold (one of its
    guards failed), the step is stopped before that graph runs, its effects so far are undone,
    and it runs again under a plan that holds the graph (made now if none does).
    """

    def __init__(self, model: nn.Module, mem_limit: int, options: CompileOptions):
        super().__init__()
        self.model = model
        self._sharded = fsdp.layout(model)  # FSDP2's blocks, each given a graph of its own
        self.mem_limit = mem_limit
        self.options = options = fsdp.options_for(options, self._sharded)
        self._recorder = Recorder(decompositions(options.codegen))
        if self._sharded is not None:
            fsdp.separate_graphs(model, self._sharded)
        self._compiled = compile_entry(model, self._recorder)
        self._wrapper = distributed.active_wrapper()  # the DDP wrapper the plans are made inside, if any
        self._by_wrapper: dict[nn.Module | None, tuple[dict, dict]] = {}  # the plans made inside other wrappers
        self._plans: dict[tuple, _Planned] = {}  # (graph pairs of the step, gradient state) -> plan
        self._predicted: dict[tuple, tuple] = {}  # what the Python side sees -> plan key last used for it
        self._current: _Planned | None = None
        #: plans made after the first one (a new input shape, train/eval switch, or graph dynamo recompiled)
        self.replans = 0
        #: bytes kept free beyond the margin in later plans: what the first compiled step measured above its plan
        self._kept_free = 0
        self._pending: tuple[GraphPair, int, list[weakref.ref]] | None = None
        limit = options.host_pool_limit
        self.host_pool = HostPool() if limit is None else HostPool(limit_bytes=parse_bytes(limit, "host_pool_limit"))
        #: the host pool, slot table and streams the planned graphs' ops run on, entered around each graph call
        self.runtime = self._recorder.runtime = Runtime(self.host_pool)

    # -- public inspection -----------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        if self._current is None:
            raise RuntimeError("no plan yet: call the compiled module once")
        return self._current.plan

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of host memory this module's pool holds for swapped activations (pinned on CUDA;
        ``host_pool.pinned_bytes`` says how much is page-locked)."""
        return self.host_pool.total_bytes

    @property
    def forward_graphs(self) -> list[torch.fx.GraphModule]:
        """The rewritten forward GraphModules of the current plan, in execution order: the objects
        that run (``codegen="fx"``), or the exact input of the code that runs (``codegen="inductor"``)."""
        return [p.run_forward for p in self._current.pairs]

    @property
    def backward_graphs(self) -> list[torch.fx.GraphModule]:
        return [p.run_backward for p in self._current.pairs]

    @property
    def graph_code(self) -> list[tuple[Any, Any]]:
        """What runs for each graph pair of the current plan: its (forward, backward) callables, the
        GraphModules themselves (``codegen="fx"``) or inductor's compiled graphs (``"inductor"``;
        ``.source_code`` is the generated code)."""
        return [p.code for p in self._current.pairs]

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
        self._check_sharding_unchanged()
        if distributed.active_wrapper() is not self._wrapper:
            self._enter_wrapper(distributed.active_wrapper())
        self._check_previous_backward()
        grads = grad_state(self.model)
        seen_as = self._seen_as(args, kwargs, grads)
        planned = self._plans.get(self._predicted.get(seen_as))
        if planned is None:
            planned = self._replan(args, kwargs, "a new input signature, module mode, autocast or gradient state")
        captured_upto = None  # number of graphs dynamo had compiled when this step was last captured
        for _ in range(self.options.max_plans + 2):
            self._use(planned)
            snapshot = StepSnapshot(planned.changed_buffers, (args, kwargs))
            try:
                with compat.dynamo_limits(), self._recorder.running_plan(planned.pairs):
                    out = self._compiled(*args, **kwargs)
            except UnplannedGraph as e:
                snapshot.restore()
                if captured_upto is not None and e.ran[-1].index >= captured_upto:
                    raise _guards_on_own_effects(e.cause) from None
                found = self._find(list(e.ran), grads, prefix=True)
                if found is None:
                    found = self._replan(args, kwargs, e.cause)
                    captured_upto = len(self._recorder.pairs)
                planned = found
                continue
            self._predicted[seen_as] = planned.key
            self._note_step(planned, out)
            return out
        raise ReplanLimitExceeded(len(self._plans), "the step kept running graphs of no plan")

    def _seen_as(self, args: tuple, kwargs: dict, grads: tuple[bool, ...]) -> tuple:
        """What the Python side sees of a step: a plan is looked up by it before any graph runs."""
        return _modes(self.model), _signature(args, kwargs), grads, _autocast_state()

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        """Plan (or find the plan of) a step with these inputs and bind it; with inductor, check the
        compiled step's measured peak (:mod:`fxpooch.peakcheck`)."""
        planned = self._checked(self._replan(args, kwargs, "compile"), args, kwargs)
        self._predicted[self._seen_as(args, kwargs, planned.grads)] = planned.key
        self._use(planned)

    def _checked(self, planned: _Planned, args: tuple, kwargs: dict) -> _Planned:
        """``planned``, or a plan made again under a tighter limit, whose compiled step measured within
        the limit on these inputs (where :meth:`CompileOptions.checks_peak`)."""
        rounds = self.options.peak_check_rounds
        device = step_device(self.model, args, kwargs)
        if not self.options.checks_peak(device):
            return planned
        if self._wrapper is not None or self._sharded is not None:
            log.info("the compiled step's peak is not measured inside a DDP or FSDP wrapper (it runs there, "
                     "with its hooks and buckets, only in the caller's step)")
            return planned
        variants = [planned]  # the plans compiled, each with its code

        def measure(plan: Plan) -> tuple[int, float]:
            candidate = sharing_code(planned, plan, variants)
            self._use(candidate)

            def step() -> None:
                with compat.dynamo_limits(), self._recorder.running_plan(candidate.pairs):
                    outputs = [self._compiled(*args, **kwargs)]
                peakcheck.run_backward(outputs, self.options.outputs_held)

            try:
                peak, seconds = peakcheck.measure_step(self.model, (args, kwargs), device, step)
            except peakcheck.StepOutOfMemory as e:  # above the limit, however little it had allocated
                log.warning("the compiled step ran out of device memory while measured (%s)", e)
                target = plan.mem_limit - margin.of(plan.mem_limit)
                return max(e.peak_bytes + plan.graph.resident_bytes, target + 1), 0.0
            return peak + plan.graph.resident_bytes, seconds

        margin = self.options.margin_for(device)
        try:
            found = peakcheck.fit_measured(planned.plan, measure, rounds=rounds, planner=self.options.planner,
                                           margin=margin)
        except UnplannedGraph as e:  # dynamo compiled another graph: the step is checked no further
            log.warning("the compiled step's peak was not measured: %s", e.cause)
            self._use(planned)
            return planned
        chosen = sharing_code(planned, found.plan, variants)
        self._use(chosen)
        self._kept_free = found.undercount  # what this code took above its plan, kept free in later plans
        self.host_pool.check_plan(chosen.plan.host_bytes)
        self._plans[chosen.key] = chosen
        return chosen

    def _check_sharding_unchanged(self) -> None:
        """fully_shard applied after compile (to the model or to this module) would not be counted."""
        try:
            changed = fsdp.is_sharded(self) or fsdp.layout(self.model) != self._sharded
        except UnsupportedModel:
            if self._sharded is not None:  # sharded as planned, but now in a way fxpooch does not plan
                raise
            changed = True
        if changed:
            raise UnsupportedModel(
                "fully_shard was applied after fxpooch.compile (to the model or to the compiled module), so the "
                "plans do not count what FSDP holds: apply fully_shard to each block and then to the root before "
                "fxpooch.compile(root, ...)")

    def _enter_wrapper(self, wrapper: nn.Module | None) -> None:
        """Now running inside another DDP wrapper (or none): use the plans made there, which count what
        it holds (planned on first use)."""
        log.info("running inside %s: its plans are used", "a DistributedDataParallel wrapper"
                 if wrapper is not None else "no DistributedDataParallel wrapper")
        self._by_wrapper[self._wrapper] = self._plans, self._predicted
        self._plans, self._predicted = self._by_wrapper.pop(wrapper, ({}, {}))
        self._wrapper = wrapper
        self._current = None

    def _check_previous_backward(self) -> None:
        """A second forward while the previous one's backward is still to run would hold both steps'
        activations: the plan is for one step."""
        if self._pending is None:
            return
        first, calls, outputs = self._pending
        if first.backward_calls == calls and any(r() is not None for r in outputs):
            raise PendingBackward()
        self._pending = None

    def _note_step(self, planned: _Planned, out: Any) -> None:
        refs = [r for t in compat.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
                for r in (_weak_node(t.grad_fn),) if r is not None]
        first = planned.pairs[0]
        self._pending = (first, first.backward_calls, refs) if refs else None

    def _use(self, planned: _Planned) -> None:
        if planned is not self._current:
            planned.bind()
            self._current = planned

    def _find(self, ran: list[GraphPair], grads: tuple[bool, ...], prefix: bool = False) -> _Planned | None:
        for (pairs, state), planned in self._plans.items():
            if state == grads and (list(pairs[:len(ran)]) == ran if prefix else not ran):
                return planned
        return None

    def _replan(self, args: tuple, kwargs: dict, cause: str) -> _Planned:
        """The plan of the graphs this step runs: a cached one if its graphs were planned already."""
        # Step 1, trace: capture the step through this module's dynamo entry
        fsdp.check_inputs(self._sharded, (args, kwargs))
        device = step_device(self.model, args, kwargs)
        held = distributed.held_bytes(self._wrapper, device) + fsdp.held_bytes(self.model, self._sharded, device)
        step = trace_step(self.model, args, kwargs, compiled=self._compiled, recorder=self._recorder,
                          outputs_held=self.options.outputs_held, held_bytes=held,
                          gradients_reduced=self._sharded is not None)
        known = self._plans.get(step.key)
        if known is not None:
            return known
        if len(self._plans) >= self.options.max_plans:
            raise ReplanLimitExceeded(len(self._plans), cause)
        if self._plans:
            self.replans += 1
            log.warning("planning again, with a new capture and profile (%d plans so far, compiled.replans = %d): "
                        "%s. Inputs of many different shapes, e.g. variable-length batches, should be padded to "
                        "a few fixed shapes", len(self._plans), self.replans, cause)
        plan = _profile_and_plan(step, self.mem_limit, self.options, self._kept_free)
        planned = _Planned.of(plan, step, self.options.codegen)
        self.host_pool.check_plan(planned.plan.host_bytes)
        self._plans[planned.key] = planned
        return planned


def _profile_and_plan(step: TracedStep, mem_limit: int | InCoreShare, options: CompileOptions,
                      kept_free: int = 0) -> Plan:
    """Steps 2 and 3 of the pipeline for a traced step (Step 1: :func:`~fxpooch.pipeline.trace_step`);
    ``kept_free``: bytes kept free beyond the options' margin (what a compiled step measured above
    its plan)."""
    share = mem_limit if isinstance(mem_limit, InCoreShare) else None
    if share is not None:  # "60%": of this step's in-core peak
        mem_limit = share.of(in_core_peak_bytes(step.graph))
    margin = options.margin_for(step.device)
    margin = Margin(margin.share, margin.nbytes + kept_free)
    # Step 2, profile: seconds per op (measured under the limit less the margin, or analytic)
    profile = profile_step(step, options.profile_source, hardware=options.hardware, link=options.link,
                           mode=options.profile_mode, mem_limit=mem_limit - margin.of(mem_limit),
                           fused=options.codegen == "inductor")
    if share is not None:  # with the scratch memory the profile measured inside the ops
        mem_limit = share.of(in_core_peak_bytes(profile.charged(step.graph)))
    # Step 3, plan: keep / swap / recompute per activation, simulated
    return plan_graph(step.graph, step.table, profile, mem_limit, planner=options.planner, margin=margin)


def _check_call(model: nn.Module, example_input: Any, mem_limit: int | str, planner: str | Planner,
                hardware: str | Hardware | None = None):
    if not isinstance(model, nn.Module):
        raise UnsupportedModel(f"model must be a torch.nn.Module, got {type(model).__name__}")
    fsdp.layout(model)  # a sharded layout fxpooch does not plan is refused here
    parse_limit(mem_limit)  # a malformed limit fails before anything else
    resolve_planner(planner)  # fail fast on an unknown name
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
    limit = resolve_limit(mem_limit, device, hardware)
    if device.type == "cuda" and isinstance(limit, int):
        total = torch.cuda.get_device_properties(device).total_memory
        if limit > total:
            raise InvalidMemoryLimit(f"mem_limit={limit} bytes is more than {device} has ({total} bytes); "
                                     "pass at most the device's memory")
    return limit, args, kwargs


def plan(model: nn.Module, example_input: Any, mem_limit: int | str, *, planner: str | Planner = "local",
         profile: str | Profile | os.PathLike = "analytic", hardware: str | Hardware | None = None,
         link: Link | None = None, profile_mode: str = "auto", margin: Margin | int | str | None = None,
         outputs_held: bool = True) -> Plan:
    """Plan without running anything: works on a model and inputs on the ``meta`` device.

    On meta tensors, bytes are counted as CUDA's allocator would and times come from the
    analytic model of ``hardware``. Nothing is rewritten; the model's state is untouched.
    The other arguments are as in :func:`compile` (see :class:`CompileOptions`).
    """
    limit, args, kwargs = _check_call(model, example_input, mem_limit, planner, hardware)
    sharded = fsdp.layout(model)
    fsdp.check_inputs(sharded, (args, kwargs))
    options = fsdp.options_for(CompileOptions(planner=planner, profile=profile, hardware=hardware, link=link,
                                              profile_mode=profile_mode, margin=margin, outputs_held=outputs_held),
                               sharded)
    if sharded is not None:
        fsdp.separate_graphs(model, sharded)
    held = fsdp.held_bytes(model, sharded, step_device(model, args, kwargs))
    step = trace_step(model, args, kwargs, outputs_held=outputs_held, held_bytes=held,
                      gradients_reduced=sharded is not None)
    return _profile_and_plan(step, limit, options)


def compile(model: nn.Module, example_input: Any, mem_limit: int | str, *, planner: str | Planner = "local",
            profile: str | Profile | os.PathLike = "measure", hardware: str | Hardware | None = None,
            link: Link | None = None, profile_mode: str = "auto", margin: Margin | int | str | None = None,
            host_pool_limit: int | str | None = None, max_plans: int = 8, outputs_held: bool = True,
            codegen: str = "fx", peak_check_rounds: int = 3) -> CompiledModule:
    """Plan ``model``'s training step to fit ``mem_limit`` and return a module that runs that plan.

    ``mem_limit``: bytes (an int, ``"16GiB"``, ``"16GB"``, ``"16G"`` = 16 GiB), ``"60%"`` (of the
    step's in-core peak, for each input shape) or ``"device"`` (all the device can give; see
    :func:`fxpooch.units.parse_limit`).

    The model's forward runs once here to trace it, without holding its activations (its
    buffers and the RNG state are put back); a measured profile times each node in situ if the
    in-core step fits, else each node alone. The returned module's backward puts gradients on
    ``model``'s parameters. ``codegen``: "fx" runs the rewritten graphs op by op, "inductor"
    compiles them (:mod:`fxpooch.codegen`). ``profile_mode``, ``margin``, ``host_pool_limit``,
    ``max_plans``, ``peak_check_rounds`` (inductor, and any code generator on CUDA: the compiled step's measured peak checked, the plan
    made again at most so many times while above the limit) and ``outputs_held`` (False when the caller drops the outputs before calling
    backward): see :class:`CompileOptions`.
    """
    limit, args, kwargs = _check_call(model, example_input, mem_limit, planner, hardware)
    options = CompileOptions(planner=planner, profile=profile, hardware=hardware, link=link, profile_mode=profile_mode,
                             margin=margin, host_pool_limit=host_pool_limit, max_plans=max_plans,
                             outputs_held=outputs_held, codegen=codegen, peak_check_rounds=peak_check_rounds)
    wrapper = distributed.ddp_of(model)
    compiled = CompiledModule(model if wrapper is None else wrapper.module, limit, options)
    compiled._wrapper = wrapper  # it runs inside the wrapper's forward: its plans count the wrapper's buckets
    compiled._prepare(args, kwargs)
    return compiled if wrapper is None else distributed.CompiledDDP(wrapper, compiled)


def _weak_node(node: Any) -> weakref.ref | None:
    """A weak reference to ``node``, an output's ``grad_fn``, or where autograd's C++ nodes take
    none (a view of another output, replayed outside the graph: ``SliceBackward0``), to the
    first node behind it that does (the compiled graph's backward); None if there is none."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop(0)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        try:
            return weakref.ref(n)
        except TypeError:
            todo.extend(f for f, _ in n.next_functions)
    return None
