"""The README's main job: plan, rewrite and run a real model within a limit, checked against eager.

On a machine without CUDA the run is real but its "device" is host memory, so it shows the mechanics
(rewritten graphs, copies, gradients equal to eager), not a saving; the demo then also plans the same
model for a GPU preset from analytic costs, where keeping, swapping and recomputing all appear.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from .errors import InvalidMemoryLimit, UnsupportedModel
from .api import compile, plan
from .hardware import get_hardware
from .plan import Plan
from .report import summary_rows
from .svg import memory_svg
from .trace import write_chrome_trace
from .units import format_bytes

log = logging.getLogger("fxpooch.demo")


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


def demo_model(channels: int = 32, blocks: int = 4, classes: int = 10) -> nn.Module:
    """A small ResNet: stem, ``blocks`` residual blocks, pooling and a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
        *[Block(channels) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


#: the GPU the demo also plans for when it runs without CUDA (the PoocH paper's V100 over PCIe 3)
GPU_PRESET = "v100-pcie3"
#: relative gradient difference to eager above which the demo reports a mismatch (fp32 reduction order)
GRAD_TOLERANCE = 1e-4

CPU_NOTE = """\
This machine has no CUDA device, so the run below is on the CPU, where the "device" and the host are
the same memory: a swap copies an activation from RAM to RAM and saves nothing on this machine. The
run checks the mechanics -- the rewritten graphs, their copies and recomputations, and gradients
equal to eager -- on costs measured here (copies are plain memcpys, cheap next to the convolutions,
so the planner mostly swaps). What the plan looks like on a GPU follows after the run."""


def _write_pictures(plan: Plan, out_dir: str | os.PathLike | None, stem: str) -> str:
    if out_dir is None:
        return ""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    trace = write_chrome_trace(plan, folder / f"{stem}.trace.json")
    svg = folder / f"{stem}.svg"
    memory_svg(plan, svg)
    return f"wrote {trace} (open it in https://ui.perfetto.dev)\nwrote {svg} (memory over the step)"


def gpu_preset_plan(fraction: float, batch: int, size: int, preset: str = GPU_PRESET) -> Plan:
    """The demo model's plan for ``preset`` at ``fraction`` of its in-core peak, on the meta device
    (analytic costs, no memory used), with the allocator margin ``compile`` would keep on that GPU."""
    with torch.device("meta"):
        model = demo_model()
        x = torch.randn(batch, 3, size, size)
    return plan(model, x, f"{fraction * 100:g}%", hardware=preset)


def _train_and_compare(cm: torch.nn.Module, model: nn.Module, reference: nn.Module, x: torch.Tensor,
                       target: torch.Tensor, steps: int) -> float:
    """``steps`` SGD steps of ``cm`` and of the eager ``reference``; the largest relative gradient difference."""
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        for m, o in ((cm, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.manual_seed(step)
            loss_fn(m(x), target).backward()
        worst = max(worst, max((p.grad - r.grad).abs().max().item() / (r.grad.abs().max().item() or 1.0)
                               for p, r in zip(model.parameters(), reference.parameters())))
        opt.step()
        ref_opt.step()
    return worst


def run_demo(fraction: float = 0.5, batch: int = 16, size: int = 64, steps: int = 3,
             device: str | None = None, out_dir: str | os.PathLike | None = "fxpooch-out",
             gpu_preset: str = GPU_PRESET) -> int:
    """Train ``steps`` steps within ``fraction`` of the in-core peak; 0 if gradients match eager.

    With ``out_dir``, the plan's Chrome trace and memory SVG are written there. Without CUDA, the
    plan for ``gpu_preset`` (analytic costs) is shown and drawn too.
    """
    if not 0 < fraction <= 1:
        raise InvalidMemoryLimit(f"fraction {fraction!r}: the limit is this share of the in-core peak, in (0, 1]")
    if steps < 1:
        raise ValueError(f"steps {steps!r}: run at least one training step")
    get_hardware(gpu_preset)  # an unknown preset fails before the run
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModel("--device cuda was asked for, but this torch sees no CUDA device "
                               "(torch.cuda.is_available() is False); run with --device cpu")
    on_gpu = dev.type == "cuda"
    if not on_gpu:
        print(CPU_NOTE + "\n")
    torch.manual_seed(0)
    model = demo_model().to(dev)
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 3, size, size, device=dev)
    target = torch.randint(0, 10, (batch,), device=dev)

    # the probe measures the step once; the plan below reuses its profile (same graphs)
    room = torch.cuda.get_device_properties(dev).total_memory if on_gpu else 2**40
    probe = plan(model, x, room, planner="in-core", profile="measure")
    in_core = probe.in_core_peak_bytes
    limit = int(in_core * fraction)
    print(f"device: {dev}; in-core peak of one step: {format_bytes(in_core)}; limit: {format_bytes(limit)}")
    t0 = time.perf_counter()
    cm = compile(model, x, limit, profile=probe.profile)
    print(f"planned in {time.perf_counter() - t0:.1f} s\n")
    print(cm.plan if on_gpu else "the plan on this machine (print(compiled.plan) lists every activation):\n"
          + "\n".join(f"  {k:26} {v}" for k, v in summary_rows(cm.plan)))
    written = _write_pictures(cm.plan, out_dir, "demo")
    if written:
        print("\n" + written)

    worst = _train_and_compare(cm, model, reference, x, target, steps)
    ok = worst <= GRAD_TOLERANCE
    print(f"\n{steps} training steps; largest gradient difference vs eager (relative): {worst:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    pinned = "pinned" if cm.host_pool.pinned_bytes else "ordinary (not pinned: no CUDA)"
    print(f"host memory held for swapped activations (reused every step): {format_bytes(cm.host_pool_bytes)}, "
          f"{pinned}")
    print("rewritten graphs: compiled.forward_graphs[0].print_readable(), compiled.backward_graphs[0]...")

    if not on_gpu:
        gpu = gpu_preset_plan(fraction, batch, size, gpu_preset)
        c = gpu.counts()
        print(f"\n-- the same model and batch planned for a GPU ({gpu_preset}, analytic costs, meta device) --\n"
              f"limit {fraction:.0%} of its in-core peak: keep {c['keep']}, swap {c['swap']}, recompute "
              f"{c['recompute']}; step {gpu.step_time / gpu.in_core_time:.2f}x in-core. On a GPU a copy over the "
              "link costs time the compute may not hide, so the planner swaps what it can hide and recomputes "
              "what is cheap to rebuild.\n")
        print(gpu)
        written = _write_pictures(gpu, out_dir, f"demo-{gpu_preset}")
        if written:
            print("\n" + written)
    return 0 if ok else 1
