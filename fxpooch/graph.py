"""The planner's framework-free view of a training step: integer ids, byte counts, no fx.Node.

:func:`build_step_graph` lowers captured :class:`~fxpooch.capture.GraphPair` s to a
:class:`StepGraph` and a :class:`NodeTable` (op id -> fx.Node) that only the rewrite and the
profiler use. Program order is every forward graph in order, then every backward graph in
reverse order, which is how autograd runs a chain of dynamo graphs.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import _torch_compat as compat
from .capture import GraphPair
from .opkind import is_kernel_free
from .memory import MemoryModel
from .recompute import recomputable, recompute_inputs
from .tangents import beside_tangents, caller_gradients, span
from .tangents import node_tensors as _vals


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class BufferKind(str, enum.Enum):
    RESIDENT = "resident"  # parameters, buffers, inputs: exist before the step (counted once)
    TEMP = "temp"  # freed after its last reader
    #: user outputs, gradients and the loss's incoming gradient (``loss.backward()``'s ones): live
    #: until the step ends (the caller may hold the output through the backward; one it drops
    #: earlier only lowers the real peak)
    OUTPUT = "output"
    #: a user output the caller drops before the backward (``build_step_graph(outputs_held=False)``,
    #: e.g. the logits next to a loss the model computes): lives until the forward returns
    RETURNED = "returned"
    #: incoming output gradients: allocated when their backward starts and held by autograd for the
    #: whole backward call (a gradient AOTAutograd has to copy to the traced layout, e.g. the
    #: expanded one of ``out.sum()``, dies at its last reader instead: again only lower)
    TANGENT = "tangent"
    #: a gradient a backward graph returns that does not stay to the step's end: held until its backward
    #: call returns, then reduce-scattered and freed (a parameter's, when FSDP shards the model:
    #: ``build_step_graph(gradients_reduced=True)``), or passed on as the incoming gradient of the graph
    #: before a graph break (its input's; counted there again, as a TANGENT)
    REDUCED = "reduced"


@dataclass(frozen=True)
class Op:
    name: str
    target: str
    graph: int
    phase: Phase
    args: tuple[int, ...]  # ops whose values this op reads
    recompute_args: tuple[int, ...]  # ops its recomputation reads (see fxpooch.recompute)
    allocs: tuple[int, ...]  # buffers this op creates
    kernel: bool  # launches device work (kernel-free ops: placeholders, views, getitem)
    recomputable: bool  # safe to run again in the backward (fxpooch.recompute.recomputable)
    #: its value depends on an input the backward differentiates (a parameter): False for a
    #: causal mask or position ids made from the inputs' shapes, which no gradient flows through
    differentiable: bool = True


@dataclass(frozen=True)
class Buffer:
    name: str
    nbytes: int
    kind: BufferKind


@dataclass(frozen=True)
class Activation:
    """A storage the forward saves for the backward: what the planner decides on."""

    name: str
    graph: int
    buffer: int
    producer: int  # the op that allocates the storage
    members: tuple[int, ...]  # saved forward ops whose values live on this storage
    transfer_bytes: int  # bytes a swap moves each way (the members with copies of their own)
    member_bytes: tuple[int, ...]  # per member: bytes its copy moves; 0 for a view of another's copy
    view_of: tuple[int, ...]  # per member: the member whose copy it is a view of (itself: its own copy)
    swappable: bool


@dataclass(frozen=True)
class StepGraph:
    ops: tuple[Op, ...]
    buffers: tuple[Buffer, ...]
    activations: tuple[Activation, ...]
    resident_bytes: int
    #: per graph index: [start, stop) op ids of its forward and of its backward
    forward_range: tuple[tuple[int, int], ...]
    backward_range: tuple[tuple[int, int], ...]
    #: forward ops whose values the backward receives (activations' members and resident ones)
    saved: frozenset[int]
    buffer_of: tuple[tuple[int, ...], ...] = field(repr=False)  # op id -> buffers its value spans
    #: per op: device bytes it allocates and frees inside itself each time it runs, above its inputs
    #: and outputs (a measured profile's, :meth:`fxpooch.profile.Profile.charged`); () when none has any
    op_scratch: tuple[int, ...] = ()

    def backward_readers(self, act: Activation) -> list[int]:
        """Backward ops (program order) that read one of ``act``'s members."""
        return self._backward_readers[act.buffer]

    @functools.cached_property
    def _backward_readers(self) -> dict[int, list[int]]:
        owner = {m: act.buffer for act in self.activations for m in act.members}
        readers: dict[int, list[int]] = {act.buffer: [] for act in self.activations}
        for start, stop in self.backward_range:
            for i in range(start, stop):
                for b in dict.fromkeys(owner[a] for a in self.ops[i].args if a in owner):
                    readers[b].append(i)
        for r in readers.values():
            r.sort()
        return readers

    @functools.cached_property
    def dynamic_allocs(self) -> tuple[tuple[int, ...], ...]:
        """Per op: the buffers it allocates on the device during the step (resident ones excluded)."""
        return tuple(tuple(b for b in op.allocs if self.buffers[b].kind is not BufferKind.RESIDENT)
                     for op in self.ops)

    @functools.cached_property
    def recompute_allocs(self) -> tuple[tuple[int, ...], ...]:
        """Per op: the buffers its recomputation allocates, its :attr:`dynamic_allocs` but those it
        reads (a dropout rebuilt from its mask makes its output, not the mask it reads)."""
        return tuple(tuple(b for b in allocs if b not in reads)
                     for allocs, reads in zip(self.dynamic_allocs, self.recompute_read_buffers))

    @functools.cached_property
    def read_buffers(self) -> tuple[tuple[int, ...], ...]:
        """Per op: the non-resident buffers its arguments span, first seen first."""
        return tuple(self._spanned(op.args) for op in self.ops)

    @functools.cached_property
    def recompute_read_buffers(self) -> tuple[tuple[int, ...], ...]:
        """Per op: the non-resident buffers its recomputation reads."""
        return tuple(self._spanned(op.recompute_args) for op in self.ops)

    def _spanned(self, op_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(dict.fromkeys(b for x in op_ids for b in self.buffer_of[x]
                                   if self.buffers[b].kind is not BufferKind.RESIDENT))

    @functools.cached_property
    def tangent_buffers(self) -> tuple[tuple[int, ...], ...]:
        """Per graph index: the buffers its backward call holds until it returns (its incoming
        gradients, and the gradients it returns when they are :attr:`BufferKind.REDUCED`)."""
        out: list[list[int]] = [[] for _ in self.backward_range]
        for b, g in self.buffer_graph.items():
            if self.buffers[b].kind in (BufferKind.TANGENT, BufferKind.REDUCED):
                out[g].append(b)
        return tuple(tuple(sorted(b)) for b in out)

    @functools.cached_property
    def returned_buffers(self) -> tuple[int, ...]:
        """The user outputs the caller drops before the backward (:attr:`BufferKind.RETURNED`)."""
        return tuple(b for b, buf in enumerate(self.buffers) if buf.kind is BufferKind.RETURNED)

    @functools.cached_property
    def buffer_graph(self) -> dict[int, int]:
        """Graph index of the op that allocates each allocated buffer."""
        return {b: op.graph for op in self.ops for b in op.allocs}


@dataclass
class NodeTable:
    """op id <-> fx.Node, for the stages that touch FX (profile, rewrite). Never given to a planner."""

    nodes: list[fx.Node]
    pairs: list[GraphPair]
    op_of: dict[fx.Node, int]


def _target_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    return str(node.target)


def copies_of(views: list[torch.Tensor]) -> tuple[int, ...]:
    """Per view of one storage: the view whose copy it can be rebuilt from (itself: it needs a
    copy of its own). A dense view's copy holds every element of its span, so a view of the same
    dtype whose elements all lie in that span is a view of the copy (``view_in_copy``): the
    softmax output that attention saves both as is and reshaped for its matmul is copied once.
    The largest views are copied first."""
    out = list(range(len(views)))
    copied: list[int] = []
    for i in sorted(range(len(views)), key=lambda i: (-views[i].numel(), i)):
        out[i] = next((j for j in copied if view_in_copy(views[i], views[j]) is not None), i)
        if out[i] == i:
            copied.append(i)
    return tuple(out)


def view_in_copy(view: torch.Tensor, copied: torch.Tensor) -> tuple[list[int], list[int], int] | None:
    """(shape, stride, storage offset) of ``view`` inside a copy of ``copied`` made with its shape
    and strides (``empty_strided`` + ``copy_``, storage offset 0), or None when the copy does not
    hold all of ``view``: ``copied`` is not dense, or has another dtype, or ``view`` reaches
    outside its span."""
    if view.dtype != copied.dtype or not _is_dense(copied) or any(s < 0 for s in view.stride()):
        return None
    offset = view.storage_offset() - copied.storage_offset()
    extent = sum((n - 1) * s for n, s in zip(view.shape, view.stride())) + 1 if view.numel() else 0
    if offset < 0 or offset + extent > copied.numel():
        return None
    return list(view.shape), list(view.stride()), offset


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a copy can keep its strides (empty_strided + copy_)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def differentiated_inputs(pair: GraphPair) -> set[fx.Node]:
    """The forward's placeholders that its backward returns a gradient for (AOTAutograd's backward
    returns one per forward input, in order); every placeholder where the layout is not that."""
    primals = pair.forward.graph.find_nodes(op="placeholder")
    grads = pair.backward.graph.output_node().args[0]
    if len(grads) != len(primals):
        return set(primals)
    return {p for p, grad in zip(primals, grads) if grad is not None}


def build_step_graph(pairs: Sequence[GraphPair], memory: MemoryModel, resident_bytes: int, *,
                     outputs_held: bool = True, gradients_reduced: bool = False) -> tuple[StepGraph, NodeTable]:
    """The framework-free step of ``pairs``. ``outputs_held``: the caller holds the model's outputs
    until the step ends (True), or drops them before calling backward on the loss (False: each
    lives until the forward returns, but a 0-dim one, the loss, and one the backward reads; the
    incoming gradients are then autograd's own, zeros for a dropped output, each freed after its
    last reader instead of held through the backward call). ``gradients_reduced``: FSDP shards the
    model, so the gradients each backward graph returns are freed once it returns (False: they
    live until the step ends, as gradients accumulated into ``.grad``)."""
    ops: list[Op] = []
    nodes: list[fx.Node] = []
    op_of: dict[fx.Node, int] = {}
    buffers: list[Buffer] = []
    buffer_of: list[tuple[int, ...]] = []
    producer: dict[int, int] = {}  # buffer -> op that allocates it
    later: list[tuple[int, list[fx.Node]]] = []  # ops whose recomputation reads a node added after them
    activations: list[Activation] = []
    saved: set[int] = set()
    fw_range: list[tuple[int, int]] = []
    bw_range: list[tuple[int, int]] = [(0, 0)] * len(pairs)
    keys: list[dict[int, int]] = []  # per pair: storage key -> buffer id
    allocated_on: dict[int, list[int]] = {}  # storage key -> every buffer allocated on it

    def add_op(node: fx.Node, g: int, phase: Phase, key_to_buf: dict[int, int], kind: BufferKind,
               differentiable: bool = True) -> None:
        allocs, spans = [], []
        for v in _vals(node):
            k = compat.storage_key(v)
            if phase is Phase.BACKWARD and node.op == "call_function" and k in key_to_buf:
                # A backward node traced on the same fake storage as a forward one aliases it only if
                # it reads it; a recomputation (torch.utils.checkpoint) allocates its own.
                read = {b for a in node.all_input_nodes for b in buffer_of[op_of[a]]}
                if key_to_buf[k] not in read:
                    key_to_buf[k] = next((b for b in allocated_on.get(k, ()) if b in read), None)
                    if key_to_buf[k] is None:
                        del key_to_buf[k]
            if k not in key_to_buf or node.op == "placeholder" and phase is Phase.BACKWARD:  # each tangent its own
                key_to_buf[k] = len(buffers)
                nbytes = 0 if kind is BufferKind.RESIDENT else memory.storage_bytes(v) if node.op != "placeholder" \
                    or phase is Phase.FORWARD else memory.round(span(v) * v.element_size())  # a tangent's layout
                buffers.append(Buffer(node.name, nbytes, kind))
                allocs.append(key_to_buf[k])
                producer[key_to_buf[k]] = len(ops)
                allocated_on.setdefault(k, []).append(key_to_buf[k])
            spans.append(key_to_buf[k])
        args = tuple(dict.fromkeys(op_of[a] for a in node.all_input_nodes))
        reads = recompute_inputs(node)
        recompute_args = tuple(dict.fromkeys(op_of[a] for a in reads if a in op_of))
        if len(recompute_args) < len(dict.fromkeys(reads)):  # a later node (dropout's mask): once it is added
            later.append((len(ops), reads))
        kernel = node.op == "call_function" and not is_kernel_free(node)
        op_of[node] = len(ops)
        nodes.append(node)
        ops.append(Op(node.name, _target_name(node), g, phase, args, recompute_args, tuple(allocs), kernel,
                      recomputable(node), differentiable))
        buffer_of.append(tuple(dict.fromkeys(spans)))

    beside: list[tuple[list[Buffer], list[Buffer]]] = []  # per pair: held and transient, when the outputs are held
    for g, pair in enumerate(pairs):
        key_to_buf: dict[int, int] = {}
        keys.append(key_to_buf)
        out_node = pair.forward.graph.output_node()
        user_outputs = [n for n in out_node.args[0][: pair.num_user_outputs] if isinstance(n, fx.Node)]
        start = len(ops)
        differentiated = differentiated_inputs(pair)
        for node in pair.forward.graph.nodes:
            if node.op == "output":
                continue
            kind = BufferKind.RESIDENT if node.op == "placeholder" else BufferKind.TEMP
            diff = node in differentiated if node.op == "placeholder" else \
                any(ops[op_of[a]].differentiable for a in node.all_input_nodes)
            add_op(node, g, Phase.FORWARD, key_to_buf, kind, diff)
        for i, reads in later:
            ops[i] = dataclasses.replace(ops[i], recompute_args=tuple(dict.fromkeys(op_of[a] for a in reads)))
        later.clear()
        fw_range.append((start, len(ops)))
        # user outputs live until the step ends; dropped ones until the forward returns, unless the
        # backward reads them too (then autograd holds them: counted to the end, as held ones) or they
        # are a loss (a 0-dim output: the caller holds what it calls backward on)
        saved_bufs = {b for n in pair.saved_nodes for b in buffer_of[op_of[n]]}
        for n in user_outputs:
            loss = any(v.dim() == 0 for v in _vals(n))
            for b in buffer_of[op_of[n]]:
                if buffers[b].kind is BufferKind.TEMP:
                    held = outputs_held or loss or b in saved_bufs
                    kind = BufferKind.OUTPUT if held else BufferKind.RETURNED
                    buffers[b] = Buffer(buffers[b].name, buffers[b].nbytes, kind)
        held, transient = beside_tangents(pair, memory) if outputs_held else ([], [])
        beside.append(([Buffer(n, b, BufferKind.TANGENT) for n, b in held],
                       [Buffer(n, b, BufferKind.TEMP) for n, b in transient]))
        # activations: saved storages that the forward allocated
        by_buffer: dict[int, list[int]] = {}
        for n in pair.saved_nodes:
            op_id = op_of[n]
            saved.add(op_id)
            for b in buffer_of[op_id]:
                if buffers[b].kind is BufferKind.TEMP:
                    by_buffer.setdefault(b, []).append(op_id)
        for b, members in by_buffer.items():
            member_vals = [_vals(nodes[m])[0] for m in members]
            view_of = copies_of(member_vals)
            member_bytes = tuple(memory.tensor_bytes(v) if view_of[i] == i else 0 for i, v in enumerate(member_vals))
            activations.append(Activation(
                name=nodes[members[0]].name, graph=g, buffer=b, producer=producer[b], members=tuple(members),
                transfer_bytes=sum(member_bytes), member_bytes=member_bytes, view_of=view_of,
                swappable=all(len(_vals(nodes[m])) == 1 and _is_dense(v) for m, v in zip(members, member_vals)),
            ))

    for g in reversed(range(len(pairs))):
        pair, key_to_buf = pairs[g], keys[g]
        bw_placeholders = [n for n in pair.backward.graph.nodes if n.op == "placeholder"]
        saved_nodes = pair.saved_nodes
        last_tangent = bw_placeholders[-1] if len(bw_placeholders) > len(saved_nodes) else None
        start = len(ops)
        for node in pair.backward.graph.nodes:
            if node.op == "output":
                # gradients live until the step ends (or the call returns: FSDP's, and an input's that
                # autograd passes on to the graph that made it, counted there as its incoming gradient)
                for i, n in enumerate(node.args[0]):
                    reduced = gradients_reduced or i in pair.passed_on
                    for b in buffer_of[op_of[n]] if isinstance(n, fx.Node) else ():
                        if buffers[b].kind is BufferKind.TEMP:
                            kind = BufferKind.REDUCED if reduced else BufferKind.OUTPUT
                            buffers[b] = Buffer(buffers[b].name, buffers[b].nbytes, kind)
                continue
            if node.op == "placeholder" and bw_placeholders.index(node) < len(saved_nodes):
                # a saved value: the same value the forward produced
                op_of[node] = op_of[saved_nodes[bw_placeholders.index(node)]]
                continue
            # an incoming gradient: held by whoever passed it for the whole backward call; when the caller
            # drops the outputs, each but the loss's is autograd's zeros, freed after its last reader
            # (held through the call too before torch 2.13: ``compat.missing_gradients_held``). One
            # traced with gaps (``y[:, :64]``, a split) is AOTAutograd's copy of the caller's, in that layout
            # (``empty_strided``: its whole span), freed after its last reader; the caller's is held beside.
            # The loss's (0-dim) is the one ``loss.backward()`` makes and holds until every backward
            # graph has returned: to the step's end.
            loss = any(v.dim() == 0 for v in _vals(node))
            held = outputs_held or loss
            gaps = node.op == "placeholder" and not all(map(_is_dense, _vals(node)))
            zeros_held = not held and compat.missing_gradients_held()
            kind = BufferKind.TEMP if node.op != "placeholder" or not (held or zeros_held) or gaps else \
                BufferKind.OUTPUT if loss else BufferKind.TANGENT
            add_op(node, g, Phase.BACKWARD, key_to_buf, kind)
            if gaps and held:
                beside[g][0].extend(Buffer(f"grad_{node.name}", memory.tensor_bytes(v), BufferKind.TANGENT)
                                        for v in _vals(node))
            if node is last_tangent:  # the caller's gradients beside the tangents, allocated with them
                extra = tuple(range(len(buffers), len(buffers) + sum(map(len, beside[g]))))
                buffers.extend(beside[g][0] + beside[g][1])
                producer.update(dict.fromkeys(extra, len(ops) - 1))
                ops[-1] = dataclasses.replace(ops[-1], allocs=ops[-1].allocs + extra)
        if g == len(pairs) - 1 and outputs_held and start < len(ops):
            # the caller's gradients autograd holds from the step's first backward on beside the tangents
            extra = tuple(range(len(buffers), len(buffers) + len(held := caller_gradients(pairs, memory))))
            buffers.extend(Buffer(n, b, BufferKind.OUTPUT) for n, b in held)
            producer.update(dict.fromkeys(extra, start))
            ops[start] = dataclasses.replace(ops[start], allocs=ops[start].allocs + extra)
        bw_range[g] = (start, len(ops))

    graph = StepGraph(
        ops=tuple(ops), buffers=tuple(buffers), activations=tuple(activations),
        resident_bytes=resident_bytes, forward_range=tuple(fw_range), backward_range=tuple(bw_range),
        saved=frozenset(saved), buffer_of=tuple(buffer_of),
    )
    return graph, NodeTable(nodes, list(pairs), op_of)
