"""The slots of a schedule's host copies: the int that pairs each offload with its prefetch and wait."""
from __future__ import annotations

from fxpooch.graph import StepGraph
from fxpooch.schedule import Kind, Schedule


def swap_slots(graph: StepGraph, schedule: Schedule) -> dict[int, int]:
    """Member op id -> slot, for every host copy of the step: numbered from 0 in the schedule's
    offload order, one per member of a swapped activation with its own layout (a member with the
    same layout as an earlier one shares that member's copy). Slots are unique across the step's
    graph pairs, so one runtime state serves all of them."""
    slots: dict[int, int] = {}
    for ins in schedule.instrs:
        if ins.kind is Kind.OFFLOAD:
            act = graph.activations[ins.act]
            for i, m in enumerate(act.members):
                if act.same_as[i] == i:
                    slots[m] = len(slots)
    return slots
