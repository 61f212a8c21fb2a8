"""Stage 3, profile: seconds per op and the host<->device link, as plain data (JSON).

``measure_profile`` times every node of the captured graphs (CUDA events on a GPU, a CPU timer
otherwise). In situ, each graph pair runs whole on the inputs seen at capture, which needs the
in-core step's memory; per node, each node runs alone on fresh inputs of its traced shapes,
which needs one node's inputs and outputs, so a step that does not fit can still be profiled.
``measure_link`` times pinned copies of several sizes, alone and next to compute.
``analytic_profile`` derives deterministic times from a hardware preset's roofline. Either way
ops are keyed by ``graph/phase/node`` and the profile carries a fingerprint of the graphs it was
made for, so a saved profile reproduces a plan.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import operator
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .costmodel import analytic_time, fused_time
from .errors import InvalidProfile
from .graph import NodeTable, StepGraph
from .hardware import Hardware, Link, LinkCalibration
from .progress import stage
from .types import Costs

log = logging.getLogger("fxpooch.profile")

FORMAT_VERSION = 1


def op_key(graph: StepGraph, op_id: int) -> str:
    op = graph.ops[op_id]
    return f"{op.graph}/{op.phase.value}/{op.name}"


def fingerprint(graph: StepGraph) -> str:
    h = hashlib.sha256()
    for i, op in enumerate(graph.ops):
        sizes = ",".join(str(graph.buffers[b].nbytes) for b in op.allocs)
        h.update(f"{op_key(graph, i)}:{op.target}:{sizes};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Profile:
    #: "cuda-events", "cpu-timer" (wall clock), "cpu-thread-time" (" per-node" when so measured),
    #: "analytic:<preset>" or "analytic-fused:<preset>"
    source: str
    link: Link
    op_times: dict[str, float]
    fingerprint: str

    def costs(self, graph: StepGraph) -> Costs:
        if self.fingerprint != fingerprint(graph):
            raise InvalidProfile(
                f"profile {self.fingerprint} was made for other graphs than these ({fingerprint(graph)}); "
                "profile this model again (a different model, batch shape or torch version changes the graphs)")
        op_time = tuple(self.op_times.get(op_key(graph, i), 0.0) for i in range(len(graph.ops)))
        d2h, h2d = self.link.directed("d2h"), self.link.directed("h2d")
        return Costs(op_time,
                     tuple(sum(d2h.transfer_time(b) for b in act.member_bytes if b) for act in graph.activations),
                     tuple(sum(h2d.transfer_time(b) for b in act.member_bytes if b) for act in graph.activations),
                     self.link.on_compute_stream)

    def with_link(self, link: Link) -> Profile:
        return Profile(self.source, link, self.op_times, self.fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "source": self.source, "link": self.link.to_json(),
                "fingerprint": self.fingerprint, "op_times": self.op_times}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise InvalidProfile(f"not an fxpooch profile (format {FORMAT_VERSION} expected)")
        try:
            return cls(data["source"], Link.from_json(data["link"]), {k: float(v) for k, v in data["op_times"].items()},
                       data["fingerprint"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidProfile(f"malformed fxpooch profile: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path) as f:
            return cls.from_json(json.load(f))


def analytic_profile(graph: StepGraph, table: NodeTable, hardware: Hardware, fused: bool = False) -> Profile:
    """Deterministic per-op times from ``hardware``'s roofline (FLOPs and bytes of each node);
    ``fused``: as a fusing compiler (inductor) runs the graphs, pointwise chains one kernel
    (:func:`~fxpooch.costmodel.fused_time`), so a recomputed chain costs what its fused kernel does."""
    cost = fused_time if fused else analytic_time
    times = {op_key(graph, i): cost(node, hardware) for i, node in enumerate(table.nodes)}
    source = f"analytic{'-fused' if fused else ''}:{hardware.name}"
    return Profile(source, hardware.link, times, fingerprint(graph))


class _NodeTimer(fx.Interpreter):
    """Runs a GraphModule node by node, timing each call_function with the frees of the values it
    read last (as the compiled graph frees them right after it: a large free unmaps memory)."""

    def __init__(self, gm: fx.GraphModule, clock: Callable[[], Callable[[], float]]):
        super().__init__(gm, garbage_collect_values=True)
        self.clock = clock
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
            out = super().run_node(n)
        except Exception as e:
            raise RuntimeError(f"profiling failed at node {n.format_node()}: {e}") from e
        self._free_after(n)
        self.times[n.name] = stop()
        return out

    def _free_after(self, n: fx.Node) -> None:
        for value in self.last_readers.get(n, ()):
            self.env.pop(value, None)


def _wall_clock() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def _thread_clock() -> Callable[[], float]:
    t0 = time.thread_time()
    return lambda: time.thread_time() - t0


def _cuda_clock() -> Callable[[], float]:
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
    other processes hold the core, so a profile made on a loaded machine is close to that of an idle
    one. It misses the work of torch's other intra-op threads, so "auto" takes it with one intra-op
    thread (``torch.get_num_threads() == 1``) and the wall clock otherwise.

    A node's time is the least of its repeats on a wall clock or CUDA events: load from other
    processes only ever adds time there, so the minimum is the least disturbed figure (a median
    moves with the load). On the thread clock, which load does not inflate, it is their median:
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
    by :meth:`ProfileOptions.summary`: the least on a wall clock, the median on the thread clock).

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
    clock = _cuda_clock if on_cuda else _thread_clock if thread else _wall_clock
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        if mode == "in-situ":
            samples = _in_situ(table, example_args, device, clock, options.repeats)
        else:
            samples = _per_node(table, clock, options.repeats)
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    times = {k: options.summary(v, on_cuda) for k, v in samples.items()}
    source = ("cuda-events" if on_cuda else "cpu-thread-time" if thread else "cpu-timer") + (
        " per-node" if mode == "per-node" else "")
    log.info("profiled %d ops with %s", len(times), source)
    return Profile(source, link, times, fingerprint(graph))


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


def _in_situ(table: NodeTable, example_args: Sequence[list[Any]], device: torch.device,
             clock: Callable[[], Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for g, (pair, args) in enumerate(zip(table.pairs, example_args)):
        for r in range(repeats + 1):  # the first run warms up
            fw = _NodeTimer(pair.forward, clock)
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
            bw = _NodeTimer(pair.backward, clock)
            with torch.no_grad():
                bw.run(initial_env=env)
            del user, env
            if r == 0:
                continue
            for phase, timer in (("forward", fw), ("backward", bw)):
                for name, t in timer.times.items():
                    samples.setdefault(f"{g}/{phase}/{name}", []).append(t)
    return samples


def _per_node(table: NodeTable, clock: Callable[[], Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each call_function node alone on fresh inputs, freed before the next node."""
    samples: dict[str, list[float]] = {}
    total = sum(1 for pair in table.pairs for gm in (pair.forward, pair.backward)
                for n in gm.graph.nodes if n.op == "call_function")
    with stage("profiling node by node", total, "node") as progress:
        for g, pair in enumerate(table.pairs):
            # a backward placeholder that receives a saved value stands for the forward node that made it
            saved = dict(zip(pair.backward.graph.find_nodes(op="placeholder"), pair.saved_nodes))
            for phase, gm in (("forward", pair.forward), ("backward", pair.backward)):
                for node in gm.graph.nodes:
                    if node.op != "call_function":
                        continue
                    key = f"{g}/{phase}/{node.name}"
                    # getitem picks an element of a multi-output node's result: no kernel
                    samples[key] = [0.0] if node.target is operator.getitem else _bench_node(node, clock, repeats, saved)
                    progress.update()
    return samples


