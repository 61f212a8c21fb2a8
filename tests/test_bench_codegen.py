"""benchmarks/codegen.py: the one place the benchmarks learn which code generators fxpooch has."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxpooch
from zoo import mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import codegen  # noqa: E402


def test_the_default_code_generator_is_always_there():
    assert codegen.available(codegen.CODEGENS[0])


def test_inductor_follows_the_compile_options():
    assert codegen.available("inductor") == ("codegen" in fxpooch.CompileOptions.__dataclass_fields__)


def test_an_unknown_code_generator_is_rejected():
    with pytest.raises(ValueError, match="pass one of"):
        codegen.available("triton")


def test_compile_with_the_default_runs_fxpooch():
    model, x = mlp()
    cm = codegen.compile_with("fx", model, (x,), "1TiB", profile="analytic", hardware="cpu")
    out = cm(x)
    assert isinstance(cm, fxpooch.CompiledModule)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
