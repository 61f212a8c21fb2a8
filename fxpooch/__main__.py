"""``python -m fxpooch``: plan a model from the command line, compare planners, or run the demo.

    python -m fxpooch plan resnet50 --batch 64 --mem-limit 8GiB --hardware v100-pcie3
    python -m fxpooch plan mypkg.models:build --mem-limit 60%
    python -m fxpooch compare resnet50 --mem-limit 60%
    python -m fxpooch demo

Exit codes: 0 ok, 2 bad arguments (memory limit, planner, preset, model, profile), 3 no plan
fits the memory limit (the message names the smallest limit that does).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from .errors import FxpoochError, InfeasibleMemoryLimit, UnknownName
from .progress import stage
from .units import parse_limit

log = logging.getLogger("fxpooch.cli")

EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
DEFAULT_OUT = "fxpooch-out"


class CliError(Exception):
    """A user mistake on the command line: message on stderr, exit code 2."""


# -- models ------------------------------------------------------------------------------------
def _import_module(ref: str) -> Any:
    if ref.endswith(".py") or os.sep in ref or "/" in ref:
        path = Path(ref)
        if not path.exists():
            raise CliError(f"model module {ref!r}: no such file")
        name = f"fxpooch_user_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dynamo looks the module's globals up by name
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(ref)
    except ImportError as e:
        raise CliError(f"cannot import model module {ref!r}: {e}") from None


def load_model(ref: str, batch: int | None, device: str | None) -> tuple[Any, Any, str]:
    """``ref`` (a model of :mod:`fxpooch.models` or ``module:factory``) -> (model, example input, label).

    A factory returns ``(model, example_input)`` or a model; in the latter case the module must
    define ``example_input(batch)`` (or ``example_input()``). ``batch`` is passed to the factory
    when it has a ``batch`` parameter. ``device`` "meta" builds the model on the meta device.
    """
    import torch

    if ":" not in ref:
        from .models import MODELS

        if ref not in MODELS:
            raise UnknownName("model", ref, list(MODELS) + ["<module>:<factory>"])
        spec = MODELS[ref]
        dev = torch.device(device or "meta")
        with torch.device(dev):
            model = spec.build()
        return model, spec.make_input(batch, device=dev), ref
    module_ref, _, attr = ref.rpartition(":")
    module = _import_module(module_ref)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"{ref!r}: {module_ref} has no callable {attr!r}")
    kwargs = {}
    if batch is not None:
        if "batch" not in inspect.signature(factory).parameters:
            raise CliError(f"--batch {batch}: {attr}() has no 'batch' parameter")
        kwargs["batch"] = batch
    if device:
        with torch.device(device):
            built = factory(**kwargs)
    else:
        built = factory(**kwargs)
    if isinstance(built, tuple) and len(built) == 2:
        model, example = built
    else:
        model, make = built, getattr(module, "example_input", None)
        if make is None:
            raise CliError(f"{ref!r} returned a model only: return (model, example_input) or define "
                           f"example_input(batch) in {module_ref}")
        if not callable(make):
            example = make
        elif "batch" in inspect.signature(make).parameters:
            example = make(batch=batch) if batch is not None else make()
        else:
            example = make()
        if device:
            example = example.to(device)
    return model, example, attr


# -- planning ----------------------------------------------------------------------------------
def resolve_cli_limit(args: argparse.Namespace, base: Any) -> int:
    """``--mem-limit`` in bytes: as ``fxpooch.compile`` reads it (see ``fxpooch.units.parse_limit``),
    "60%" of ``base``'s in-core peak, "device" of the device the model is built on (meta: the preset)."""
    from .limits import resolve_limit
    from .units import InCoreShare

    limit = resolve_limit(args.mem_limit, base.device, args.hardware)
    return limit.of(base.plan.in_core_peak_bytes) if isinstance(limit, InCoreShare) else limit


