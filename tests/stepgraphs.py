"""Small hand-built step graphs for the planner tests: forward ops that each allocate one
activation (whole MiB), backward ops that read activations and the previous gradient, round
seconds as costs (:func:`build`, :func:`chain`). Shared by test_planners.py and test_search.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zoo import MiB

from fxpooch.graph import Activation, Buffer, BufferKind, Op, Phase, StepGraph
from fxpooch.types import Costs

__all__ = ["MiB", "RELU", "RELU_BW", "CONV", "CONV_BW", "build", "chain", "dropout_drawn_only"]

RELU, RELU_BW = "aten.relu.default", "aten.threshold_backward.default"
CONV, CONV_BW = "aten.convolution.default", "aten.convolution_backward.default"


def _make(cls, **kw):
    """Construct a graph dataclass, filling fields newer than this test with neutral values."""
    names = {f.name for f in dataclasses.fields(cls)}
    defaults = {"recompute_args": kw.get("args", ()), "view_of": tuple(range(len(kw.get("members", ()))))}
    return cls(**kw, **{k: v for k, v in defaults.items() if k in names and k not in kw})


def build(forward: Sequence[tuple], backward: Sequence[tuple], xfer: dict[str, tuple[float, float]] | None = None,
          grad_mib: int = 1) -> tuple[StepGraph, Costs]:
    """A one-graph step.

    ``forward``: ``(name, inputs, seconds, MiB[, target])``; input "x" is the resident input.
    ``backward``: ``(name, reads, seconds[, target[, kernel]])``: each reads the named forward
    values and the previous backward op's gradient, and allocates a ``grad_mib`` gradient.
    A forward value that a backward op reads is an activation; ``xfer[name] = (d2h, h2d)``.
    """
    xfer = xfer or {}
    ops: list[Op] = [_make(Op, name="x", target="placeholder", graph=0, phase=Phase.FORWARD, args=(), allocs=(0,),
                           kernel=False, recomputable=False)]
    buffers = [Buffer("x", 0, BufferKind.RESIDENT)]
    buffer_of: list[tuple[int, ...]] = [(0,)]
    times = [0.0]
    op_of = {"x": 0}
    for name, inputs, seconds, mib, *target in forward:
        buffers.append(Buffer(name, mib * MiB, BufferKind.TEMP))
        op_of[name] = len(ops)
        ops.append(_make(Op, name=name, target=(target or [RELU])[0], graph=0, phase=Phase.FORWARD,
                         args=tuple(op_of[i] for i in inputs), allocs=(len(buffers) - 1,), kernel=True,
                         recomputable=True))
        buffer_of.append((len(buffers) - 1,))
        times.append(float(seconds))
    fw_stop = len(ops)
    saved_names = list(dict.fromkeys(r for _, reads, *_ in backward for r in reads))
    prev = None
    for name, reads, seconds, *rest in backward:
        target, kernel = (rest + [RELU_BW, True][len(rest):])[:2]
        buffers.append(Buffer(name, grad_mib * MiB, BufferKind.TEMP))
        args = tuple(op_of[r] for r in reads) + ((prev,) if prev is not None else ())
        ops.append(_make(Op, name=name, target=target, graph=0, phase=Phase.BACKWARD, args=args,
                         allocs=(len(buffers) - 1,), kernel=kernel, recomputable=True))
        buffer_of.append((len(buffers) - 1,))
        times.append(float(seconds))
        prev = len(ops) - 1
    acts = []
    for name in sorted((n for n in saved_names if n != "x"), key=op_of.get):
        op = op_of[name]
        nbytes = buffers[buffer_of[op][0]].nbytes
        acts.append(_make(Activation, name=name, graph=0, buffer=buffer_of[op][0], producer=op, members=(op,),
                          transfer_bytes=nbytes, member_bytes=(nbytes,), swappable=True))
    graph = StepGraph(tuple(ops), tuple(buffers), tuple(acts), 0, ((0, fw_stop),), ((fw_stop, len(ops)),),
                      frozenset([0, *(a.producer for a in acts)]), tuple(buffer_of))
    d2h = tuple(float(xfer.get(a.name, (0.0, 0.0))[0]) for a in acts)
    h2d = tuple(float(xfer.get(a.name, (0.0, 0.0))[1]) for a in acts)
    return graph, Costs(tuple(times), d2h, h2d)


def chain(fw: Sequence[float], bw: Sequence[float], mib: Sequence[int], xfer: Sequence[tuple[float, float]],
          loss: float | None = None, targets: Sequence[str] | None = None) -> tuple[StepGraph, Costs]:
    """f1..fn, each reading the previous; g_n..g_1 in the backward, g_i reading a_i.

    Op ids: x=0, f_i=i, [loss=n+1], then the backward ops in order. ``bw[0]`` is g_n's time.
    """
    n = len(fw)
    targets = targets or [RELU] * n
    forward = [(f"a{i + 1}", ["x" if i == 0 else f"a{i}"], fw[i], mib[i], targets[i]) for i in range(n)]
    if loss is not None:
        forward.append(("loss", [f"a{n}"], loss, 0))
    back_target = {RELU: RELU_BW, CONV: CONV_BW}
    backward = [(f"g{i + 1}", [f"a{i + 1}"], bw[n - 1 - i], back_target[targets[i]]) for i in reversed(range(n))]
    return build(forward, backward, {f"a{i + 1}": xfer[i] for i in range(n)})


DROPOUT = "aten.native_dropout.default"


def dropout_drawn_only(graph: StepGraph) -> StepGraph:
    """``graph`` with its dropouts not recomputable, as fxpooch built graphs before it rebuilt a
    dropout's output from its saved mask (``fxpooch.recompute``): the recomputation reads the op's
    own arguments. Scenario tests whose plans were found on such graphs pin them with it."""
    ops = tuple(dataclasses.replace(op, recomputable=False, recompute_args=op.args) if op.target == DROPOUT else op
                for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)

