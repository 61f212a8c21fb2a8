"""Forward pass: offload swapped activations after their producer; drop recomputed ones.

The forward still returns one value per saved output (AOTAutograd's contract), but a swapped
one now holds the host copy (``fxpooch.offload(x, slot)``, the slot from :mod:`.slots`) and a
recomputed one an empty tensor (``fxpooch.drop``), so the device storage dies at its last
forward use. Where the plan has a swapped activation's copy done before an op of the forward
(``releases``: :func:`fxpooch.simulator.release_points`), ``fxpooch.release(host, slot)``
before that op frees the device storage in stream order (``offload(..., released=True)`` holds
it until then); a release the plan puts in the backward is made there (:mod:`.swapin`).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxpooch.graph import NodeTable, StepGraph
from fxpooch.schedule import Decision, Schedule

from .meta import META_KEY
from .slots import copied_first, view_of_copy


def rewrite_forward(gm: fx.GraphModule, g: int, graph: StepGraph, table: NodeTable, schedule: Schedule,
                    slots: dict[int, int], releases: dict[int, int]) -> fx.GraphModule:
    """A new forward GraphModule for graph ``g`` with offload / drop / release nodes inserted
    (``releases``: swapped activation -> the op its release precedes)."""
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new_graph.graph_copy(gm.graph, env)
    pair = table.pairs[g]
    replace: dict[fx.Node, fx.Node] = {}
    released: list[tuple[int, fx.Node]] = []  # (activation, its member's offload) freed by a release
    for a, act in enumerate(graph.activations):
        decision = schedule.decisions[a]
        if act.graph != g or decision is Decision.KEEP:
            continue
        members = [env[table.nodes[m]] for m in act.members]
        anchor = env[table.nodes[max(act.members)]]
        swap = decision is Decision.SWAP
        op = torch.ops.fxpooch.offload.default if swap else torch.ops.fxpooch.drop.default
        prefix = "offload" if swap else "drop"
        kwargs = {"released": True} if a in releases else {}
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
                    node = new_graph.create_node("call_function", op, args, kwargs, name=f"{prefix}_{member.name}")
                    if kwargs:
                        released.append((a, node))
            node.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
            replace[member] = node
            after = node
        for member in members:
            member.meta[META_KEY] = {"activation": act.name, "decision": decision.value}
    release_of: dict[fx.Node, fx.Node] = {}  # offload -> its release, which the forward returns instead
    lo, hi = graph.forward_range[g]
    for a, offload in released:
        if not lo <= releases[a] < hi:  # released in the backward (:mod:`.swapin`)
            continue
        member, slot = offload.args
        with new_graph.inserting_before(env[table.nodes[releases[a]]]):
            node = new_graph.create_node("call_function", torch.ops.fxpooch.release.default, (offload, slot),
                                         name=f"release_{member.name}")
        node.meta[META_KEY] = {"activation": graph.activations[a].name, "decision": Decision.SWAP.value}
        release_of[offload] = node
    outputs = list(out)
    k = pair.num_user_outputs
    outputs[k:] = [release_of.get(replace.get(o, o), replace.get(o, o)) if isinstance(o, fx.Node) else o
                   for o in outputs[k:]]
    new_graph.output(tuple(outputs))
    new_graph.lint()
    return fx.GraphModule(gm, new_graph)
