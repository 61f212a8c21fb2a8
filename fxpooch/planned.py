"""A plan bound to the graph pairs of the step it was made for, rewritten and compiled on first use."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from .capture import GraphPair
from .codegen import compile_pair
from .debug import dump_graphs
from .graph import NodeTable, StepGraph
from .pipeline import TracedStep
from .plan import Plan
from .runtime import Runtime


@dataclass
class Planned:
    """A plan of a traced step, bound to its captured pairs: its graphs rewritten and compiled on
    first use (:meth:`bind`)."""

    plan: Plan
    graph: StepGraph
    table: NodeTable
    pairs: list[GraphPair]
    changed_buffers: list[tuple[nn.Module, str]]
    grads: tuple[bool, ...]
    codegen: str = "fx"
    rewritten: list[tuple[torch.fx.GraphModule, torch.fx.GraphModule, tuple]] | None = None

    @classmethod
    def of(cls, plan: Plan, step: TracedStep, codegen: str = "fx") -> Planned:
        return cls(plan, step.graph, step.table, step.pairs, step.changed_buffers, step.grads, codegen)

    @property
    def key(self) -> tuple:
        return tuple(self.pairs), self.grads

    def bind(self, only: GraphPair | None = None, runtime: Runtime | None = None) -> None:
        """Make the pairs (or ``only`` one of them) run this plan's rewritten graphs (rewritten and
        compiled once, on first use), their ops on ``runtime`` if given (else the pair's own)."""
        from fxpooch.passes import rewrite_pair

        if self.rewritten is None:
            self.rewritten = []
            for g, pair in enumerate(self.pairs):
                rewritten = rewrite_pair(g, self.graph, self.table, self.plan.schedule, self.plan.releases)
                dump_graphs(g, pair, rewritten)
                code = compile_pair(rewritten.forward, rewritten.backward, pair.num_user_outputs, self.codegen)
                self.rewritten.append((rewritten.forward, rewritten.backward, code))
        for pair, (forward, backward, code) in zip(self.pairs, self.rewritten):
            if only is None or pair is only:
                pair.bind(forward, backward, code)
                if runtime is not None:
                    pair.runtime = runtime.entered


def sharing_code(planned: Planned, plan: Plan, compiled: list[Planned]) -> Planned:
    """``planned`` with ``plan`` instead: with the code of the one in ``compiled`` whose schedule and
    release points are ``plan``'s (the same rewritten graphs), else with code made on first use (and added to ``compiled``)."""
    same = next((c for c in compiled if c.plan.schedule == plan.schedule and c.plan.releases == plan.releases), None)
    if same is None:
        compiled.append(same := dataclasses.replace(planned, plan=plan, rewritten=None))
    return same if same.plan is plan else dataclasses.replace(same, plan=plan)
