"""``python -m fxpooch``: plan / compare / demo, exit codes and messages, and the graph dumps."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpooch.__main__ import main
from fxpooch.debug import ENV_VAR, dump_graphs
from fxpooch.planners import PLANNERS
from fxpooch.units import format_bytes

REPO = Path(__file__).resolve().parent.parent
MLP = f"{REPO / 'tests' / 'zoo.py'}:mlp"
ANALYTIC = ["--hardware", "v100-pcie3"]


@pytest.fixture(autouse=True)
def _restore_logging():
    """``-v`` sets up the "fxpooch" logger in this process: put it back after each test."""
    logger = logging.getLogger("fxpooch")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _run(*argv: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxpooch", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("limit, words", [("lots", "cannot parse memory limit"), ("-1GiB", "must be at least 1 byte"),
                                          ("abc%", "percentage")])
def test_bad_mem_limit_exits_2_with_a_message(limit, words, capsys, tmp_path):
    assert main(["plan", MLP, f"--mem-limit={limit}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpooch: error: ") and words in err and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["plan", MLP, "--mem-limit", "1GiB", "--planner", "nope"], "unknown planner 'nope'"),
    (["plan", MLP, "--mem-limit", "1GiB", "--hardware", "tpu9"], "unknown hardware preset 'tpu9'"),
    (["plan", "no_such_model", "--mem-limit", "1GiB"], "unknown model 'no_such_model'"),
    (["plan", "no_such_module_xyz:build", "--mem-limit", "1GiB"], "cannot import model module"),
    (["plan", f"{REPO / 'tests' / 'zoo.py'}:nope", "--mem-limit", "1GiB"], "no callable 'nope'"),
    (["compare", MLP, "--mem-limit", "1GiB", "--profile", "missing.json"], "no such file"),
    (["plan", MLP, "--mem-limit", "1GiB", *ANALYTIC, "--explain", "9.nope"], "unknown activation or module '9.nope'"),
])
def test_unknown_names_exit_2(argv, words, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path)] if argv[0] == "plan" else [])]) == 2
    out, err = capsys.readouterr()
    assert words in err and "Traceback" not in err
    assert "planned peak" not in out  # the mistake is reported before the plan is printed


def test_infeasible_exits_3_naming_the_floor(tmp_path):
    r = _run("plan", MLP, "--mem-limit", "1MiB", *ANALYTIC, "--out", str(tmp_path))
    assert r.returncode == 3, r.stderr
    assert "smallest feasible limit is" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("fxpooch: error:") == 1


def test_plan_prints_the_plan_and_writes_trace_and_svg(tmp_path, capsys):
    profile = tmp_path / "mlp.profile.json"
    out = tmp_path / "out"
    argv = ["plan", MLP, "--mem-limit", "95%", *ANALYTIC, "--out", str(out)]
    # the first ReLU by its module path (model[1]): the module that saved activation "relu"
    assert main(["-v", *argv, "--save-profile", str(profile), "--explain", "1"]) == 0
    first = capsys.readouterr()
    assert "planned peak" in first.out and "relu (graph 0, module 1):" in first.out and "why:" in first.out
    assert "fxpooch." in first.err  # -v: INFO lines of the fxpooch loggers
    trace, svg = out / "mlp-local.trace.json", out / "mlp-local.svg"
    assert json.loads(trace.read_text())["traceEvents"]
    assert svg.read_text().startswith("<svg")
    assert f"wrote {trace}" in first.out and f"wrote {svg}" in first.out
    # the saved profile replans to the same table
    assert main(["plan", MLP, "--mem-limit", "95%", "--profile", str(profile), "--out", str(out)]) == 0
    again = capsys.readouterr().out
    table = first.out.split("\n\nrelu (graph 0, module 1)")[0]
    assert table.replace(f"saved the profile to {profile}\n", "") == again.split("\n\nwrote")[0]


def test_compare_lists_every_planner_and_failures(capsys, tmp_path):
    # transformer_block's forward reads module globals (math, F): the .py file must be importable by name
    model = f"{REPO / 'tests' / 'zoo.py'}:transformer_block"
    assert main(["compare", model, "--mem-limit", "80%", *ANALYTIC]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in PLANNERS}
    assert set(rows) == set(PLANNERS)
    assert "fails" in rows["in-core"]  # 80% of the in-core peak: keeping everything does not fit
    assert "fails" not in rows["pooch"] and "x" in rows["pooch"]


def test_demo_writes_trace_and_svg(tmp_path):
    r = _run("demo", "--steps", "1", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "-> OK" in r.stdout
    assert (tmp_path / "demo.trace.json").exists() and (tmp_path / "demo.svg").exists()
    assert f"wrote {tmp_path / 'demo.trace.json'}" in r.stdout
    if torch.cuda.is_available():
        return
    # without CUDA: what the run means, then the GPU preset's plan, where all three decisions appear
    assert "the same memory" in r.stdout and "saves nothing on this machine" in r.stdout
    gpu = r.stdout.split("planned for a GPU (v100-pcie3")[1]
    counts = dict(zip(("keep", "swap", "recompute"),
                      map(int, gpu.split("keep / swap / recompute")[1].splitlines()[0].split(" / "))))
    assert all(n > 0 for n in counts.values()), counts
    assert f"keep {counts['keep']}, swap {counts['swap']}, recompute {counts['recompute']}" in gpu
    svg = tmp_path / "demo-v100-pcie3.svg"
    assert svg.read_text().startswith("<svg") and f"wrote {svg}" in gpu
    assert "ordinary (not pinned: no CUDA)" in r.stdout


class _Pair:
    def __init__(self, scale: float):
        self.forward = fx.symbolic_trace(torch.nn.Linear(2, 2))
        self.backward = fx.symbolic_trace(lambda x: x * scale)


def test_dump_graphs(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert dump_graphs(0, _Pair(1.0), _Pair(2.0)) == []
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "dumps"))
    written = dump_graphs(1, _Pair(1.0), _Pair(2.0))
    names = sorted(p.name for p in written)
    assert names == sorted(f"g1-{ph}-{st}.py" for ph in ("forward", "backward") for st in ("before", "after"))
    text = (tmp_path / "dumps" / "g1-forward-after.py").read_text()
    assert "graph 1 forward, after" in text and "FX IR" in text


def test_cli_models_are_part_of_the_installed_package(tmp_path):
    """``plan resnet50`` reads fxpooch.models, which the package ships (with py.typed), not a checkout file."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "fxpooch").rglob("__init__.py")}
    assert set(config["packages"]) == packages | {"fxpooch.passes"}  # every package of the checkout ships
    assert "py.typed" in config["package-data"]["fxpooch"]
    assert (REPO / "fxpooch" / "py.typed").exists()
    r = subprocess.run([sys.executable, "-c", "import fxpooch.__main__ as m, fxpooch.models as z, sys; "
                        "print(z.__file__); m.load_model('resnet50', 2, None); "
                        "print(sorted(k for k in sys.modules if 'zoo' in k))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    models_file, zoo_modules = r.stdout.splitlines()
    assert Path(models_file).parent == REPO / "fxpooch" / "models" and zoo_modules == "[]"


# -- what a user types: limits, help, and mistakes caught before the slow steps ----------------
def test_limit_forms_mean_the_same_in_the_cli_and_the_api(tmp_path):
    """'95%' of the in-core peak, '16G' = 16 GiB and 'device' (the preset's memory on meta) in both."""
    import fxpooch
    from fxpooch.hardware import get_hardware
    from zoo import mlp

    model, x = mlp()
    api = {f: fxpooch.plan(model, x, f, profile="analytic", hardware="v100-pcie3") for f in ("95%", "16G")}
    assert api["95%"].mem_limit == int(api["95%"].in_core_peak_bytes * 0.95)
    assert api["16G"].mem_limit == 16 * 2**30
    for form, plan in api.items():
        r = _run("plan", MLP, "--mem-limit", form, *ANALYTIC, "--no-what-if", "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert f"memory limit               {format_bytes(plan.mem_limit)}" in r.stdout
    with torch.device("meta"):
        meta_model, meta_x = mlp()
    on_meta = fxpooch.plan(meta_model, meta_x, "device", hardware="v100-pcie3")
    assert on_meta.mem_limit == get_hardware("v100-pcie3").memory_bytes


def test_meta_plans_keep_the_margin_compile_keeps_on_that_card():
    import fxpooch
    from fxpooch.memory import Margin
    from zoo import mlp

    with torch.device("meta"):
        model, x = mlp()
    gpu = fxpooch.plan(model, x, "64MiB", hardware="v100-pcie3")
    assert gpu.margin_bytes == Margin.default_for("cuda").of(64 * 2**20) > 0
    assert gpu.peak_bytes <= 64 * 2**20 - gpu.margin_bytes
    assert fxpooch.plan(model, x, "64MiB", hardware="cpu").margin_bytes == 0  # a CPU run keeps none


def test_zoo_model_on_meta_keeps_the_margin_in_the_cli(tmp_path):
    from fxpooch.memory import Margin

    r = _run("plan", "resnet50", "--batch", "8", "--mem-limit", "1GiB", *ANALYTIC, "--no-what-if",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    margin = Margin.default_for("cuda").of(2**30)
    assert f"allocator margin           {format_bytes(margin)} (planned under {format_bytes(2**30 - margin)})" \
        in r.stdout


@pytest.mark.parametrize("kwargs, words", [
    ({"margin": "5x"}, "margin '5x'"),
    ({"host_pool_limit": "lots"}, "host_pool_limit 'lots'"),
    ({"profile": "typo.profile.json"}, "'typo.profile.json': no such file"),
])
def test_bad_options_name_the_option_before_anything_runs(kwargs, words):
    import fxpooch
    from zoo import mlp

    with torch.device("meta"):  # a profile path typo on meta used to fall back to analytic costs silently
        model, x = mlp()
    with pytest.raises(fxpooch.errors.FxpoochError) as info:
        fxpooch.plan(model, x, "1GiB", **{k: v for k, v in kwargs.items() if k != "host_pool_limit"}) \
            if "host_pool_limit" not in kwargs else fxpooch.compile(model, x, "1GiB", **kwargs)
    assert words in str(info.value) and "memory limit" not in str(info.value)


def test_margin_zero_means_no_margin():
    import fxpooch
    from zoo import mlp

    with torch.device("meta"):
        model, x = mlp()
    assert fxpooch.plan(model, x, "1GiB", hardware="v100-pcie3", margin=0).margin_bytes == 0


@pytest.mark.parametrize("argv, words", [
    (["plan", "resnet50", "--mem-limit", "50%", "--profile", "measure"], "--device cpu"),
    (["demo", "--fraction", "-1"], "not in (0, 1]"),
    (["demo", "--steps", "0"], "not a positive integer"),
    (["plan", "resnet50", "--mem-limit", "50%", "--batch", "0"], "not a positive integer"),
    (["compare", "resnet50", "--mem-limit", "50%", "--out", "x"], "unrecognized arguments: --out"),
])
def test_cli_mistakes_fail_at_once_with_exit_2(argv, words):
    r = _run(*argv, timeout=60)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_help_says_the_defaults():
    plan_help = _run("plan", "--help").stdout
    assert "default: h100-pcie5 for a model on meta or CUDA, cpu for one on CPU" in " ".join(plan_help.split())
    assert "'device'" in plan_help and "'16G'" not in plan_help or "8G" in plan_help
    demo_help = " ".join(_run("demo", "--help").stdout.split())
    assert "--steps STEPS training steps" in demo_help and "(default 3)" in demo_help


def test_compile_takes_a_share_of_each_shapes_in_core_peak_and_device_on_cpu():
    import fxpooch
    from fxpooch.limits import host_available_bytes
    from zoo import mlp

    model, x = mlp()
    cm = fxpooch.compile(model, x, "95%", profile="analytic", hardware="cpu")
    assert cm.plan.mem_limit == max(1, int(cm.plan.in_core_peak_bytes * 95 / 100))
    cm(x[: x.shape[0] // 2]).sum().backward()  # a new shape: 95% of its own in-core peak
    assert cm.plan.mem_limit == max(1, int(cm.plan.in_core_peak_bytes * 95 / 100))
    everything = fxpooch.plan(model, x, "device", profile="analytic", hardware="cpu").mem_limit
    assert abs(everything - host_available_bytes()) < everything // 4  # the host memory available, as it moves
