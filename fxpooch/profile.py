"""Stage 3, profile: seconds per op, the memory ops take inside themselves and the host<->device
link, as plain data (JSON).

A :class:`Profile` holds the seconds of every op, keyed by ``graph/phase/node``, the scratch bytes of
the ops that take any (same keys), the link its swaps are priced on, and a fingerprint of the graphs
it was made for, so a saved profile reproduces a plan. ``analytic_profile`` derives deterministic times from a hardware preset's roofline; the
measured ones come from :func:`fxpooch.timing.measure_profile` (every node timed) and
:mod:`fxpooch.calibrate` (the link).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .costmodel import analytic_time, fused_time
from .errors import InvalidProfile
from .graph import NodeTable, StepGraph
from .hardware import Hardware, Link
from .types import Costs

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
    """Per-op costs of one step's graphs. ``op_scratch``: bytes an op allocates and frees inside
    itself, above its inputs and outputs (measured: :mod:`fxpooch.scratch`), only the nonzero ones;
    an analytic profile has none (a roofline says nothing of an op's workspace), nor does a file
    saved before scratch was measured."""

    #: "cuda-events", "cpu-timer" (wall clock), "cpu-thread-time" (" per-node" when so measured),
    #: "analytic:<preset>" or "analytic-fused:<preset>"
    source: str
    link: Link
    op_times: dict[str, float]
    fingerprint: str
    op_scratch: dict[str, int] = field(default_factory=dict)

    def check(self, graph: StepGraph) -> None:
        """Raise :class:`InvalidProfile` unless this profile was made for ``graph``."""
        if self.fingerprint != fingerprint(graph):
            raise InvalidProfile(
                f"profile {self.fingerprint} was made for other graphs than these ({fingerprint(graph)}); "
                "profile this model again (a different model, batch shape or torch version changes the graphs)")

    def costs(self, graph: StepGraph) -> Costs:
        self.check(graph)
        op_time = tuple(self.op_times.get(op_key(graph, i), 0.0) for i in range(len(graph.ops)))
        d2h, h2d = self.link.directed("d2h"), self.link.directed("h2d")
        return Costs(op_time,
                     tuple(sum(d2h.transfer_time(b) for b in act.member_bytes if b) for act in graph.activations),
                     tuple(sum(h2d.transfer_time(b) for b in act.member_bytes if b) for act in graph.activations),
                     self.link.on_compute_stream)

    def charged(self, graph: StepGraph) -> StepGraph:
        """``graph`` with this profile's scratch bytes per op (:attr:`StepGraph.op_scratch`), which the
        schedule and the simulator charge during every run of the op."""
        self.check(graph)
        scratch = tuple(self.op_scratch.get(op_key(graph, i), 0) for i in range(len(graph.ops)))
        scratch = scratch if any(scratch) else ()
        return graph if scratch == graph.op_scratch else dataclasses.replace(graph, op_scratch=scratch)

    def scaled(self, factor: float, why: str) -> Profile:
        """This profile with every op's seconds times ``factor`` (the link's copies unchanged);
        ``why`` is appended to the source."""
        return dataclasses.replace(self, source=f"{self.source} x{factor:.3g} ({why})",
                                   op_times={k: t * factor for k, t in self.op_times.items()})

    def with_link(self, link: Link) -> Profile:
        return dataclasses.replace(self, link=link)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "source": self.source, "link": self.link.to_json(),
                "fingerprint": self.fingerprint, "op_times": self.op_times, "op_scratch": self.op_scratch}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise InvalidProfile(f"not an fxpooch profile (format {FORMAT_VERSION} expected)")
        try:
            return cls(data["source"], Link.from_json(data["link"]), {k: float(v) for k, v in data["op_times"].items()},
                       data["fingerprint"], {k: int(v) for k, v in data.get("op_scratch", {}).items()})
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
    (:func:`~fxpooch.costmodel.fused_time`), so a recomputed chain costs what its fused kernel does.
    No scratch bytes: the roofline does not know an op's workspace."""
    cost = fused_time if fused else analytic_time
    times = {op_key(graph, i): cost(node, hardware) for i, node in enumerate(table.nodes)}
    source = f"analytic{'-fused' if fused else ''}:{hardware.name}"
    return Profile(source, hardware.link, times, fingerprint(graph))
