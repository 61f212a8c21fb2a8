"""``print(plan)`` and ``plan.explain(name)``: every activation, its decision and bytes, the totals,
and the what-if numbers behind keep / swap / recompute."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import zoo

import fxpooch
from fxpooch import report
from fxpooch.plan import activation_meta, activation_names, module_path
from fxpooch.units import format_bytes
from fxpooch.whatif import Overheads, WhatIf

HW = "v100-pcie3"


def _plan(planner: str, limit: int | str = "1TiB", factory=zoo.resnet_small) -> fxpooch.Plan:
    model, x = factory()
    return fxpooch.plan(model, x, limit, planner=planner, profile="analytic", hardware=HW)


@pytest.fixture(scope="module")
def kept() -> fxpooch.Plan:
    return _plan("pooch")  # a limit far above the in-core peak: everything kept


@pytest.fixture(scope="module")
def swapped() -> fxpooch.Plan:
    return _plan("swap-all")


@pytest.fixture(scope="module")
def recomputed() -> fxpooch.Plan:
    return _plan("checkpoint-all")


def _table_rows(text: str) -> dict[str, list[str]]:
    """Activation name -> the cells of its row (the table's second column is the name)."""
    rows = {}
    for line in text.split("\n\n")[0].splitlines()[2:]:
        cells = line.split()
        if len(cells) > 6 and cells[0].isdigit():
            rows[cells[1]] = cells
    return rows


@pytest.mark.parametrize("which", ["kept", "swapped", "recomputed"])
def test_every_activation_has_a_row_with_decision_and_bytes(which, request):
    plan = request.getfixturevalue(which)
    text = plan.table(fold=False)
    rows = _table_rows(text)
    names = activation_names(plan.graph)
    assert set(rows) == set(names)
    line_of = {line.split()[1]: line for line in text.splitlines() if len(line.split()) > 6}
    for name, act in zip(names, plan.graph.activations):
        assert plan.decisions[name] in rows[name]
        assert format_bytes(plan.graph.buffers[act.buffer].nbytes) in line_of[name]


def test_overhead_columns_and_r(swapped):
    text = str(swapped)
    header = text.splitlines()[0]
    for column in ("graph", "activation", "op", "shape", "dtype", "bytes", "decision", "stall", "late d2h",
                   "swap +", "recompute +", "r(X)"):
        assert column in header
    o = swapped.what_ifs.overheads(0)
    assert o.keep.step_time > 0 and o.swap is not None
    assert o.swap_overhead == pytest.approx(o.swap.step_time - o.keep.step_time)


def test_totals(swapped):
    text = str(swapped)
    totals = {line.split("  ")[0]: line for line in text.split("\n\n")[-1].splitlines()}
    assert format_bytes(swapped.mem_limit) in totals["memory limit"]
    assert format_bytes(swapped.peak_bytes) in totals["planned peak"]
    assert format_bytes(swapped.in_core_peak_bytes) in totals["in-core peak"]
    assert format_bytes(swapped.host_bytes) in totals["host bytes (swapped)"]
    assert swapped.host_bytes > 0
    c = swapped.counts()
    assert f"{c['keep']} / {c['swap']} / {c['recompute']}" in totals["keep / swap / recompute"]
    unit, scale = report.time_unit(swapped)
    assert f"{swapped.step_time * scale:.3f} {unit}" in totals["step time (simulated)"]
    assert f"{swapped.step_time / swapped.in_core_time:.2f}x in-core" in totals["step time (simulated)"]
    assert f"{swapped.in_core_time * scale:.3f} {unit}" in totals["in-core step time"]


def test_shape_and_dtype_from_activation_meta(kept):
    first = activation_names(kept.graph)[0]  # the stem convolution's output
    assert kept.activation_meta[0] == ((4, 16, 64, 64), "float32")
    row = _table_rows(str(kept))[first]
    assert "(4, 16, 64, 64)" in " ".join(row) and "float32" in row
    unknown = _table_rows(str(dataclasses.replace(kept, activation_meta=())))[first]
    assert "?" in unknown  # a plan built without metadata says so instead of guessing


def test_activation_meta_reads_node_values(kept):
    nodes = [SimpleNamespace(meta={"val": torch.empty(2, 3, dtype=torch.float16)}) for _ in kept.graph.ops]
    meta = activation_meta(kept.graph, SimpleNamespace(nodes=nodes))
    assert meta == tuple(((2, 3), "float16") for _ in kept.graph.activations)


def test_large_graphs_leave_out_the_overhead_columns(kept, monkeypatch):
    monkeypatch.setattr(report, "MAX_OVERHEAD_ACTIVATIONS", 3)
    fresh = dataclasses.replace(kept)
    text = str(fresh)
    assert "r(X)" not in text.splitlines()[0]
    assert "overhead columns left out" in text
    assert "explain" in text


def test_explain_keep(kept):
    name = activation_names(kept.graph)[0]
    assert kept.decisions[name] == "keep"
    text = kept.explain(name)
    assert text.startswith(f"{name} (graph 0, module 0): keep")  # the stem convolution, model[0]
    assert "if kept:" in text and "<- planned" in text.split("if kept:")[1].splitlines()[0]
    assert "why: kept" in text and "memory allowed keeping it" in text
    assert format_bytes(kept.graph.buffers[kept.graph.activations[0].buffer].nbytes) in text


def test_explain_swap(swapped):
    a = next(i for i, d in enumerate(swapped.schedule.decisions) if d.value == "swap")
    name = activation_names(swapped.graph)[a]
    text = swapped.explain(name)
    assert text.startswith(f"{name} (graph 0, module {swapped.module_of(a)}): swap")
    assert "swap is hidden" in text or "swap is not hidden" in text
    assert "stall" in text and "why: swapped" in text
    o = swapped.what_ifs.overheads(a)
    assert o.swap.step_time == pytest.approx(swapped.step_time, rel=0.05)


def test_explain_recompute(recomputed):
    a = next(i for i, d in enumerate(recomputed.schedule.decisions) if d.value == "recompute")
    name = activation_names(recomputed.graph)[a]
    text = recomputed.explain(name)
    assert text.startswith(f"{name} (graph 0, module {recomputed.module_of(a)}): recompute")
    assert "recompute runs" in text and "why: recomputed" in text
    assert recomputed.what_ifs.overheads(a).recompute is not None


def test_explain_unknown_name(kept):
    with pytest.raises(fxpooch.UnknownName) as info:
        kept.explain("no_such_activation")
    msg = str(info.value)
    assert "activation" in msg and "no_such_activation" in msg
    assert activation_names(kept.graph)[0] in msg
    assert isinstance(info.value, KeyError)


def test_rows_name_the_module_that_saved_each_activation(kept):
    model, _ = zoo.resnet_small()
    modules = dict(model.named_modules())
    assert len(kept.module_paths) == len(kept.graph.activations)
    assert all(path in modules for path in kept.module_paths)
    assert isinstance(modules[kept.module_paths[0]], torch.nn.Conv2d)  # the stem convolution
    rows = _table_rows(kept.table(fold=False))
    for name, path in zip(activation_names(kept.graph), kept.module_paths):
        assert rows[name][2] == path
    bn = [a for a, p in enumerate(kept.module_paths) if isinstance(modules[p], torch.nn.BatchNorm2d)]
    assert bn  # the batch-norm statistics are saved by their BatchNorm2d


@pytest.mark.parametrize("path, expected", [
    ("L['model'].layer1[0].bn1", "layer1.0.bn1"),
    ("L['self']._modules['layer1']._modules['0'].conv1", "layer1.0.conv1"),
    ("getattr(L['self'].layers, '3').mlp", "layers.3.mlp"),
    ("L['model']", ""),
])
def test_module_path_spellings(path, expected):
    assert module_path({"nn_module_stack": {"k0": ("L['model']", object), "k1": (path, object)}}) == expected
    assert module_path({}) == ""


def test_explain_accepts_a_module_path(kept):
    model, _ = zoo.resnet_small()
    bn_path = next(p for p, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d) and p in kept.module_paths)
    saved = [n for n, p in zip(activation_names(kept.graph), kept.module_paths) if p == bn_path]
    text = kept.explain(bn_path)
    assert text.startswith(f"module {bn_path} saves {len(saved)} activations: " + ", ".join(saved))
    for name in saved:
        assert f"{name} (graph 0, module {bn_path}): keep" in text
    single = kept.module_paths[0]
    assert kept.explain(single) == kept.explain(activation_names(kept.graph)[0])
    with pytest.raises(fxpooch.UnknownName, match="no.such.module"):
        kept.explain("no.such.module")


