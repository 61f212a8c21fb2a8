"""Backward pass: prefetch / wait for swapped activations, recompute subgraphs before first use.

The backward graph is re-emitted in the schedule's order: a ``fxpooch.prefetch`` at its
planned position (after the ``fxpooch.release`` of an offloaded buffer the plan frees in the
backward), a ``fxpooch.wait`` just before the first reader (both name the host copy's
slot, the one its ``fxpooch.offload`` wrote), and each recompute segment's
forward ops (copied, renamed ``re_*``) just before the first reader of the activation it is
emitted for; the recomputed activations it rebuilds (``Schedule.materialises``) die after their
last readers instead of living through the whole backward.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxpooch.graph import NodeTable, StepGraph
from fxpooch.recompute import recompute_call, recomputed_val
from fxpooch.schedule import Kind, Schedule

from .meta import META_KEY
from .slots import copied_first, view_of_copy


def rewrite_backward(gm: fx.GraphModule, g: int, graph: StepGraph, table: NodeTable,
                     schedule: Schedule, slots: dict[int, int], releases: dict[int, int]) -> fx.GraphModule:
    """A new backward GraphModule for graph ``g`` in the schedule's order; ``releases`` (swapped
    activation -> op): those before one of its ops release the offloaded device buffer there, from
    the host copy that the prefetch then reads."""
    new = fx.Graph()
    env: dict[int, fx.Node] = {}  # op id -> value in the new graph
    host: dict[int, fx.Node] = {}  # swapped member op id -> its host-copy placeholder
    prefetched: dict[int, fx.Node] = {}

    def copy(node: fx.Node, lookup, name: str | None = None) -> fx.Node:
        args = fx.node.map_arg(node.args, lookup)
        kwargs = fx.node.map_arg(node.kwargs, lookup)
        out = new.create_node(node.op, node.target, args, kwargs, name=name or node.name)
        out.meta = dict(node.meta)
        return out

    for node in gm.graph.find_nodes(op="placeholder"):
        ph = new.placeholder(node.name)
        ph.meta = dict(node.meta)
        env[table.op_of[node]] = ph
    for a, act in enumerate(graph.activations):
        if act.graph == g and schedule.decisions[a].value == "swap":
            for m in act.members:
                host[m] = env[m]

    start, stop = graph.backward_range[g]
    released_before: dict[int, list[int]] = {}  # op -> the swapped activations released before it
    for a, op in releases.items():
        if start <= op < stop:
            released_before.setdefault(op, []).append(a)
    chain_env: dict[int, dict[int, fx.Node]] = {}
    for ins in schedule.instrs:
        if ins.kind is Kind.RUN and not (start <= ins.op < stop):
            continue
        if ins.kind in (Kind.PREFETCH, Kind.WAIT, Kind.RECOMPUTE) and graph.activations[ins.act].graph != g:
            continue
        if ins.kind is Kind.OFFLOAD:
            continue
        act = graph.activations[ins.act] if ins.act >= 0 else None
        if ins.kind is Kind.PREFETCH:
            for i, m in enumerate(act.members):
                if act.view_of[i] != i:
                    continue
                device = table.nodes[m].meta["val"].device
                p = new.create_node("call_function", torch.ops.fxpooch.prefetch.default, (host[m], device, slots[m]),
                                    name=f"prefetch_{table.nodes[m].name}")
                p.meta[META_KEY] = {"activation": act.name, "decision": "swap"}
                prefetched[m] = p
        elif ins.kind is Kind.WAIT:
            for i in copied_first(act):
                m = act.members[i]
                if act.view_of[i] == i:
                    w = new.create_node("call_function", torch.ops.fxpooch.wait.default, (prefetched[m], slots[m]),
                                        name=f"wait_{table.nodes[m].name}")
                else:  # a view of another member's copy (an alias where their layouts agree)
                    source = env[act.members[act.view_of[i]]]
                    w = (view_of_copy(new, act, i, table, source, f"device_{table.nodes[m].name}")
                         or new.create_node("call_function", torch.ops.aten.alias.default, (source,),
                                            name=f"alias_{table.nodes[m].name}"))
                w.meta[META_KEY] = {"activation": act.name, "decision": "swap"}
                env[m] = w
        elif ins.kind is Kind.RECOMPUTE:
            local = chain_env.setdefault(ins.act, {})
            node = table.nodes[ins.op]

            def lookup(x: fx.Node, local=local) -> fx.Node:
                i = table.op_of[x]
                return local[i] if i in local else env[i]

            target, args, kwargs = recompute_call(node, lookup)
            r = new.create_node("call_function", target, args, kwargs, name=f"re_{node.name}")
            r.meta = {**node.meta, "val": recomputed_val(node)}
            r.meta[META_KEY] = {"activation": act.name, "decision": "recompute", "recomputes": node.name}
            local[ins.op] = r
            for c in schedule.materialises[ins.act]:  # the activations this segment rebuilds
                members = graph.activations[c].members
                if ins.op in members and all(m in local for m in members):
                    for m in members:
                        env[m] = local[m]
        else:
            for a in released_before.get(ins.op, ()):
                act = graph.activations[a]
                for i in copied_first(act):
                    m = act.members[i]
                    if act.view_of[i] == i:  # a member with an offload of its own
                        r = new.create_node("call_function", torch.ops.fxpooch.release.default, (host[m], slots[m]),
                                            name=f"release_{table.nodes[m].name}")
                        r.meta[META_KEY] = {"activation": act.name, "decision": "swap"}
                        host[m] = r
            node = table.nodes[ins.op]
            if node.op == "placeholder":
                continue
            env[ins.op] = copy(node, lambda x: env[table.op_of[x]])
    output = gm.graph.output_node()
    new.output(fx.node.map_arg(output.args[0], lambda x: env[table.op_of[x]]))
    new.lint()
    return fx.GraphModule(gm, new)