def _profile_arg(args: argparse.Namespace) -> Any:
    from .profile import Profile

    if args.profile == "measure" and args.device in (None, "meta") and ":" not in args.model:
        raise CliError(f"--profile measure times each op on a real device, but {args.model} is built on the meta "
                       "device (no memory, no timing): add --device cpu (or cuda), or use analytic costs")
    if args.profile in ("analytic", "measure"):
        return args.profile
    if not os.path.exists(args.profile):
        raise CliError(f"--profile {args.profile!r}: no such file (or pass 'analytic' / 'measure')")
    try:
        return Profile.load(args.profile)
    except (OSError, ValueError) as e:  # InvalidProfile is a ValueError too
        raise CliError(f"--profile {args.profile!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Base:
    """One capture and profile of the model, reused by every planner: its in-core (or
    checkpoint-all) plan, the device the model was built on, and the allocator margin there."""

    plan: Any
    device: Any
    margin: Any


def in_core_plan(args: argparse.Namespace) -> tuple[Base, str]:
    """Capture and profile the model once: the base plan whose graph and costs every planner reuses.

    Its in-core numbers do not depend on the planner. On a CUDA device the limit may not exceed
    the device's memory, so a model that does not fit in-core there is based on checkpoint-all.
    """
    import fxpooch
    import torch

    from .hardware import get_hardware
    from .limits import default_margin
    from .units import MAX_BYTES

    if args.hardware:
        get_hardware(args.hardware)  # unknown preset: fail before the slow steps
    profile = _profile_arg(args)
    with stage(f"building {args.model}"):
        model, example, label = load_model(args.model, args.batch, args.device)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    limit = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else MAX_BYTES
    try:
        base = fxpooch.plan(model, example, limit, planner="in-core", profile=profile, hardware=args.hardware)
    except InfeasibleMemoryLimit:
        base = fxpooch.plan(model, example, limit, planner="checkpoint-all", profile=profile, hardware=args.hardware)
    return Base(base, device, default_margin(device, args.hardware)), label


def write_outputs(plan: Any, out_dir: str | os.PathLike, stem: str) -> tuple[Path, Path]:
    """The Chrome trace and the memory SVG of ``plan`` under ``out_dir``."""
    from .svg import memory_svg
    from .trace import write_chrome_trace

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)
    trace, svg = folder / f"{stem}.trace.json", folder / f"{stem}.svg"
    write_chrome_trace(plan, trace)
    memory_svg(plan, svg)
    return trace, svg


