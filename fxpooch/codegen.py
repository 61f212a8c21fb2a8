"""Stage 7, code generation: how a rewritten forward or backward ``GraphModule`` runs.

``"fx"`` runs the module op by op (its generated Python calls each ATen op and ``fxpooch::`` op).
``"inductor"`` compiles the very same module with inductor (C++/OpenMP kernels on CPU, Triton on
CUDA): pointwise chains fuse into one kernel, a recompute chain included, while the
``fxpooch::offload`` / ``prefetch`` / ``wait`` / ``drop`` calls stay extern calls at their places
(their fake kernels are in :mod:`fxpooch.runtime`; their outputs are what the later ops and the
backward read, so inductor neither drops nor moves them past their readers, and its reordering
for peak memory is switched off so the plan's order is the order that runs). Inductor compiles a
copy, because its passes edit the graph they are given: the module the caller inspects
(``print_readable``) is the input of the compiled code, node for node.

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


def compile_graph(gm: fx.GraphModule, codegen: str, *, is_backward: bool) -> Boxed:
    """``gm`` made boxed (its inputs die at their last use), and the callable that runs it."""
    compat.set_boxed_codegen(gm)
    if check_codegen(codegen) == "fx":
        return gm
    copy = fx.GraphModule(gm, _plain_copy(gm.graph))
    _order_copies(copy.graph)
    example = [n.meta["val"] for n in copy.graph.find_nodes(op="placeholder")]
    compiled = compat.inductor_compile(copy, example, is_backward)
    log.debug("inductor compiled a %s graph of %d nodes", "backward" if is_backward else "forward",
              len(gm.graph.nodes))
    return compiled


def compile_inference(gm: fx.GraphModule, example_inputs: list[Any]) -> Boxed:
    """An inference graph (grad disabled: nothing saved, nothing planned) compiled by inductor."""
    return compat.inductor_compile(gm, example_inputs, is_backward=False)


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
