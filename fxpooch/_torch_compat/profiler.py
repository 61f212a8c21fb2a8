"""The profiler's raw (Kineto) events, which the public API folds and reorders."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


# -- profiler events ---------------------------------------------------------------------
@dataclass(frozen=True)
class ProfilerEvent:
    """One raw event of a finished ``torch.profiler.profile``: an op or range (``nbytes`` 0), or an
    allocator event (``name == "[memory]"``; ``nbytes`` > 0 allocated, < 0 freed)."""

    name: str
    start_ns: int
    end_ns: int
    device_type: str  # "cpu", "cuda", ...
    nbytes: int


#: the name the profiler gives an allocator event
MEMORY_EVENT = "[memory]"


def profiler_events(prof: Any) -> list[ProfilerEvent]:
    """The raw (Kineto) events of a finished profiler, in the order recorded: the public
    ``events()`` folds allocator events into their ops and loses their order."""
    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        memory = name == MEMORY_EVENT
        out.append(ProfilerEvent(name, e.start_ns(), e.start_ns() + e.duration_ns(),
                                 str(e.device_type()).rsplit(".", 1)[-1].lower(), e.nbytes() if memory else 0))
    return out


def profiler_active() -> bool:
    """Whether an autograd profiler (``torch.profiler.profile``) is running: a second one started
    inside it would end its session."""
    return torch.autograd._profiler_enabled()
