"""Long stages say what they do: a bar on a terminal, INFO logs otherwise; re-plans warn and count."""
from __future__ import annotations

import importlib
import logging

import pytest
import torch
from zoo import mlp

import fxpooch

progress = importlib.import_module("fxpooch.progress")


def _call_nodes(cm: fxpooch.CompiledModule) -> int:
    return sum(1 for gm in (*cm.forward_graphs, *cm.backward_graphs) for n in gm.graph.nodes
               if n.op == "call_function" and not str(n.target).startswith("fxpooch."))


@pytest.fixture
def every_stage_reports(monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # no stage is too short to report


def test_without_a_terminal_stages_log_with_counts(every_stage_reports, monkeypatch, caplog):
    monkeypatch.setattr(progress, "interactive", lambda: False)
    model, x = mlp()
    with caplog.at_level(logging.INFO, logger="fxpooch.progress"):
        cm = fxpooch.compile(model, x, "1GiB", profile="measure", profile_mode="per-node")
    lines = [r.getMessage() for r in caplog.records if r.name == "fxpooch.progress"]
    assert any(line.startswith("capturing the training step: done in") for line in lines), lines
    assert any(line.startswith("planning with local") and "done in" in line for line in lines), lines
    profiled = next(line for line in lines if line.startswith("profiling node by node: done in"))
    total = int(profiled.rsplit(" ", 2)[-2].split("/")[1])
    assert profiled.endswith(f", {total}/{total} nodes") and total >= _call_nodes(cm) > 0


def test_on_a_terminal_a_bar_counts_the_nodes(every_stage_reports, monkeypatch, capsys):
    monkeypatch.setattr(progress, "interactive", lambda: True)
    model, x = mlp()
    fxpooch.compile(model, x, "1GiB", profile="measure", profile_mode="per-node")
    err = capsys.readouterr().err
    bar = [frame for frame in err.split("\r") if frame.startswith("profiling node by node")]
    total = int(bar[0].split("/")[1].split()[0])
    assert any(f"{total}/{total}" in frame for frame in bar) and "capturing the training step" in err


def test_a_new_input_shape_warns_and_counts(caplog):
    model, x = mlp()
    cm = fxpooch.compile(model, x, "1GiB", profile="analytic", hardware="cpu")
    assert cm.replans == 0
    with caplog.at_level(logging.WARNING, logger="fxpooch"):
        for batch in (x[: x.shape[0] // 2], x):  # the first shape's plan is cached: no new plan for x
            cm(batch).sum().backward()
            model.zero_grad()  # gradients that already exist are another plan (accumulation)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name.startswith("fxpooch.")]
    assert cm.replans == 1 and len(warnings) == 1
    assert "planning again" in warnings[0] and "compiled.replans = 1" in warnings[0] and "pad" in warnings[0]


def test_a_failing_stage_stops_reporting(monkeypatch):
    monkeypatch.setattr(progress, "interactive", lambda: False)
    with pytest.raises(RuntimeError):
        with progress.stage("doomed") as s:
            raise RuntimeError("boom")
    assert not s._thread.is_alive()
    assert torch.is_grad_enabled()
