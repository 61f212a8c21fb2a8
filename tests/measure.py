"""Measure a compiled step's device-memory peak independently of the planner.

Dynamo runs a model eagerly while a TorchDispatchMode is active, so the counter is entered
around each captured graph's execution instead, and around the whole backward (the incoming
gradients, and what autograd itself runs between the graphs: a returned view's backward, the sum
of gradients), which observes the storages the executed ops really create.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch

from fxpooch.capture import GraphPair
from memcount import LiveStorageCounter

HOST_OPS = {"fxpooch::offload"}


@contextlib.contextmanager
def counting_graphs(counter: LiveStorageCounter) -> Iterator[list[str]]:
    """Run every graph call under ``counter``; yields the list of graphs that ran."""
    ran: list[str] = []
    fw, bw = GraphPair.call_forward, GraphPair.call_backward

    def call_forward(self, args):
        ran.append(f"forward{self.index}")
        with counter:
            return fw(self, args)

    def call_backward(self, args):
        ran.append(f"backward{self.index}")
        with counter:
            return bw(self, args)

    with mock.patch.object(GraphPair, "call_forward", call_forward), \
            mock.patch.object(GraphPair, "call_backward", call_backward):
        yield ran


def measured_step_peak(compiled, args: tuple, resident: int) -> int:
    """Peak device bytes of one forward + backward(ones) of ``compiled`` (ones for each output of a
    tuple, held by the caller through the backward), resident included."""
    counter = LiveStorageCounter(host_ops=HOST_OPS)
    with counting_graphs(counter) as ran:
        out = compiled(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        with counter:
            grads = [torch.ones_like(o) for o in outs]
            torch.autograd.backward(outs, grads)
    assert any(r.startswith("forward") for r in ran) and any(r.startswith("backward") for r in ran), ran
    return resident + counter.peak_bytes


@dataclass(frozen=True)
class Limits:
    """The smallest feasible limit and the in-core peak of a model's step."""

    floor: int
    in_core: int

    @property
    def middle(self) -> int:
        return (self.floor + self.in_core) // 2


def find_limits(compile_at: Callable[[object], object]) -> Limits:
    """``compile_at(limit)`` compiles the model at ``limit`` and returns the compiled module."""
    import fxpooch

    try:
        compile_at(1)
    except fxpooch.InfeasibleMemoryLimit as e:
        floor = e.min_feasible_bytes
    else:
        raise AssertionError("a 1-byte limit was accepted")
    return Limits(floor, compile_at("1TiB").plan.in_core_peak_bytes)


class StepCounter(LiveStorageCounter):
    """A :class:`LiveStorageCounter` to enter around whole training steps.

    ``ignore_compile_internals`` tells dynamo that this mode does not change what it compiles, so
    the compiled (planned) graphs run under it instead of an eager fallback. Storages that exist
    when it is seeded (parameters, buffers, gradients, inputs) are known and never counted, so an
    op that returns one of them (a view or an alias made outside a graph) does not count it again.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def seed(self, *objs) -> None:
        import functools
        import weakref

        from memcount import _Entry, _on_storage_freed, storage_key

        def visit(obj) -> None:
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    visit(t)
            elif isinstance(obj, torch.Tensor):
                key = storage_key(obj)
                if key is not None and key not in self._live:
                    ref = weakref.ref(obj.untyped_storage(), functools.partial(_on_storage_freed, self._self_ref, key))
                    self._live[key] = _Entry(ref=ref, nbytes=0, counted=False, op="resident")
                if obj.is_leaf and obj.grad is not None:
                    visit(obj.grad)
            elif isinstance(obj, dict):
                for v in obj.values():
                    visit(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    visit(v)

        with self._lock:
            for o in objs:
                visit(o)