def test_small_activations_fold_into_one_line(kept):
    folded = report.folded(kept)
    sizes = [kept.graph.buffers[a.buffer].nbytes for a in kept.graph.activations]
    assert folded and all(sizes[a] < report.FOLD_BELOW_BYTES for a in folded)
    assert all(sizes[a] < max(sizes) * report.FOLD_FRACTION for a in folded)
    text = str(kept)
    rows = _table_rows(text)
    names = activation_names(kept.graph)
    assert set(rows) == {n for a, n in enumerate(names) if a not in folded}
    line = next(line for line in text.splitlines() if "small activations not listed" in line)
    total = format_bytes(sum(sizes[a] for a in folded))
    assert line.startswith(f"+ {len(folded)} small activations") and f"{total} in all" in line
    assert f"keep {len(folded)} / swap 0 / recompute 0" in line  # a limit above the in-core peak: all kept


def test_r_is_never_negative():
    keep = WhatIf(1.0, 10, True)
    faster = Overheads(keep, swap=WhatIf(1.5, 5, True), recompute=WhatIf(0.9, 5, True))
    assert faster.recompute_overhead < 0 and faster.r == 0.0  # recomputing is free here, not "-0.2"
    free = Overheads(keep, swap=WhatIf(0.9, 5, True), recompute=WhatIf(0.8, 5, True))
    assert report.format_r(free.r) == "-"  # neither costs anything: no ratio
    swap_free = Overheads(keep, swap=WhatIf(1.0, 5, True), recompute=WhatIf(1.2, 5, True))
    assert report.format_r(swap_free.r) == "inf"
