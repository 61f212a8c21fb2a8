"""Data-parallel training with fxpooch and DistributedDataParallel, on GPUs or on CPU (gloo).

    torchrun --nproc-per-node 2 examples/ddp.py                        # DDP(fxpooch.compile(model))
    torchrun --nproc-per-node 2 examples/ddp.py --order compile-ddp    # fxpooch.compile(DDP(model))
    torchrun --nproc-per-node 1 examples/ddp.py --mem-limit 2GiB       # one GPU, the same code path
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/ddp.py --mem-limit 60GiB                              # several nodes

With CUDA each rank uses the GPU of its local rank and NCCL; without, the CPU and gloo. Every rank
plans its own step under ``--mem-limit`` (the limit is per rank: parameters, DDP's gradient
buckets, gradients, the rank's inputs and its activations), trains a few steps next to a plain DDP
copy of the model and prints, per rank, the largest gradient difference to plain DDP, the peak
(measured with ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU only the plan's figure is
shown: tests/test_distributed.py measures it there) and the step times of both.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxpooch
from fxpooch.models import gpt_decoder
from side_by_side import parse_and_start, report, train_side_by_side


class WithLoss(nn.Module):
    """The model and its loss in one module, so the plan covers the loss too (README: training-loop contract)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=["ddp-compile", "compile-ddp"], default="ddp-compile",
                        help="ddp-compile: DDP(fxpooch.compile(model)); compile-ddp: fxpooch.compile(DDP(model))")
    args = parse_and_start(parser)
    cuda = torch.cuda.is_available()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = WithLoss(gpt_decoder(n_layer=4, d_model=256, n_head=4, seq=128, vocab=4096, dropout=0.0)).to(device)
    reference = DDP(copy.deepcopy(model), device_ids=[device.index] if cuda else None)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
    tokens = torch.randint(0, 4096, (args.batch, 129), generator=generator).to(device)
    ids = [device.index] if cuda else None

    if args.order == "ddp-compile":
        compiled = fxpooch.compile(model, tokens, args.mem_limit)
        trained = DDP(compiled, device_ids=ids)
    else:
        trained = compiled = fxpooch.compile(DDP(model, device_ids=ids), tokens, args.mem_limit)

    times, peak = train_side_by_side(trained, model, reference, tokens, args.steps, "plain DDP")
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    report(f"{args.order} on {world} rank(s), {device.type}", compiled.plan, times, peak, diff, "plain DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
