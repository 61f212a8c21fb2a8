"""Stage 3, profile: seconds per op and the host<->device link, as plain data (JSON).

``measure_profile`` times every node of the captured graphs (CUDA events on a GPU, a CPU timer
otherwise) on the inputs seen at capture; ``analytic_profile`` derives deterministic times from
a hardware preset's roofline. Either way ops are keyed by ``graph/phase/node`` and the profile
carries a fingerprint of the graphs it was made for, so a saved profile reproduces a plan.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from .costmodel import analytic_time
from .errors import InvalidProfile
from .graph import NodeTable, StepGraph
from .hardware import Hardware, Link
from .simulator import Costs

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
    source: str  # "cuda-events", "cpu-timer" or "analytic:<preset>"
    link: Link
    op_times: dict[str, float]
    fingerprint: str

    def costs(self, graph: StepGraph) -> Costs:
        if self.fingerprint != fingerprint(graph):
            raise InvalidProfile(
                f"profile {self.fingerprint} was made for other graphs than these ({fingerprint(graph)}); "
                "profile this model again (a different model, batch shape or torch version changes the graphs)")
        op_time = tuple(self.op_times.get(op_key(graph, i), 0.0) for i in range(len(graph.ops)))
        xfer = tuple(sum(self.link.transfer_time(b) for b in act.member_bytes if b) for act in graph.activations)
        return Costs(op_time, xfer, xfer)

    def with_link(self, link: Link) -> Profile:
        return Profile(self.source, link, self.op_times, self.fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "source": self.source, "link": asdict(self.link),
                "fingerprint": self.fingerprint, "op_times": self.op_times}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise InvalidProfile(f"not an fxpooch profile (format {FORMAT_VERSION} expected)")
        try:
            return cls(data["source"], Link(**data["link"]), {k: float(v) for k, v in data["op_times"].items()},
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


def analytic_profile(graph: StepGraph, table: NodeTable, hardware: Hardware) -> Profile:
    """Deterministic per-op times from ``hardware``'s roofline (FLOPs and bytes of each node)."""
    times = {op_key(graph, i): analytic_time(node, hardware) for i, node in enumerate(table.nodes)}
    return Profile(f"analytic:{hardware.name}", hardware.link, times, fingerprint(graph))


class _NodeTimer(fx.Interpreter):
    """Runs a GraphModule node by node, timing each call_function."""

    def __init__(self, gm: fx.GraphModule, clock: Callable[[], Callable[[], float]]):
        super().__init__(gm, garbage_collect_values=True)
        self.clock = clock
        self.times: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        stop = self.clock()
        try:
            out = super().run_node(n)
        except Exception as e:
            raise RuntimeError(f"profiling failed at node {n.format_node()}: {e}") from e
        self.times[n.name] = stop()
        return out


def _cpu_clock() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


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


def measure_profile(graph: StepGraph, table: NodeTable, example_args: Sequence[list[Any]], link: Link,
                    repeats: int = 3) -> Profile:
    """Time every node of every captured graph pair on real inputs (median of ``repeats``)."""
    device = next((a.device for args in example_args for a in args if isinstance(a, torch.Tensor)),
                  torch.device("cpu"))
    on_cuda = device.type == "cuda"
    clock = _cuda_clock if on_cuda else _cpu_clock
    samples: dict[str, list[float]] = {}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        for g, (pair, args) in enumerate(zip(table.pairs, example_args)):
            for r in range(repeats + 1):  # the first run warms up
                fw = _NodeTimer(pair.forward, clock)
                with torch.no_grad():
                    outs = fw.run(*args)
                saved = list(outs[pair.num_user_outputs:])
                tangents = [_real_like(n.meta.get("val"), device)
                            for n in pair.backward.graph.find_nodes(op="placeholder")[len(saved):]]
                bw = _NodeTimer(pair.backward, clock)
                with torch.no_grad():
                    bw.run(*saved, *tangents)
                del outs, saved, tangents
                if r == 0:
                    continue
                for phase, timer in (("forward", fw), ("backward", bw)):
                    for name, t in timer.times.items():
                        samples.setdefault(f"{g}/{phase}/{name}", []).append(t)
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    times = {k: statistics.median(v) for k, v in samples.items()}
    source = "cuda-events" if on_cuda else "cpu-timer"
    log.info("profiled %d ops with %s", len(times), source)
    return Profile(source, link, times, fingerprint(graph))
