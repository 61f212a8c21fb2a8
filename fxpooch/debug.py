"""Debug helpers: dump the captured graphs before and after the rewrite.

Set ``FXPOOCH_DUMP_GRAPHS=<dir>`` and every graph pair that a plan binds is written there as
readable Python (``print_readable``) plus FX IR, before and after rewriting::

    <dir>/g0-forward-before.py   <dir>/g0-forward-after.py
    <dir>/g0-backward-before.py  <dir>/g0-backward-after.py

Without the variable :func:`dump_graphs` does nothing.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

import torch.fx as fx

log = logging.getLogger("fxpooch.debug")

ENV_VAR = "FXPOOCH_DUMP_GRAPHS"


class _PairLike(Protocol):
    forward: fx.GraphModule
    backward: fx.GraphModule


def dump_dir() -> Path | None:
    """The folder named by ``FXPOOCH_DUMP_GRAPHS``, or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    return Path(value) if value else None


def _render(gm: fx.GraphModule, title: str) -> str:
    try:
        code = gm.print_readable(print_output=False)
    except Exception as e:  # a graph that cannot be rendered must not break a run
        code = f"# print_readable failed: {e}"
    ir = "\n".join(f"# {line}" for line in str(gm.graph).splitlines())
    return f"# {title}\n{code}\n\n# FX IR\n{ir}\n"


def dump_graphs(index: int, original: _PairLike, rewritten: _PairLike | None = None,
                directory: str | os.PathLike | None = None) -> list[Path]:
    """Write graph pair ``index`` before (``original``) and after (``rewritten``) the rewrite.

    ``directory`` defaults to ``$FXPOOCH_DUMP_GRAPHS``; with neither, nothing is written.
    Returns the files written. Errors writing are logged, never raised.
    """
    folder = Path(directory) if directory is not None else dump_dir()
    if folder is None:
        return []
    written: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        stages = [("before", original)] + ([("after", rewritten)] if rewritten is not None else [])
        for stage, pair in stages:
            for phase in ("forward", "backward"):
                path = folder / f"g{index}-{phase}-{stage}.py"
                path.write_text(_render(getattr(pair, phase), f"graph {index} {phase}, {stage} the fxpooch rewrite"))
                written.append(path)
    except OSError as e:
        log.warning("%s=%s: cannot write graph dumps: %s", ENV_VAR, folder, e)
        return written
    log.info("dumped graph pair %d to %s (%d files)", index, folder, len(written))
    return written
