"""What the distributed examples share: train fxpooch's model and the plain one side by side, then report.

Imported by ``examples/ddp.py`` and ``examples/fsdp.py`` (run from this folder's parent or by path:
Python puts the script's folder on ``sys.path``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpooch.report import summary_rows
from fxpooch.units import format_bytes


def parse_and_start(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser`` with the shared options (``--mem-limit``, ``--batch``, ``--steps``) parsed, and this
    rank's process group started: NCCL on its local GPU, or gloo on CPU threads shared by the ranks."""
    parser.add_argument("--mem-limit", default="60%", help="per rank, as fxpooch.compile takes it (default 60%%)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    return args


def train_side_by_side(trained: nn.Module, model: nn.Module, reference: nn.Module, tokens: torch.Tensor,
                       steps: int, baseline: str) -> tuple[dict[str, list[float]], int | None]:
    """``steps`` SGD steps of ``trained`` (fxpooch, updating ``model``'s parameters) and ``reference``
    (``baseline``), interleaved so both see the same machine load, then one more backward of each
    (gradients left in place to compare). Returns each side's step seconds and, on CUDA, the peak."""
    cuda = tokens.device.type == "cuda"

    def step(module: nn.Module, opt: torch.optim.Optimizer) -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        module(tokens).backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        opt.step()
        return seconds

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    times: dict[str, list[float]] = {"fxpooch": [], baseline: []}
    if cuda:
        torch.cuda.reset_peak_memory_stats(tokens.device)
    for _ in range(steps):
        times["fxpooch"].append(step(trained, opt))
        times[baseline].append(step(reference, ref_opt))
    peak = torch.cuda.max_memory_allocated(tokens.device) if cuda else None
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    trained(tokens).backward()  # both models took the same steps: their gradients must agree
    reference(tokens).backward()
    return times, peak


def report(title: str, plan, times: dict[str, list[float]], peak: int | None, diff: float, baseline: str) -> None:
    """Rank 0 prints ``plan``'s summary; every rank its limit, planned and measured peak, gradient difference."""
    rank = dist.get_rank()
    if rank == 0:
        rows = "\n".join(f"  {label:<27}{value}" for label, value in summary_rows(plan))
        print(f"{title}; the plan of rank 0 (print(plan) lists every activation):\n{rows}", flush=True)
    dist.barrier()
    measured = f"measured peak {format_bytes(peak)} (max_memory_allocated, both models resident)" \
        if peak is not None else "peak not measured on CPU"
    print(f"rank {rank}: limit {format_bytes(plan.mem_limit)}, planned peak {format_bytes(plan.peak_bytes)}, "
          f"{measured}; max |grad - {baseline} grad| = {diff:.2e}; median step "
          f"{statistics.median(times['fxpooch']) * 1e3:.1f} ms ({baseline} "
          f"{statistics.median(times[baseline]) * 1e3:.1f} ms)", flush=True)
