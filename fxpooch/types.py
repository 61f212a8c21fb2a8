"""The stage data every later stage shares, defined once at the bottom of the import order.

Ids are plain ``int`` at run time; the names say which table one indexes:

- ``OpId``: an op of a :class:`~fxpooch.graph.StepGraph` (``graph.ops[i]``), in program order.
- ``BufferId``: a storage (``graph.buffers[i]``); views share it.
- ``ActivationId``: a saved storage the forward allocated (``graph.activations[i]``), the unit a
  planner decides on.
- ``InstanceId``: a recompute instance of a :class:`~fxpooch.schedule.Schedule` (one re-run of a
  segment of ops).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

OpId = NewType("OpId", int)
BufferId = NewType("BufferId", int)
ActivationId = NewType("ActivationId", int)
InstanceId = NewType("InstanceId", int)


class Decision(str, enum.Enum):
    """What a plan does with an activation between its forward and its backward."""

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Costs:
    """Seconds per op and per activation transfer, aligned with a StepGraph's ids (``op_time[OpId]``,
    ``d2h_time[ActivationId]``, ``h2d_time[ActivationId]``)."""

    op_time: tuple[float, ...]
    d2h_time: tuple[float, ...]
    h2d_time: tuple[float, ...]
    #: copies run on the compute stream, in program order (a CPU host: ``Link.on_compute_stream``)
    serial_copies: bool = False


__all__ = ["ActivationId", "BufferId", "Costs", "Decision", "InstanceId", "OpId"]
