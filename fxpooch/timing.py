"""Stage 3, timing: every node of the captured graphs timed, as a :class:`~fxpooch.profile.Profile`.

``measure_profile`` times every node (CUDA events on a GPU, a CPU clock otherwise). In situ, each
graph pair runs whole on the inputs seen at capture, which needs the in-core step's memory; per
node, each node runs alone on fresh inputs of its traced shapes, which needs one node's inputs and
outputs, so a step that does not fit can still be profiled. :class:`ProfileOptions` says how. One
more run of the same mode, untimed, measures the memory each op takes and frees inside itself
(:mod:`fxpooch.scratch`).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import _torch_compat as compat
from .errors import InvalidProfile
from .graph import NodeTable, StepGraph
from .hardware import Link
from .profile import Profile, fingerprint
from .progress import stage
from .scratch import ScratchMeter, measure_scratch
from .state import rng_state, set_rng_state

log = logging.getLogger("fxpooch.profile")

class _NodeTimer(fx.Interpreter):
    """Runs a GraphModule node by node, timing each call_function with the frees of the values it
    read last (as the compiled graph frees them right after it: a large free unmaps memory).
    ``mark(name)``: a context around each call_function's own call (not those frees)."""

    def __init__(self, gm: fx.GraphModule, clock: Callable[[], Callable[[], float]],
                 mark: Callable[[str], contextlib.AbstractContextManager] | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.clock = clock
        self.mark = mark or (lambda name: contextlib.nullcontext())
        self.times: dict[str, float] = {}
        # freed here, inside the timed call, instead of by Interpreter.run after it
        self.last_readers, self.user_to_last_uses = self.user_to_last_uses, {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:
            # the output node's entry and the (unexhausted) iterator over the arguments would keep the
            # outputs and inputs alive as long as the interpreter, into the next repeat
            self.env.clear()
            self.args_iter = iter(())

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            out = super().run_node(n)
            self._free_after(n)
            return out
        stop = self.clock()
        try:
            with self.mark(n.name):
                out = super().run_node(n)
        except Exception as e:
            raise RuntimeError(f"profiling failed at node {n.format_node()}: {e}") from e
        self._free_after(n)
        self.times[n.name] = stop()
        return out

    def _free_after(self, n: fx.Node) -> None:
        for value in self.last_readers.get(n, ()):
            self.env.pop(value, None)


def wall_clock() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def thread_clock() -> Callable[[], float]:
    t0 = time.thread_time()
    return lambda: time.thread_time() - t0


#: GPU clock cycles of the busy-wait queued before each op timed on CUDA (about 0.25 ms at 2 GHz): the
#: device is busy while the host launches the op, so the events time its kernels back to back, as in
#: a step where the host runs ahead. Timed from an idle device, each op also counted its launch: on an
#: H100, GPT-2's ops so timed summed to 1.63 times its in-core step (ResNet-50's to 1.24 times).
LAUNCH_COVER_CYCLES = 500_000


def cuda_clock() -> Callable[[], float]:
    compat.cuda_sleep(LAUNCH_COVER_CYCLES)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()

    def stop() -> float:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return stop


def _real_like(val: Any, device: torch.device) -> torch.Tensor | None:
    """A real tensor of the traced value's shape, strides and dtype (an incoming gradient)."""
    if not isinstance(val, torch.Tensor):
        return None
    return torch.ones(val.shape, dtype=val.dtype, device=device).as_strided(val.shape, val.stride()) \
        if val.is_contiguous() else torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device).fill_(1)


MODES = ("auto", "in-situ", "per-node")
CLOCKS = ("auto", "wall", "thread")


@dataclass(frozen=True)
class ProfileOptions:
    """How :func:`measure_profile` times the nodes.

    ``mode``: "in-situ" runs each graph pair whole on the captured inputs (needs the in-core
    step's memory), "per-node" runs each node alone on fresh inputs of its traced shapes (needs one
    node's inputs and outputs), "auto" is in-situ when the in-core step fits (:func:`choose_mode`).

    ``repeats``: timed runs after a warm-up, summarised per node by :meth:`summary`.

    ``clock`` (CPU only; CUDA is always timed with events): "wall" is ``time.perf_counter``;
    "thread" is the calling thread's CPU time (``time.thread_time``), which does not count the time
    other processes hold the core. It still grows with their load, which evicts this thread's caches
    and shares the memory bandwidth (on a 2-core host, a ResNet-50 step's CPU time is 1.0-1.1 s at
    load average 2-4 and 1.5 s at 7), so a profile holds for the load it was made under. It misses
    the work of torch's other intra-op threads, so "auto" takes it with one intra-op thread
    (``torch.get_num_threads() == 1``) and the wall clock otherwise.

    A node's time is the least of its repeats on a wall clock or CUDA events: load from other
    processes only ever adds time there, so the minimum is the least disturbed figure (a median
    moves with the load). On the thread clock, which other processes' time slices do not inflate, it is their median:
    the sum of per-node minima is a step no run achieves (each node's luckiest run; 9% below the
    median step of GPT-2 on a loaded 2-core host), the median is what a typical step costs.
    """

    mode: str = "auto"
    repeats: int = 3
    clock: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidProfile(f"profile mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.repeats < 1:
            raise InvalidProfile(f"profile repeats must be >= 1, got {self.repeats}")
        if self.clock not in CLOCKS:
            raise InvalidProfile(f"profile clock {self.clock!r}: choose one of {', '.join(CLOCKS)}")

    def summary(self, seconds: Sequence[float], on_cuda: bool = False) -> float:
        """One figure from a node's timed repeats: their median on the thread clock, else the least."""
        return statistics.median(seconds) if not on_cuda and self.thread_clock() else min(seconds)

    def thread_clock(self) -> bool:
        """Whether CPU nodes are timed by the calling thread's CPU time (see ``clock``)."""
        return self.clock == "thread" or (self.clock == "auto" and torch.get_num_threads() == 1)


def choose_mode(graph: StepGraph, in_core_peak: int, mem_limit: int, device: torch.device) -> str:
    """"in-situ" when the in-core step (``in_core_peak`` bytes, resident included:
    :func:`fxpooch.simulator.in_core_peak_bytes`) fits under ``mem_limit`` (and, on CUDA, in the
    free device memory), else "per-node"."""
    peak = in_core_peak
    fits = peak <= mem_limit
    if fits and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        fits = peak - graph.resident_bytes <= free + cached
    mode = "in-situ" if fits else "per-node"
    log.info("in-core peak %d bytes, limit %d: profiling %s", peak, mem_limit, mode)
    return mode


def measure_profile(graph: StepGraph, table: NodeTable, example_args: Sequence[list[Any]], link: Link,
                    options: ProfileOptions = ProfileOptions(), mem_limit: int | None = None,
                    in_core_peak: int | None = None) -> Profile:
    """Time every node of every captured graph pair (``options.repeats`` runs each, summarised
    by :meth:`ProfileOptions.summary`: the least on a wall clock, the median on the thread clock),
    then measure each node's scratch bytes in one more run (``Profile.op_scratch``).

    ``example_args`` (the captured inputs of each pair) are read in situ only; "auto" needs
    ``mem_limit`` and the step's ``in_core_peak`` bytes (:func:`fxpooch.simulator.in_core_peak_bytes`).
    """
    device = _device_of(table, example_args)
    on_cuda = device.type == "cuda"
    mode = options.mode
    if mode == "auto":
        if mem_limit is None or in_core_peak is None:
            raise InvalidProfile("profile mode 'auto' needs the memory limit and the in-core peak; pass "
                                 "mem_limit and in_core_peak, or a mode")
        mode = choose_mode(graph, in_core_peak, mem_limit, device)
    thread = not on_cuda and options.thread_clock()
    clock = cuda_clock if on_cuda else thread_clock if thread else wall_clock
    rng = rng_state()
    try:
        if mode == "in-situ":
            samples = _in_situ(table, example_args, device, clock, options.repeats)
            # one more pass, untimed, for the scratch (a profiler would slow the timed ones)
            scratch = measure_scratch(device, lambda meter: _in_situ(table, example_args, device, clock, 0, meter))
        else:
            samples = _per_node(table, clock, options.repeats)
            scratch = measure_scratch(device, lambda meter: _per_node(table, clock, 0, meter))
    finally:
        set_rng_state(rng)
    times = {k: options.summary(v, on_cuda) for k, v in samples.items()}
    source = ("cuda-events" if on_cuda else "cpu-thread-time" if thread else "cpu-timer") + (
        " per-node" if mode == "per-node" else "")
    log.info("profiled %d ops with %s", len(times), source)
    return Profile(source, link, times, fingerprint(graph), scratch)


def _device_of(table: NodeTable, example_args: Sequence[list[Any]]) -> torch.device:
    for args in example_args:
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device
    for node in table.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _marker(meter: ScratchMeter | None, prefix: str) -> Callable[[str], contextlib.AbstractContextManager] | None:
    """``meter``'s mark of a node named ``name`` under the profile key ``prefix + name``."""
    return None if meter is None else (lambda name: meter.node(prefix + name))


def _in_situ(table: NodeTable, example_args: Sequence[list[Any]], device: torch.device,
             clock: Callable[[], Callable[[], float]], repeats: int,
             meter: ScratchMeter | None = None) -> dict[str, list[float]]:
    """``repeats`` timed runs of each pair after a warm-up one (``meter`` marks every run's nodes)."""
    samples: dict[str, list[float]] = {}
    for g, (pair, args) in enumerate(zip(table.pairs, example_args)):
        for r in range(repeats + 1):  # the first run warms up
            fw = _NodeTimer(pair.forward, clock, _marker(meter, f"{g}/forward/"))
            with torch.no_grad():
                outs = fw.run(*args)
            user, saved = list(outs[:pair.num_user_outputs]), list(outs[pair.num_user_outputs:])
            del outs
            placeholders = pair.backward.graph.find_nodes(op="placeholder")
            tangents = [_real_like(n.meta.get("val"), device) for n in placeholders[len(saved):]]
            # handed over in the environment only, so each saved value dies after its last backward
            # reader, as when the step runs
            env = dict(zip(placeholders, [*saved, *tangents]))
            del saved, tangents
            bw = _NodeTimer(pair.backward, clock, _marker(meter, f"{g}/backward/"))
            with torch.no_grad():
                bw.run(initial_env=env)
            del user, env
            if r == 0:
                continue
            for phase, timer in (("forward", fw), ("backward", bw)):
                for name, t in timer.times.items():
                    samples.setdefault(f"{g}/{phase}/{name}", []).append(t)
    return samples


def _per_node(table: NodeTable, clock: Callable[[], Callable[[], float]], repeats: int,
              meter: ScratchMeter | None = None) -> dict[str, list[float]]:
    """Each call_function node alone on fresh inputs, freed before the next node (``meter`` marks
    every run's call)."""
    samples: dict[str, list[float]] = {}
    total = sum(1 for pair in table.pairs for gm in (pair.forward, pair.backward)
                for n in gm.graph.nodes if n.op == "call_function")
    label = "profiling node by node" if meter is None else "measuring scratch memory node by node"
    with stage(label, total, "node") as progress:
        for g, pair in enumerate(table.pairs):
            # a backward placeholder that receives a saved value stands for the forward node that made it
            saved = dict(zip(pair.backward.graph.find_nodes(op="placeholder"), pair.saved_nodes))
            for phase, gm in (("forward", pair.forward), ("backward", pair.backward)):
                for node in gm.graph.nodes:
                    if node.op != "call_function":
                        continue
                    key = f"{g}/{phase}/{node.name}"
                    # getitem picks an element of a multi-output node's result: no kernel
                    samples[key] = [0.0] if node.target is operator.getitem else _bench_node(
                        node, clock, repeats, saved, _marker(meter, f"{g}/{phase}/"))
                    progress.update()
    return samples


#: how many producers deep an input is made by running them when a fresh input is refused
PRODUCER_DEPTH = 2


def _bench_node(node: fx.Node, clock: Callable[[], Callable[[], float]], repeats: int,
                saved: dict[fx.Node, fx.Node] | None = None,
                mark: Callable[[str], contextlib.AbstractContextManager] | None = None) -> list[float]:
    """Time ``node`` on fresh inputs of its traced shapes. Where the real kernel refuses them (a traced
    dtype that differs from what the real producer makes, e.g. LayerNorm's statistics under bf16
    autocast are fp32 on CPU), its inputs are made by running their producers on fresh inputs."""
    try:
        return _timed(node, _inputs(node, 0, saved or {}), clock, repeats, mark)
    except Exception as first:
        try:
            return _timed(node, _inputs(node, PRODUCER_DEPTH, saved or {}), clock, repeats, mark)
        except Exception:
            raise RuntimeError(f"profiling failed at node {node.format_node()} (run alone on fresh inputs): "
                               f"{first}; profile with mode='in-situ' if the step fits, or profile='analytic'") from first


def _inputs(node: fx.Node, depth: int, saved: dict[fx.Node, fx.Node]) -> tuple[tuple, dict]:
    made: dict[fx.Node, Any] = {}

    def value(arg: fx.Node, depth: int) -> Any:
        source = saved.get(arg, arg)
        if source not in made:
            if source.target is operator.getitem and depth > 0:  # an element of its producer's real result
                made[source] = value(source.args[0], depth)[source.args[1]]
            elif depth > 0 and source.op == "call_function":
                args, kwargs = fx.node.map_arg((source.args, source.kwargs), lambda a: value(a, depth - 1))
                with torch.no_grad():
                    made[source] = source.target(*args, **kwargs)
            else:
                made[source] = fresh_value(source)
        return made[source]

    try:
        return fx.node.map_arg((node.args, node.kwargs), lambda a: value(a, depth))
    finally:
        del value  # it refers to itself: without this, every value made stays alive until a gc pass


def _timed(node: fx.Node, inputs: tuple[tuple, dict], clock: Callable[[], Callable[[], float]],
           repeats: int, mark: Callable[[str], contextlib.AbstractContextManager] | None = None) -> list[float]:
    """``repeats`` timed calls after a warm-up one (each marked by ``mark(node.name)``)."""
    args, kwargs = inputs
    times = []
    mark = mark or (lambda name: contextlib.nullcontext())
    with torch.no_grad():
        for r in range(repeats + 1):  # the first run warms up
            stop = clock()
            with mark(node.name):
                out = node.target(*args, **kwargs)
            del out  # its free is part of its cost (in situ, the free of a value is its last reader's)
            elapsed = stop()
            if r:
                times.append(elapsed)
    return times


def fresh_value(node: fx.Node) -> Any:
    """A new value like ``node``'s traced one: floats uniform in [0.5, 1.5), integers and booleans
    zero (every index in range), same shape, strides and device."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        if val is None or isinstance(val, (tuple, list)):
            raise RuntimeError(f"node {node.name} has no traced tensor value to stand in for")
        return val  # a traced int, float or bool
    span = 1 + sum((n - 1) * st for n, st in zip(val.shape, val.stride())) if val.numel() else 0
    base = torch.empty(span, dtype=val.dtype, device=val.device)
    if val.dtype.is_floating_point:
        base.uniform_(0.5, 1.5)
    elif val.dtype.is_complex:
        base.fill_(1)
    else:
        base.zero_()
    return base.as_strided(val.shape, val.stride())
