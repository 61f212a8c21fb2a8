"""Sharded data-parallel training with fxpooch and FSDP2 (fully_shard), on GPUs or on CPU (gloo).

    torchrun --nproc-per-node 2 examples/fsdp.py                       # 60 % of the in-core peak per rank
    torchrun --nproc-per-node 8 examples/fsdp.py --mem-limit 60GiB     # a limit in bytes per rank
    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp.py --steps 2   # the same, without torchrun

A GPT-like decoder laid out as fxpooch plans FSDP2: the embeddings, each transformer block and the
head with its loss are modules of their own, each sharded with ``fully_shard``, then the root; the
root's forward only passes tensors from one to the next (it runs outside dynamo, between FSDP's
hooks). Every rank plans its own step under ``--mem-limit`` (per rank: its parameter and gradient
shards, FSDP's gathered parameters, its batch and activations), trains a few steps next to a plain
FSDP2 copy of the model and prints, per rank, the largest gradient difference to plain FSDP2, the
peak (``torch.cuda.max_memory_allocated`` on a GPU, both models resident; on a CPU only the plan's
figure: tests/test_fsdp.py measures it there) and the step times of both.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import fxpooch
from fxpooch.models import GPTBlock
from side_by_side import parse_and_start, report, train_side_by_side


class Embeddings(nn.Module):
    def __init__(self, vocab: int, seq: int, d_model: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.size(1), device=tokens.device))


class HeadWithLoss(nn.Module):
    """The final norm, the LM head and the loss in one module, so the logits are planned too."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Decoder(nn.Module):
    def __init__(self, n_layer: int = 4, d_model: int = 256, n_head: int = 4, seq: int = 128, vocab: int = 4096):
        super().__init__()
        self.embed = Embeddings(vocab, seq, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_head, seq, 0.0, False) for _ in range(n_layer))
        self.head = HeadWithLoss(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        return self.head(x, tokens[:, 1:])


def shard(model: Decoder) -> Decoder:
    """fully_shard on each block (the embeddings and the head are blocks too), then on the root."""
    for module in [model.embed, *model.blocks, model.head]:
        fully_shard(module)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_and_start(parser)
    cuda = torch.cuda.is_available()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = Decoder().to(device)
    reference = shard(copy.deepcopy(model))
    model = shard(model)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own batch
    tokens = torch.randint(0, 4096, (args.batch, 129), generator=generator).to(device)

    compiled = fxpooch.compile(model, tokens, args.mem_limit)

    times, peak = train_side_by_side(compiled, model, reference, tokens, args.steps, "plain FSDP2")
    diff = max((p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
    report(f"FSDP2 on {world} rank(s), {device.type}", compiled.plan, times, peak, diff, "plain FSDP2")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
