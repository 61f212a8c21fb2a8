"""The host copies of a schedule's swapped activations: the slot that pairs each offload with its
prefetch and wait, and the members that are views of another member's copy."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxpooch.graph import Activation, NodeTable, StepGraph, view_in_copy
from fxpooch.schedule import Kind, Schedule


def swap_slots(graph: StepGraph, schedule: Schedule) -> dict[int, int]:
    """Member op id -> slot, for every host copy of the step: numbered from 0 in the schedule's
    offload order, one per member of a swapped activation with a copy of its own (a member that
    is a view of another's copy has none, ``Activation.view_of``). Slots are unique across the
    step's graph pairs, so one runtime state serves all of them."""
    slots: dict[int, int] = {}
    for ins in schedule.instrs:
        if ins.kind is Kind.OFFLOAD:
            act = graph.activations[ins.act]
            for i, m in enumerate(act.members):
                if act.view_of[i] == i:
                    slots[m] = len(slots)
    return slots


def copied_first(act: Activation) -> list[int]:
    """The indices of ``act``'s members, those with copies of their own first."""
    return sorted(range(len(act.members)), key=lambda i: act.view_of[i] != i)


def view_of_copy(graph: fx.Graph, act: Activation, i: int, table: NodeTable, copy: fx.Node, name: str) -> fx.Node | None:
    """A node of ``graph`` for member ``i`` of ``act`` named ``name``, read from ``copy``, the copy (on the host
    or back on the device) of the member it is a view of: ``as_strided`` at its place in the copy,
    or None where their layouts agree (``copy`` serves both)."""
    val = table.nodes[act.members[i]].meta["val"]
    source = table.nodes[act.members[act.view_of[i]]].meta["val"]
    shape, stride, offset = view_in_copy(val, source)
    if (shape, stride, offset) == (list(source.shape), list(source.stride()), 0):
        return None
    return graph.create_node("call_function", torch.ops.aten.as_strided.default, (copy, shape, stride, offset),
                             name=name)
