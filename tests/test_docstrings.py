"""The examples in the package's docstrings run and print what they show."""
import doctest
import importlib
import pathlib

import pytest

import fxpooch

ROOT = pathlib.Path(fxpooch.__file__).parent
WITH_EXAMPLES = sorted(
    "fxpooch." + ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in ROOT.rglob("*.py") if ">>> " in p.read_text())


def test_the_package_has_examples():
    assert "fxpooch.planners.cutbound" in WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
