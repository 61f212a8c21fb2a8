"""Putting back what a step's forward changes: the model's buffers, its inputs and the RNG states.

:func:`preserved_state` undoes a whole forward (a capture or a measuring run); a
:class:`StepSnapshot` undoes the start of a step that an unplanned graph stopped, so that the step
can run again under a new plan.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from . import _torch_compat as compat


@contextlib.contextmanager
def preserved_state(model: nn.Module, inputs: Any = ()) -> Iterator[list[tuple[nn.Module, str]]]:
    """Run the block, then put back the model's buffers, the tensors in ``inputs`` and every RNG state.

    Buffers go back by module and name as well as by value, so a forward that reassigns one
    (``self.ema = 0.9 * self.ema + ...``) leaves the original tensor in place. An input is
    copied back only if the block changed it (``x.add_(1)`` in forward), so the others keep
    their version counters (autograd may have saved them). Yields a list that names, on exit,
    the buffers the block changed.
    """
    buffers = [(mod, name, b, b._version, b.detach().clone())
               for mod in model.modules() for name, b in mod._buffers.items() if b is not None]
    leaves = {id(t): t for t in compat.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    saved_inputs = [(t, t._version, t.detach().clone()) for t in leaves.values()]
    rng = rng_state()
    changed: list[tuple[nn.Module, str]] = []
    try:
        yield changed
    finally:
        with torch.no_grad():
            for mod, name, live, version, saved in buffers:
                if mod._buffers.get(name) is not live or live._version != version:
                    changed.append((mod, name))
                setattr(mod, name, live)
                live.copy_(saved)
            for live, version, saved in saved_inputs:
                if live._version != version:
                    live.copy_(saved)
        set_rng_state(rng)


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state and every CUDA device's (None without CUDA)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    """Put back a state :func:`rng_state` took."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class StepSnapshot:
    """What a step's forward may change before an unplanned graph stops it: the RNG states, the
    buffers that the step is known to change (copied) and the inputs' versions (checked)."""

    def __init__(self, buffers: list[tuple[nn.Module, str]], inputs: Any):
        self.rng = rng_state()
        self.buffers = [(mod, name, mod._buffers[name], mod._buffers[name].detach().clone()) for mod, name in buffers]
        self.inputs = [(t, t._version) for t in compat.tree_leaves(inputs) if isinstance(t, torch.Tensor)]

    def restore(self) -> None:
        from .errors import UnsupportedModel

        if any(t._version != v for t, v in self.inputs):
            raise UnsupportedModel(
                "dynamo compiled a new graph in the middle of a step whose forward had already changed one of its "
                "inputs in place, so the step cannot be run again under a new plan; do not modify the inputs "
                "inside forward (clone them first)")
        set_rng_state(self.rng)
        with torch.no_grad():
            for mod, name, live, saved in self.buffers:
                setattr(mod, name, live)
                live.copy_(saved)
