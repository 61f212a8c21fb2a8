"""How a forward op is run again in the backward.

Most ops are copied as they are; a random or mutating op is not run again. Two are rewritten:

* Training-mode functional BatchNorm reads the running statistics only to return their updates;
  recomputing it must neither need them (the step mutates them) nor update them twice, so it is
  recomputed in its ``no_stats`` form, whose first three outputs (normalised input, batch mean,
  inverse std) are the same values.
* Training-mode dropout is random, but its output is its input times its mask times ``1 / (1 - p)``:
  with the mask saved (its backward reads it), the output is rebuilt from the input and the mask
  (``native_dropout_backward`` computes exactly that product), and the mask itself, the random draw,
  is never recomputed. Attention's dropped-out probabilities, which the next matmul's backward reads,
  are then recomputed like the softmax before them, as ``torch.utils.checkpoint`` does with its saved
  RNG state.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from . import _torch_compat as compat

_BN_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats
_DROPOUT = torch.ops.aten.native_dropout.default
_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default


def dropout_mask(node: fx.Node) -> fx.Node | None:
    """The mask of a training-mode ``native_dropout`` node (the ``getitem`` of its second output),
    when the graph reads it; None for any other node."""
    if node.op != "call_function" or node.target is not _DROPOUT or node.args[2] is not True:
        return None
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None)


def _from_mask(node: fx.Node) -> fx.Node | None:
    """The dropout whose output ``node`` (its first ``getitem``) is, where it is rebuilt from its mask."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return None
    source = node.args[0]
    return source if isinstance(source, fx.Node) and dropout_mask(source) is not None else None


def recomputable(node: fx.Node) -> bool:
    """Whether ``node`` can run again in the backward: not random (but dropout, from its mask; its
    mask, the draw, never), not mutating."""
    if node.op != "call_function":
        return False
    if dropout_mask(node) is not None:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and dropout_mask(node.args[0]) is node:
        return False
    return not (compat.is_random_op(node.target) or compat.is_mutating_op(node.target))


def _is_training_bn(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _BN_FUNCTIONAL and bool(node.args[5])


def recompute_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes a recomputation of ``node`` reads."""
    if _is_training_bn(node):
        x, weight, bias = node.args[:3]
        return [a for a in (x, weight, bias) if isinstance(a, fx.Node)]
    if (mask := dropout_mask(node)) is not None:
        return [node.args[0], mask]
    return list(node.all_input_nodes)


def recompute_call(node: fx.Node, lookup: Callable[[fx.Node], fx.Node]) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) that recompute ``node``; ``lookup`` maps the inputs it reads."""
    if _is_training_bn(node):
        x, weight, bias, _mean, _var, training, momentum, eps = node.args
        args = fx.node.map_arg((x, weight, bias), lookup)
        return _BN_NO_STATS, (*args, training, momentum, eps), {}
    if (mask := dropout_mask(node)) is not None:
        p = node.args[1]
        return _DROPOUT_BACKWARD, (lookup(node.args[0]), lookup(mask), 0.0 if p >= 1 else 1.0 / (1.0 - p)), {}
    if _from_mask(node) is not None:  # the rebuilt dropout is its output alone, not the (output, mask) pair
        return torch.ops.aten.alias.default, (lookup(node.args[0]),), {}
    return node.target, fx.node.map_arg(node.args, lookup), fx.node.map_arg(node.kwargs, lookup)


def recomputed_val(node: fx.Node) -> Any:
    """The traced value (``meta["val"]``) of ``node``'s recomputation (:func:`recompute_call`)."""
    val = node.meta.get("val")
    return val[0] if dropout_mask(node) is not None and isinstance(val, (tuple, list)) else val
