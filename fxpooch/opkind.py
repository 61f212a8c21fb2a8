"""Which nodes of an aten-level FX graph launch a kernel (:func:`is_kernel_free`).

A leaf module read by the planner's IR (:mod:`fxpooch.graph`: which ops count as kernels) and by
the cost model (:mod:`fxpooch.costmodel`: kernel-free nodes cost nothing).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ._torch_compat import OpOverload

__all__ = ["is_kernel_free"]

# Node kinds that never run a kernel themselves.
_STRUCTURAL_OPS = frozenset({"placeholder", "output", "get_attr"})


def _is_tensor_type(jit_type: Any) -> bool:
    """True for ``Tensor``, ``Tensor?`` and ``Tensor[]`` schema types."""
    kind = jit_type.kind()
    if kind in ("ListType", "OptionalType"):
        return _is_tensor_type(jit_type.getElementType())
    return kind == "TensorType"


def _schema_is_view(schema: torch.FunctionSchema) -> bool:
    """True when the op writes nothing and every tensor it returns aliases an input.

    Non-tensor returns (``sym_size`` -> ``SymInt``) need no kernel either, so an op that only
    returns those, or returns nothing without mutating anything, also counts as a view.
    """
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    for ret in schema.returns:
        if _is_tensor_type(ret.type) and (ret.alias_info is None or ret.alias_info.is_write):
            return False
    return True


def is_kernel_free(node: fx.Node) -> bool:
    """True if ``node`` launches no kernel.

    That is placeholders, outputs, ``get_attr``, ``operator.getitem``, any ``call_function``
    whose target is not an ``OpOverload`` (plain Python functions), and aten ops whose schema
    says they only alias their inputs (``view``, ``t``, ``expand``, ``split``, ``detach``, ...).
    ``aten._unsafe_view`` has no alias annotation in its schema and is treated as a kernel.
    """
    if node.op in _STRUCTURAL_OPS or node.op != "call_function":
        return True  # call_module / call_method do not occur in aten-level graphs
    target = node.target
    if target is operator.getitem or not isinstance(target, OpOverload):
        return True
    return _schema_is_view(target._schema)