def cmd_plan(args: argparse.Namespace) -> int:
    from .pipeline import replan
    from .planners import get_planner

    get_planner(args.planner)
    parse_limit(args.mem_limit)  # a malformed limit fails before the slow steps
    base, label = in_core_plan(args)
    limit = resolve_cli_limit(args, base)
    with stage(f"planning {label} with {args.planner}"):
        plan = replan(base.plan, planner=args.planner, mem_limit=limit, margin=base.margin)
    for name in args.explain or ():
        plan.indices(name)  # an unknown name fails before the table
    if args.save_profile:
        plan.profile.save(args.save_profile)
        print(f"saved the profile to {args.save_profile}")
    text = plan.table(overheads=False if args.no_what_if else None, fold=not args.all_rows)
    print(text)
    for name in args.explain or ():
        print()
        print(plan.explain(name))
    trace, svg = write_outputs(plan, args.out, f"{label}-{args.planner}")
    print(f"\nwrote {trace} (open it in https://ui.perfetto.dev)\nwrote {svg}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from .pipeline import replan
    from .planners import PLANNERS
    from .units import format_bytes

    parse_limit(args.mem_limit)
    base, label = in_core_plan(args)
    limit = resolve_cli_limit(args, base)
    core = base.plan
    print(f"{label}: limit {format_bytes(limit)}, in-core peak {format_bytes(core.in_core_peak_bytes)}, "
          f"in-core step {core.in_core_time * 1e3:.3f} ms ({core.profile.source})\n")
    rows, infeasible, ok = [], 0, 0
    for name in PLANNERS:
        t0 = time.perf_counter()
        try:
            with stage(f"planning with {name}"):
                p = replan(base.plan, planner=name, mem_limit=limit, margin=base.margin)
        except Exception as e:  # one planner failing must not end the comparison
            infeasible += isinstance(e, InfeasibleMemoryLimit)
            if isinstance(e, InfeasibleMemoryLimit):
                note = f"needs >= {format_bytes(e.min_feasible_bytes)}"
            elif isinstance(e, FxpoochError):
                note = str(e).split(". ")[0]
            else:
                note = f"{type(e).__name__}: {e}"
                log.warning("planner %s raised", name, exc_info=True)
            rows.append([name, "fails", "", "", "", f"{time.perf_counter() - t0:.2f}", note])
            continue
        ok += 1
        c = p.counts()
        rows.append([name, f"{p.step_time * 1e3:.3f}", f"{p.step_time / core.in_core_time:.2f}x",
                     format_bytes(p.peak_bytes), f"{c['keep']} / {c['swap']} / {c['recompute']}",
                     f"{time.perf_counter() - t0:.2f}", ""])
    print(tabulate(rows, headers=["planner", "step ms", "vs in-core", "peak", "keep / swap / recompute",
                                  "plan s", "note"], disable_numparse=True))
    if ok == 0:
        return EXIT_INFEASIBLE if infeasible else EXIT_USAGE
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(fraction=args.fraction, steps=args.steps, device=args.device, out_dir=args.out,
                    gpu_preset=args.gpu_preset)


# -- entry point -------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]: the limit is this share of the in-core peak")
    return value


def _parser() -> argparse.ArgumentParser:
    from .hardware import PRESETS
    from .planners import PLANNERS

    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what each stage does (INFO for the 'fxpooch' loggers)")
    head, _, tail = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog="fxpooch", description=head.replace("``", ""), epilog=tail,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[verbose])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", parents=[verbose], help="plan, rewrite and run a small ResNet within half its memory")
    demo.add_argument("--fraction", type=_fraction, default=0.5,
                      help="memory limit as a fraction of the in-core peak, in (0, 1] (default 0.5)")
    demo.add_argument("--steps", type=_positive_int, default=3,
                      help="training steps run next to an eager copy, gradients compared after each (default 3)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--gpu-preset", default="v100-pcie3", metavar="PRESET",
                      help="without CUDA, also plan the model for this GPU preset from analytic costs "
                           "(default v100-pcie3)")
    demo.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the trace and the SVG (default {DEFAULT_OUT})")

    for name, helptext in (("plan", "plan one model: print the plan, write its trace and memory SVG"),
                           ("compare", "every registered planner on one model, side by side")):
        p = sub.add_parser(name, parents=[verbose], help=helptext)
        p.add_argument("model", help="a model of fxpooch.models (resnet50, gpt2, ...) or module:factory "
                                     "(a module name or a .py path; the factory returns (model, example_input))")
        p.add_argument("--mem-limit", required=True,
                       help="bytes ('8GiB' = 8*2^30, '8GB' = 8*10^9, '8G' = 8GiB), a percentage of the in-core peak "
                            "('60%%'), or 'device' (all the device has; on meta, the --hardware preset's memory)")
        p.add_argument("--batch", type=_positive_int, default=None, help="batch size (the model's default if left out)")
        p.add_argument("--hardware", default=None, metavar="PRESET",
                       help=f"hardware the plan is for, for analytic costs and 'device': one of {', '.join(PRESETS)} "
                            "(default: h100-pcie5 for a model on meta or CUDA, cpu for one on CPU)")
        p.add_argument("--profile", default="analytic",
                       help="'analytic' (default: costs from the --hardware preset), 'measure' (time each op; needs "
                            "--device cpu or cuda) or a profile .json saved by --save-profile")
        p.add_argument("--device", default=None,
                       help="device to build the model on (default: meta for fxpooch.models, planned without memory)")
        if name == "plan":
            p.add_argument("--out", default=DEFAULT_OUT,
                           help=f"folder for the trace and the SVG (default {DEFAULT_OUT})")
            p.add_argument("--planner", default="local", help=f"one of {', '.join(PLANNERS)} (default local)")
            p.add_argument("--save-profile", metavar="FILE", help="save the profile (JSON) to replan deterministically")
            p.add_argument("--explain", action="append", metavar="NAME",
                           help="explain the decision of one activation (its name in the table) or of the activations "
                                "one module saved (its path, e.g. layer1.0.bn1); may be repeated")
            p.add_argument("--all-rows", action="store_true",
                           help="list every activation (by default the small ones are summed up in one line)")
            p.add_argument("--no-what-if", action="store_true",
                           help="leave the swap / recompute overhead columns out (2 simulations per activation)")
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (tests replace it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _configure_logging(verbose: bool) -> None:
    """Warnings and the progress of long stages (``fxpooch.progress``) of the "fxpooch" loggers on
    stderr; ``-v``: every INFO record of them (other libraries' logging untouched)."""
    logger = logging.getLogger("fxpooch")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logging.getLogger("fxpooch.progress").setLevel(logging.INFO)
    if verbose:
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse itself exits 2 on malformed arguments)."""
    args = _parser().parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    command = {"plan": cmd_plan, "compare": cmd_compare, "demo": cmd_demo}[args.command]
    try:
        return command(args)
    except InfeasibleMemoryLimit as e:
        print(f"fxpooch: error: {e}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (FxpoochError, CliError) as e:
        print(f"fxpooch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fxpooch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
