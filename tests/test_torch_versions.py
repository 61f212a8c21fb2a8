"""The torch releases fxpooch is tested with: pyproject.toml requires them, and importing fxpooch
with another one warns, saying what to install."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxpooch._torch_compat import TESTED_TORCH, untested_torch

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "pip install 'torch>=2.11,<2.14'"


@pytest.mark.parametrize("version, tested", [
    ("2.11.0", True), ("2.12.1", True), ("2.13.0+cpu", True), ("2.13.1+cu128", True),
    ("2.10.2", False), ("2.14.1", False), ("2.15.0.dev20261101+cpu", False), ("3.0.0", False),
])
def test_untested_torch_names_the_tested_releases(version, tested):
    message = untested_torch(version)
    if tested:
        assert message is None
    else:
        assert f"tested with torch 2.11 to 2.13, not {version}" in message and INSTALL in message


def test_a_version_naming_no_release_is_not_compared():
    assert untested_torch("unknown") is None  # no warning, and no failed import


def test_pyproject_requires_the_tested_releases():
    text = (ROOT / "pyproject.toml").read_text()
    (low, high), = re.findall(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text)
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    assert (low, high) == (f"{lo_major}.{lo_minor}", f"{hi_major}.{hi_minor + 1}")


@pytest.mark.parametrize("version, warns", [("2.14.1", True), ("2.12.0", False)])
def test_importing_with_an_untested_torch_warns_once(version, warns):
    code = ("import json, warnings, torch\n"
            f"torch.__version__ = {version!r}\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import fxpooch\n"
            "print(json.dumps([str(w.message) for w in seen if w.category is fxpooch.UntestedTorchWarning]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    found = json.loads(out.strip().splitlines()[-1])
    if warns:
        assert len(found) == 1 and INSTALL in found[0]
    else:
        assert found == []
