"""How a forward op is run again in the backward.

Most ops are copied as they are. Training-mode functional BatchNorm reads the running
statistics only to return their updates; recomputing it must neither need them (the step
mutates them) nor update them twice, so it is recomputed in its ``no_stats`` form, whose first
three outputs (normalised input, batch mean, inverse std) are the same values.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

_BN_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats


def _is_training_bn(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _BN_FUNCTIONAL and bool(node.args[5])


def recompute_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes a recomputation of ``node`` reads."""
    if _is_training_bn(node):
        x, weight, bias = node.args[:3]
        return [a for a in (x, weight, bias) if isinstance(a, fx.Node)]
    return list(node.all_input_nodes)


def recompute_call(node: fx.Node, lookup: Callable[[fx.Node], fx.Node]) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) that recompute ``node``; ``lookup`` maps the inputs it reads."""
    if _is_training_bn(node):
        x, weight, bias, _mean, _var, training, momentum, eps = node.args
        args = fx.node.map_arg((x, weight, bias), lookup)
        return _BN_NO_STATS, (*args, training, momentum, eps), {}
    return node.target, fx.node.map_arg(node.args, lookup), fx.node.map_arg(node.kwargs, lookup)
