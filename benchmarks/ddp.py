"""Step time of fxpooch under DistributedDataParallel next to plain DDP, two ranks on this machine.

    python benchmarks/ddp.py                 # CPU/gloo (or one GPU per rank with NCCL when there are 2)
    python benchmarks/ddp.py --rounds 7      # more interleaved rounds

Every variant trains the same small GPT (fxpooch.models.gpt_decoder) on the same per-rank batches;
the variants take turns, one step each per round, so they share the machine's load, and the median
per-step time of each is reported with its ratio to plain DDP (eager). Variants:

* plain DDP: ``DDP(model)``, eager; DDP overlaps each bucket's all-reduce with the backward.
* torch.compile: ``torch.compile(DDP(model), backend="aot_eager")``: dynamo splits the graph at
  the buckets (DDPOptimizer), so the all-reduce overlaps the compiled backward.
* fxpooch in-core / 60%: ``DDP(fxpooch.compile(model, x, limit))`` at a limit the in-core step fits
  (nothing swapped: the cost of one backward graph, whose gradients are all-reduced after it) and
  at 60 % of the in-core peak (the plan swaps and recomputes).
* compile(DDP) 60%: ``fxpooch.compile(DDP(model), x, "60%")``.

On a CPU the "device" is host memory: swapping saves nothing and costs memcpys, so the 60 %
figures are the mechanics' overhead here, not what a GPU would show. Results: results/ddp.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxpooch
from fxpooch.models import gpt_decoder
from gpu import WithLoss

WORLD = 2
VOCAB, SEQ = 4096, 128
RESULTS = Path(__file__).resolve().parent / "results" / "ddp.json"


def _variants(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], ids: list[int] | None) -> dict[str, nn.Module]:
    def fresh() -> nn.Module:
        return copy.deepcopy(model)

    return {
        "plain DDP": DDP(fresh(), device_ids=ids),
        "torch.compile (aot_eager)": torch.compile(DDP(fresh(), device_ids=ids), backend="aot_eager"),
        "fxpooch in-core": DDP(fxpooch.compile(fresh(), batch, "1TiB"), device_ids=ids),
        "fxpooch 60%": DDP(fxpooch.compile(fresh(), batch, "60%"), device_ids=ids),
        "compile(DDP) 60%": fxpooch.compile(DDP(fresh(), device_ids=ids), batch, "60%"),
    }


def _rank(rank: int, port: int, rounds: int, batch: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.device_count() >= WORLD
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WithLoss(gpt_decoder(n_layer=4, d_model=256, n_head=4, seq=SEQ, vocab=VOCAB, dropout=0.0)).to(device)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(1 + rank)).to(device)
    inputs = (tokens[:, :-1], tokens[:, 1:])  # next-token prediction
    variants = _variants(model, inputs, [rank] if cuda else None)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):  # round 0 warms up (dynamo compiles, DDP rebuilds its buckets)
        for name, module in variants.items():
            dist.barrier()
            start = time.perf_counter()
            module(*inputs).backward()
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            module.zero_grad(set_to_none=True)
            if r:
                times[name].append(seconds)
    if rank == 0:
        base = statistics.median(times["plain DDP"])
        rows = {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / base, "steps_s": t}
                for name, t in times.items()}
        Path(out).write_text(json.dumps({"device": device.type, "world": WORLD, "batch_per_rank": batch,
                                         "rounds": rounds, "variants": rows}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.rounds, args.batch, args.out), nprocs=WORLD)
    result = json.loads(Path(args.out).read_text())
    print(f"{result['world']} ranks on {result['device']}, {result['batch_per_rank']} sequences per rank, "
          f"{result['rounds']} interleaved rounds (median seconds per step, ratio to plain DDP):")
    for name, row in result["variants"].items():
        print(f"  {name:<28}{row['median_s']:8.3f} s  {row['ratio']:5.2f}x")


if __name__ == "__main__":
    main()
