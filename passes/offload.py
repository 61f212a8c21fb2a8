"""Forward pass: offload swapped activations after their producer; drop recomputed ones.

The forward still returns one value per saved output (AOTAutograd's contract), but a swapped
one now holds the host copy (``fxpooch.offload(x, slot)``, the slot from :mod:`.slots`) and a
recomputed one an empty tensor (``fxpooch.drop``), so the device storage dies at its last
forward use.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxpooch.graph import NodeTable, StepGraph
from fxpooch.schedule import Decision, Schedule

from .meta import META_KEY


def rewrite_forward(gm: fx.GraphModule, g: int, graph: StepGraph, table: NodeTable,
                    schedule: Schedule, slots: dict[int, int]) -> fx.GraphModule:
    """A new forward GraphModule for graph ``g`` with offload / drop nodes inserted."""
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new_graph.graph_copy(gm.graph, env)
    pair = table.pairs[g]
    replace: dict[fx.Node, fx.Node] = {}
    for a, act in enumerate(graph.activations):
        decision = schedule.decisions[a]
        if act.graph != g or decision is Decision.KEEP:
            continue
        members = [env[table.nodes[m]] for m in act.members]
        anchor = env[table.nodes[max(act.members)]]
        swap = decision is Decision.SWAP
        op = torch.ops.fxpooch.offload.default if swap else torch.ops.fxpooch.drop.default
        prefix = "offload" if swap else "drop"
        with new_graph.inserting_after(anchor):
            for i in reversed(range(len(members))):
                if act.same_as[i] != i and swap:
                    continue  # the same layout as an earlier member: one copy serves both
                member = members[i]
                args = (member, slots[act.members[i]]) if swap else (member,)
                node = new_graph.create_node("call_function", op, args, name=f"{prefix}_{member.name}")
                node.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
                replace[member] = node
        for i, member in enumerate(members):
            replace.setdefault(member, replace[members[act.same_as[i]]])
        for member in members:
            member.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
    outputs = list(out)
    k = pair.num_user_outputs
    outputs[k:] = [replace.get(o, o) if isinstance(o, fx.Node) else o for o in outputs[k:]]
    new_graph.output(tuple(outputs))
    new_graph.lint()
    return fx.GraphModule(gm, new_graph)