#: how many producers deep an input is made by running them when a fresh input is refused
PRODUCER_DEPTH = 2


def _bench_node(node: fx.Node, clock: Callable[[], Callable[[], float]], repeats: int,
                saved: dict[fx.Node, fx.Node] | None = None) -> list[float]:
    """Time ``node`` on fresh inputs of its traced shapes. Where the real kernel refuses them (a traced
    dtype that differs from what the real producer makes, e.g. LayerNorm's statistics under bf16
    autocast are fp32 on CPU), its inputs are made by running their producers on fresh inputs."""
    try:
        return _timed(node, _inputs(node, 0, saved or {}), clock, repeats)
    except Exception as first:
        try:
            return _timed(node, _inputs(node, PRODUCER_DEPTH, saved or {}), clock, repeats)
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
           repeats: int) -> list[float]:
    args, kwargs = inputs
    times = []
    with torch.no_grad():
        for r in range(repeats + 1):  # the first run warms up
            stop = clock()
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


#: copy sizes of the link calibration: 64 KiB (latency-bound) to 64 MiB (bandwidth-bound)
LINK_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 26)
_links: dict[str, Link] = {}  # calibrated links of this process, by device


def measure_link(device: torch.device | str, sizes: Sequence[int] = LINK_SIZES, repeats: int = 5) -> Link:
    """Pinned host<->device copies of ``sizes`` timed with CUDA events on a side stream, each
    direction alone and while a memory-bound kernel runs on the compute stream; latency and
    bandwidth fitted per direction (:class:`~fxpooch.hardware.LinkCalibration`, kept in the
    link and so in a saved profile). Measured once per device in a process; needs twice the
    largest size of device memory (copy buffer and kernel operand) for a moment."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = f"cuda:{index}"
    if key not in _links:
        with torch.cuda.device(index):
            cal = _calibrate(torch.device(key), tuple(sizes), repeats)
        _links[key] = Link.calibrated(f"measured:{cal.device}", cal)
        log.info("link of %s: %s", key, _links[key])
    return _links[key]


#: copy sizes of the host link: 64 KiB to 16 MiB. Larger new tensors come from fresh pages (glibc maps
#: allocations past its threshold, 32 MiB at most, anew and the first write faults each page in), a
#: cost per byte several times the copy's that a latency + bandwidth line through both would smear
#: over every size
HOST_LINK_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)


def measure_host_link(sizes: Sequence[int] = HOST_LINK_SIZES, repeats: int = 5,
                      options: ProfileOptions = ProfileOptions()) -> Link:
    """The copies a CPU run makes in place of swaps, timed on this thread as :func:`measure_profile`
    times the ops (``options``' clock and summary of ``repeats`` after a warm-up): an offload into a
    reused host block, a prefetch into a new tensor (its allocation included), each repeat on other
    memory than the last (an activation copied in a step was written long before, not just now: out
    of cache). They run on the compute thread (``on_compute_stream``), so nothing overlaps them.
    Measured once per process and clock."""
    clock = _thread_clock if options.thread_clock() else _wall_clock
    key = f"cpu {clock.__name__}"
    if key not in _links:
        sizes, span = tuple(sizes), max(sizes)
        src = torch.ones((repeats + 1) * span, dtype=torch.uint8)  # repeat r copies from [r * span, ...)
        block = torch.ones_like(src)

        def timed(copy: Callable[[int, int], Any]) -> tuple[float, ...]:
            per_size = []
            for size in sizes:
                times = []
                for r in range(repeats + 1):  # the first run warms up
                    stop = clock()
                    out = copy(r * span, size)
                    elapsed = stop()
                    del out
                    if r:
                        times.append(elapsed)
                per_size.append(options.summary(times))
            return tuple(per_size)

        d2h = timed(lambda at, n: block[at:at + n].copy_(src[at:at + n]))
        h2d = timed(lambda at, n: torch.empty(n, dtype=torch.uint8).copy_(block[at:at + n]))
        cal = LinkCalibration("cpu", sizes, d2h, h2d, d2h, h2d)
        _links[key] = Link.calibrated("measured:cpu", cal, on_compute_stream=True)
        log.info("host copies: %s", _links[key])
    return _links[key]


def _calibrate(device: torch.device, sizes: tuple[int, ...], repeats: int) -> LinkCalibration:
    n = max(sizes)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)

    def enqueue(to_host: bool) -> list[list[tuple[torch.cuda.Event, torch.cuda.Event]]]:
        per_size = []
        with torch.cuda.stream(side):
            for size in sizes:
                src, dst = (dev[:size], host[:size]) if to_host else (host[:size], dev[:size])
                dst.copy_(src, non_blocking=True)  # warm-up
                pairs = []
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(side)
                    dst.copy_(src, non_blocking=True)
                    end.record(side)
                    pairs.append((start, end))
                per_size.append(pairs)
        return per_size

    def seconds(per_size: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]]) -> tuple[float, ...]:
        return tuple(statistics.median(s.elapsed_time(e) / 1e3 for s, e in pairs) for pairs in per_size)

    side.wait_stream(compute)
    alone = [enqueue(True), enqueue(False)]
    side.synchronize()
    d2h, h2d = seconds(alone[0]), seconds(alone[1])
    # a memory-bound kernel (in-place scaling of the largest size) repeated to outlast every copy
    work = torch.ones(n // 4, dtype=torch.float32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    work.mul_(1.0)
    start.record(compute)
    work.mul_(1.0)
    end.record(compute)
    end.synchronize()
    per_kernel = max(start.elapsed_time(end) / 1e3, 1e-6)
    copies = (1 + repeats) * (sum(d2h) + sum(h2d))
    side.wait_stream(compute)
    begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(compute)
    for _ in range(math.ceil(2 * copies / per_kernel) + 1):
        work.mul_(1.0)
    finish.record(compute)
    concurrent = [enqueue(True), enqueue(False)]
    last = concurrent[1][-1][-1][1]
    torch.cuda.synchronize(device)
    if begin.elapsed_time(last) > begin.elapsed_time(finish):
        log.warning("link calibration: the compute kernel ended before the copies; the concurrent figures "
                    "are partly copies alone")
    return LinkCalibration(torch.cuda.get_device_name(device), sizes, d2h, h2d,
                           seconds(concurrent[0]), seconds(concurrent[1]))
