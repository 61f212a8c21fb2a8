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

The graphs a plan rewrites for inductor must be captured with inductor's decompositions
(:func:`decompositions`), since inductor lowers only decomposed ATen ops.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

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
    example = [n.meta["val"] for n in copy.graph.find_nodes(op="placeholder")]
    compiled = compat.inductor_compile(copy, example, is_backward)
    log.debug("inductor compiled a %s graph of %d nodes", "backward" if is_backward else "forward",
              len(gm.graph.nodes))
    return compiled


def compile_inference(gm: fx.GraphModule, example_inputs: list[Any]) -> Boxed:
    """An inference graph (grad disabled: nothing saved, nothing planned) compiled by inductor."""
    return compat.inductor_compile(gm, example_inputs, is_backward=False)


def _plain_copy(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the default (unboxed) calling convention, as inductor expects."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new
