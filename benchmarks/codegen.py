"""Where fxpooch's code generators plug into the benchmarks: the one place that knows them.

fxpooch runs its rewritten graphs op by op (``"fx"``). A build whose ``CompileOptions`` has a
``codegen`` field can also have inductor compile them (``"inductor"``); on a build without it
that row of a benchmark is reported "n/a".
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

import fxpooch

#: every code generator a benchmark compares, the default first
CODEGENS = ("fx", "inductor")
NOT_AVAILABLE = "n/a (this fxpooch has no codegen option)"


def available(codegen: str) -> bool:
    """Whether this fxpooch can run ``codegen`` (``"fx"`` always can)."""
    if codegen not in CODEGENS:
        raise ValueError(f"codegen={codegen!r}: pass one of {CODEGENS}")
    return codegen == CODEGENS[0] or "codegen" in fxpooch.CompileOptions.__dataclass_fields__


def compile_with(codegen: str, model: nn.Module, inputs: tuple, mem_limit: int | str, **options: Any
                 ) -> fxpooch.CompiledModule:
    """``fxpooch.compile`` with ``codegen`` (check :func:`available` first)."""
    if not available(codegen):
        raise RuntimeError(f"codegen={codegen!r}: {NOT_AVAILABLE}")
    if "codegen" in fxpooch.CompileOptions.__dataclass_fields__:
        options["codegen"] = codegen
    return fxpooch.compile(model, inputs, mem_limit, **options)
