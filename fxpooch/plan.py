"""The result a user inspects: per-activation decisions, the schedule, the predicted peak and time.

A :class:`Plan` is a record: what the planner decided and what the simulator predicts for it,
with the graph and profile it was planned on. Reading it in other ways lives in modules of their
own: :mod:`fxpooch.report` (the table ``print(plan)`` shows), :mod:`fxpooch.explain` (why one
activation got its decision), :mod:`fxpooch.whatif` (the simulations with one decision changed
behind both), :mod:`fxpooch.trace` and :mod:`fxpooch.svg` (the timeline as a trace or a picture).
``print(plan)``, ``plan.table(...)`` and ``plan.explain(name)`` call the first two.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from .errors import UnknownName
from .schedule import Decision

if TYPE_CHECKING:
    from .graph import NodeTable, StepGraph
    from .profile import Profile
    from .schedule import Schedule
    from .simulator import Timeline
    from .whatif import WhatIfs

#: (shape, dtype name) of an activation's first saved value
ActivationMeta = tuple[tuple[int, ...], str]


def activation_names(graph: StepGraph) -> list[str]:
    """User-facing activation names: the node name, prefixed by its graph when there are several."""
    several = len(graph.forward_range) > 1
    return [f"g{a.graph}.{a.name}" if several else a.name for a in graph.activations]


#: dynamo's spellings of a submodule access inside an nn_module_stack path, rewritten to "a.b.0"
_PATH_REWRITES = ((re.compile(r"getattr\(([^()]*), '([^']*)'\)"), r"\1.\2"),
                  (re.compile(r"\._modules\['([^']*)'\]"), r".\1"),
                  (re.compile(r"\[(\d+)\]"), r".\1"),
                  (re.compile(r"\['([^']*)'\]"), r".\1"))
_ROOT = re.compile(r"L\['[^']*'\]")


def module_path(node_meta: dict) -> str:
    """The innermost module of a node's ``nn_module_stack`` as ``model.named_modules()`` names it
    (``layer1.0.bn1``); "" when the node was made by the top-level forward or carries no stack."""
    stack = node_meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = _ROOT.sub("", path)
    for pattern, repl in _PATH_REWRITES:
        while pattern.search(path):
            path = pattern.sub(repl, path)
    return path.lstrip(".")


def module_paths(graph: StepGraph, table: NodeTable) -> tuple[str, ...]:
    """The module whose forward made each activation's storage (for :attr:`Plan.module_paths`): the
    producing op's module, as the table's op column; its saved view's module if the op has no stack."""
    out = []
    for act in graph.activations:
        producer = table.nodes[act.producer].meta
        out.append(module_path(producer if "nn_module_stack" in producer else table.nodes[act.members[0]].meta))
    return tuple(out)


def activation_meta(graph: StepGraph, table: NodeTable) -> tuple[ActivationMeta, ...]:
    """Shape and dtype of each activation's first member (for :attr:`Plan.activation_meta`)."""
    out = []
    for act in graph.activations:
        val = table.nodes[act.members[0]].meta.get("val")
        if isinstance(val, (tuple, list)):
            val = next((v for v in val if hasattr(v, "shape")), None)
        if val is None or not hasattr(val, "shape"):
            out.append(((), "?"))
            continue
        try:
            shape = tuple(int(s) for s in val.shape)
        except TypeError:  # symbolic sizes
            shape = ()
        out.append((shape, str(val.dtype).removeprefix("torch.")))
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    planner: str
    mem_limit: int
    peak_bytes: int  # simulated, resident included (what max_memory_allocated would show)
    step_time: float  # simulated seconds of forward + backward
    in_core_time: float
    in_core_peak_bytes: int
    decisions: dict[str, str]  # activation name -> "keep" | "swap" | "recompute"
    graph: StepGraph = field(repr=False)
    schedule: Schedule = field(repr=False)
    timeline: Timeline = field(repr=False)
    profile: Profile = field(repr=False)
    #: per activation (graph order): (shape, dtype name); empty when unknown (rendered "?")
    activation_meta: tuple[ActivationMeta, ...] = field(default=(), repr=False)
    #: device bytes kept free under ``mem_limit`` for the allocator's fragmentation (planned against the rest)
    margin_bytes: int = 0
    #: per activation (graph order): the path of the module that made it ("": the model's own forward); empty
    #: when unknown
    module_paths: tuple[str, ...] = field(default=(), repr=False)

    def module_of(self, index: int) -> str:
        """The path of the module that saved activation ``index`` ("" when unknown or top level)."""
        return self.module_paths[index] if len(self.module_paths) == len(self.graph.activations) else ""

    @property
    def static_peak_bytes(self) -> int:
        """The peak with copies taken as instantaneous (what a CPU run measures)."""
        return self.timeline.static_peak_bytes

    @property
    def host_bytes(self) -> int:
        return sum(a.transfer_bytes for a, d in zip(self.graph.activations, self.schedule.decisions)
                   if d is Decision.SWAP)

    def counts(self) -> dict[str, int]:
        out = {d.value: 0 for d in Decision}
        for d in self.decisions.values():
            out[d] += 1
        return out

    def indices(self, name: str) -> list[int]:
        """Activation indices for ``name``: an activation's name, or a module path (all it saved)."""
        names = activation_names(self.graph)
        if name in names:
            return [names.index(name)]
        bare = [i for i, act in enumerate(self.graph.activations) if act.name == name]
        if len(bare) == 1:
            return bare
        in_module = [i for i in range(len(names)) if self.module_of(i) == name.strip(".")]
        if in_module and name.strip("."):
            return in_module
        raise UnknownName("activation or module", name,
                          names + sorted({m for m in self.module_paths if m}))

    # -- conveniences: the implementations live in the modules named in the module docstring ------
    @cached_property
    def what_ifs(self) -> WhatIfs:
        """This plan's what-if simulations (:class:`fxpooch.whatif.WhatIfs`), made lazily and kept:
        the table and the explanations share them."""
        from .whatif import WhatIfs

        return WhatIfs(self)

    @cached_property
    def releases(self) -> dict[int, int]:
        """Swapped activation -> the op (of its forward or backward graph) before which its device
        buffer is freed in stream order (:func:`fxpooch.simulator.release_points`); the others are
        freed when their copy ends."""
        from .simulator import release_points

        return release_points(self.graph, self.schedule, self.timeline)

    def __str__(self) -> str:
        return self.table()

    def table(self, overheads: bool | None = None, fold: bool = True) -> str:
        """The activation table and the totals (:func:`fxpooch.report.table`): ``overheads`` None shows
        the what-if columns up to ``report.MAX_OVERHEAD_ACTIVATIONS`` rows; ``fold`` sums up the small
        activations in one line."""
        from .report import table

        return table(self, overheads, fold)

    def explain(self, name: str) -> str:
        """Why activation ``name`` (a key of :attr:`decisions`) got its decision, in numbers; for a
        module path (``layer1.0.bn1``), the same for each activation that module saved
        (:func:`fxpooch.explain.explain`)."""
        from .explain import explain

        return explain(self, name)
