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
from .slots import copied_first, view_of_copy


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
        after = anchor
        for i in copied_first(act):
            member = members[i]
            with new_graph.inserting_after(after):
                if swap and act.view_of[i] != i:  # a view of another member's copy: of its host copy
                    copy = replace[members[act.view_of[i]]]
                    node = view_of_copy(new_graph, act, i, table, copy, f"host_{member.name}")
                    if node is None:  # the same layout: the same host copy
                        replace[member] = copy
                        continue
                else:
                    args = (member, slots[act.members[i]]) if swap else (member,)
                    node = new_graph.create_node("call_function", op, args, name=f"{prefix}_{member.name}")
            node.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
            replace[member] = node
            after = node
        for member in members:
            member.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
    outputs = list(out)
    k = pair.num_user_outputs
    outputs[k:] = [replace.get(o, o) if isinstance(o, fx.Node) else o for o in outputs[k:]]
    new_graph.output(tuple(outputs))
    new_graph.lint()
    return fx.GraphModule(gm, new_graph)
