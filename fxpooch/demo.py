"""The README's main job: plan, rewrite and run a real model within a limit, checked against eager."""
from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from .errors import UnsupportedModel
from .api import compile, plan
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


def run_demo(fraction: float = 0.5, batch: int = 16, size: int = 64, steps: int = 3,
             device: str | None = None, out_dir: str | os.PathLike | None = "fxpooch-out") -> int:
    """Train ``steps`` steps within ``fraction`` of the in-core peak; 0 if gradients match eager.

    With ``out_dir``, the plan's Chrome trace and memory SVG are written there.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModel("--device cuda was asked for, but this torch sees no CUDA device "
                               "(torch.cuda.is_available() is False); run with --device cpu")
    torch.manual_seed(0)
    model = demo_model().to(dev)
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 3, size, size, device=dev)
    target = torch.randint(0, 10, (batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    # the probe measures the step once; the plan below reuses its profile (same graphs)
    room = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 2**40
    probe = plan(model, x, room, planner="in-core", profile="measure")
    in_core = probe.in_core_peak_bytes
    limit = int(in_core * fraction)
    print(f"device: {dev}; in-core peak of one step: {format_bytes(in_core)}; limit: {format_bytes(limit)}")
    t0 = time.perf_counter()
    cm = compile(model, x, limit, profile=probe.profile)
    print(f"planned in {time.perf_counter() - t0:.1f} s\n")
    print(cm.plan)
    if out_dir is not None:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        trace = write_chrome_trace(cm.plan, folder / "demo.trace.json")
        svg = folder / "demo.svg"
        memory_svg(cm.plan, svg)
        print(f"\nwrote {trace} (open it in https://ui.perfetto.dev)\nwrote {svg} (memory over the step)")

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
    ok = worst <= 1e-4
    print(f"\n{steps} training steps; largest gradient difference vs eager (relative): {worst:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    print(f"host memory held for swapped activations (reused every step): {format_bytes(cm.host_pool_bytes)}")
    print("rewritten graphs: compiled.forward_graphs[0].print_readable(), compiled.backward_graphs[0]...")
    return 0 if ok else 1
