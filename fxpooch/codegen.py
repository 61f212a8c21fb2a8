"""Stage 7, code generation: how a rewritten forward and backward ``GraphModule`` run.

``"fx"`` runs the module op by op (its generated Python calls each ATen op and ``fxpooch::`` op).
``"inductor"`` compiles the very same module with inductor (C++/OpenMP kernels on CPU, Triton on
CUDA): pointwise chains fuse into one kernel, a recompute chain included, while the
``fxpooch::offload`` / ``prefetch`` / ``wait`` / ``drop`` calls stay extern calls at their places
(their fake kernels are in :mod:`fxpooch.runtime`; their outputs are what the later ops and the
backward read, so inductor neither drops nor moves them past their readers, and its reordering
for peak memory is switched off so the plan's order is the order that runs). Inductor compiles a
copy, because its passes edit the graph they are given: the module the caller inspects
(``print_readable``) is the input of the compiled code, node for node. A pair compiles together
(:func:`compile_pair`): the activations the forward saves keep the layout inductor computes them
in, and the backward is compiled for it, as in ``torch.compile``.

Inductor computes a pointwise value when a reader needs it in memory, fuses kernels across the
graph's order and hands freed buffers to later kernels; each of these, measured, put a step's
peak above its plan (a prefetch allocated while a chain the plan had finished was still pending;
a kernel allocating outputs of work on both sides of a matmul). So the compiled copy pins every
offload and prefetch after the values live across it (:func:`_order_copies`), and
:func:`fxpooch._torch_compat.inductor_compile` fuses no kernels across an extern call and reuses
no freed buffer. What remains is fusion inside a run of kernels between two extern calls, which
only removes intermediates the plan counts.

The graphs a plan rewrites for inductor must be captured with inductor's decompositions
(:func:`decompositions`), since inductor lowers only decomposed ATen ops.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from . import _torch_compat as compat
from .errors import UnknownName

log = logging.getLogger("fxpooch.codegen")

#: the code generators by name
CODEGENS = ("fx", "inductor")

#: what a code generator returns: a boxed callable (takes the list of inputs and clears it)
Boxed = Callable[[list[Any]], Any]


def check_codegen(name: str) -> str:
    """``name`` if it is a code generator; otherwise :class:`~fxpooch.errors.UnknownName`."""
    if name not in CODEGENS:
        raise UnknownName("codegen", name, CODEGENS)
    return name


def decompositions(codegen: str) -> dict | None:
    """The decompositions AOTAutograd applies when capturing for ``codegen`` (None: its default)."""
    return compat.inductor_decompositions() if check_codegen(codegen) == "inductor" else None


def compile_pair(forward: fx.GraphModule, backward: fx.GraphModule, num_user_outputs: int,
                 codegen: str) -> tuple[Boxed, Boxed]:
    """A rewritten pair made boxed (inputs die at their last use), and the callables that run it.

    With inductor the forward is compiled first. Its first ``num_user_outputs`` outputs (what the
    caller gets: the step's outputs, mutated buffers) keep their traced strides; the layout of what
    it saves for the backward is inductor's choice, as in ``torch.compile`` (convolution outputs stay
    channels-last instead of being copied to the traced, contiguous layout), and the backward is
    compiled for the strides the forward's code gives them. Same bytes either way: only the layout
    differs. What the forward saves of its inputs (the parameters) is passed as it is, not as a
    relaid copy the plan would not count; so is a host copy (the output of ``fxpooch::offload``,
    which fixes its input's stride order)."""
    compat.set_boxed_codegen(forward)
    compat.set_boxed_codegen(backward)
    if check_codegen(codegen) == "fx":
        return forward, backward
    fw_copy, fw_example = _inductor_input(forward)
    outs = forward.graph.output_node().args[0]
    # kept as they are, not copied to another layout: a forward input the backward reads (a parameter: the
    # plan counts it once, as resident) and a host copy (the runtime's pool block)
    fixed = [i for i, o in enumerate(outs) if i < num_user_outputs or _is_input_or_host_copy(o)]
    fw_code, strides = compat.inductor_compile(fw_copy, fw_example, is_backward=False, fixed_outputs=fixed)
    saved = strides[num_user_outputs:]  # what the forward saves for the backward, in order
    bw_copy, bw_example = _inductor_input(backward)
    # AOTAutograd's contract: the backward takes the saved symbolic ints first, then the saved values in
    # the forward's order (then the incoming gradients); the strides of a symbolic int are None. A dropped
    # activation (recomputed instead) reaches the backward as what ``fxpooch::drop`` returns, an empty tensor.
    read = [bool(p.users) for p in bw_copy.graph.find_nodes(op="placeholder")]
    first = next((i for i, v in enumerate(bw_example) if not isinstance(v, torch.SymInt | int)), len(bw_example))
    relaid = 0
    for i, stride in enumerate(saved[:len(bw_example) - first], start=first):
        value = bw_example[i]
        if _is_drop(outs[num_user_outputs + i - first]) and isinstance(value, torch.Tensor):
            bw_example[i] = value.new_empty(0)
        elif stride is not None and read[i] and isinstance(value, torch.Tensor) and tuple(value.stride()) != stride:
            bw_example[i] = value.as_strided(value.shape, stride, value.storage_offset())
            relaid += 1
    bw_code, _ = compat.inductor_compile(bw_copy, bw_example, is_backward=True)
    log.debug("inductor compiled a pair of %d forward and %d backward nodes; %d saved tensors laid out "
              "otherwise than traced", len(forward.graph.nodes), len(backward.graph.nodes), relaid)
    return fw_code, bw_code


def _is_drop(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.target is torch.ops.fxpooch.drop.default


def compile_inference(gm: fx.GraphModule, example_inputs: list[Any]) -> Boxed:
    """An inference graph (grad disabled: nothing saved, nothing planned) compiled by inductor."""
    return compat.inductor_compile(gm, example_inputs, is_backward=False)[0]


def _inductor_input(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Any]]:
    """A copy of ``gm`` for inductor (its passes edit the graph they get) and its example inputs."""
    copy = fx.GraphModule(gm, _plain_copy(gm.graph))
    _order_copies(copy.graph)
    return copy, [n.meta["val"] for n in copy.graph.find_nodes(op="placeholder")]


#: the ops that allocate or release activation memory where the plan put them
_COPIES = (torch.ops.fxpooch.offload.default, torch.ops.fxpooch.prefetch.default)


def _order_copies(graph: fx.Graph) -> None:
    """Pin each offload and prefetch after every value the graph computes before it and reads after it.

    Inductor computes a pointwise value only when a reader needs it in memory, so a chain the graph
    runs before a prefetch may run after it: the prefetched copy is then allocated while the chain's
    inputs are still alive, above the plan's peak at that point. ``after(x, done)`` (``x`` itself)
    makes the copy read every such value, so inductor computes them before the copy starts, and the
    memory alive at the copy is what the plan counted. Values the graph both computes and reads
    before the copy are left to fuse freely.
    """
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    live: dict[fx.Node, None] = {}  # computed tensors read later, in order
    for node in list(graph.nodes):
        inputs = node.all_input_nodes  # before pinning: the copy's input dies here, not at its pin
        if node.target in _COPIES:
            done = [m for m in live if m not in node.args]
            if done:
                with graph.inserting_before(node):
                    pinned = graph.call_function(torch.ops.fxpooch.after.default, (node.args[0], done))
                pinned.meta["val"] = node.args[0].meta.get("val")
                node.update_arg(0, pinned)
        for arg in inputs:
            if last_use.get(arg) is node:
                live.pop(arg, None)
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor) and node in last_use:
            live[node] = None


def _plain_copy(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the default (unboxed) calling convention, as inductor expects."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _is_input_or_host_copy(node: Any) -> bool:
    """Whether ``node`` is a graph input or the output of one of fxpooch's ops (:mod:`fxpooch.runtime`)."""
    return isinstance(node, fx.Node) and (node.op == "placeholder"
                                          or getattr(node.target, "namespace", None) == "fxpooch")
