"""fxpooch.compile of a model sharded with FSDP2 (fully_shard per block, then the root), two processes
on gloo (loopback), and the typed refusals of the layouts it does not plan.

Each rank trains a planned copy and a plain-FSDP2 copy of the same model on its own batch and checks:
gradients and updated parameters equal to plain FSDP2's, and the step's per-rank peak, measured from
the CPU allocator's events (benchmarks/memprofile.py: every allocation, FSDP's storage resizes and
collectives' buffers included, which a dispatch-mode counter does not see), under the plan's peak
and the limit. Sizes are whole MiB (512 x 512 fp32).
"""
from __future__ import annotations

import gc
import itertools
import os
import socket

import pytest
import torch
import torch.nn as nn

import fxpooch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not built", allow_module_level=True)

from torch.distributed.fsdp import fully_shard  # noqa: E402

WORLD = 2
N = 512  # 512 x 512 fp32 = 1 MiB
BATCH = 4 * N  # a block's input is 4 MiB, its hidden activation 8 MiB
ANALYTIC = dict(profile="analytic", hardware="cpu")
MARKER = 12345  # bytes of a tensor made between two profiled steps: it marks where the second begins


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(N, 2 * N), nn.Linear(2 * N, N)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + x


class Net(nn.Module):
    """An input layer, three blocks and an output head, each sharded as a block of its own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(N, N)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(N, N)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def sharded(blocks=("inp", "blocks.0", "blocks.1", "blocks.2", "out"), **options) -> Net:
    model = Net()
    modules = dict(model.named_modules())
    for name in blocks:
        fully_shard(modules[name], **options)
    fully_shard(model)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, fn, port: int) -> None:
    import sys

    here = os.path.dirname(__file__)
    sys.path[:0] = [here, os.path.join(os.path.dirname(here), "benchmarks")]  # the spawned process's helpers
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fn(rank)
    finally:
        dist.destroy_process_group()


def _step(module: nn.Module, x: torch.Tensor) -> None:
    out = module(x)
    out.backward(torch.ones_like(out))


def _assert_same(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-5, atol=1e-6,
                                   msg=f"{name}.grad")


def _second_step_peak(deltas: list[int]) -> int:
    """The largest running sum of the allocator's events after the marker (the second step)."""
    sums = list(itertools.accumulate(deltas))
    start = deltas.index(MARKER)
    assert deltas[start + 1] == -MARKER, deltas[start:start + 2]
    return max(sums[start + 2:])


def _peak_case(rank: int) -> None:
    """At the tightest limit: the plan swaps or recomputes, gradients are plain FSDP2's, and the measured
    per-rank peak of a step is under the plan's peak and the limit."""
    from memprofile import profiled_memory

    torch.manual_seed(0)
    model, ref = sharded(), sharded()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(BATCH, N) + rank  # each rank its own batch
    probe = fxpooch.compile(sharded(), x, "1TiB", **ANALYTIC).plan
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.replan(probe, mem_limit=1)
    limit = info.value.min_feasible_bytes
    assert limit < probe.in_core_peak_bytes
    # profiled from before compile: every block the steps free was seen allocated, so the running sum
    # is exact above what was alive before (the shards and the batch)
    resident = sum(t.untyped_storage().nbytes() for t in [*(p.to_local() for p in model.parameters()), x])
    del probe
    gc.collect()  # the probe's blocks freed now, not while profiling (where their frees would not be seen)
    with profiled_memory() as mem:
        compiled = fxpooch.compile(model, x, limit, **ANALYTIC)
        _step(compiled, x)  # the first step fills the host pool that the swaps reuse
        model.zero_grad(set_to_none=True)
        gc.collect()  # what compile and the first step left in reference cycles is not the step's
        marker = torch.empty(MARKER, dtype=torch.uint8)
        del marker
        _step(compiled, x)
    plan = compiled.plan
    assert plan.counts()["keep"] < len(plan.decisions), plan.decisions  # the limit needed the plan
    # on a CPU the host pool (swapped activations) is in the same allocator: not device memory
    measured = resident + _second_step_peak(mem.deltas) - compiled.host_pool_bytes
    assert compiled.host_pool_bytes == plan.host_bytes
    print(f"rank {rank}: limit {limit / 2**20:.2f} MiB, planned peak {plan.peak_bytes / 2**20:.2f} MiB, "
          f"measured {measured / 2**20:.2f} MiB, in-core {plan.in_core_peak_bytes / 2**20:.2f} MiB, {plan.counts()}",
          flush=True)
    assert measured <= plan.peak_bytes <= limit, (measured, plan.peak_bytes, limit)
    # the plan is above the measured peak by less than FSDP's window, the bound it counts as resident:
    # 3 gathered blocks, 1 reduce-scatter input and 3 copies of gloo's (its 2 worker threads and this one)
    window = fxpooch.fsdp.layout(model).window_bytes
    block = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in [model.inp, *model.blocks, model.out])
    assert window == (3 + 1 + 3) * block, (window, block)
    assert plan.peak_bytes - measured < window, (plan.peak_bytes, measured)
    for _ in range(2):
        ref.zero_grad(set_to_none=True)
        _step(ref, x)
    _assert_same(model, ref)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(2):  # training: the optimizer updates the shards
        opt.step()
        ref_opt.step()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        _step(compiled, x)
        _step(ref, x)
    _assert_same(model, ref)
    assert compiled.replans == 0


def _refused_case(rank: int) -> None:
    x = torch.randn(N, N)
    refused = {
        "root module's fully_shard holds parameters": sharded(blocks=("blocks.0", "blocks.1", "blocks.2")),
        "reshard_after_forward=False": sharded(reshard_after_forward=False),
        "inside the sharded block": sharded(blocks=("blocks.0.a", "inp", "blocks.0", "blocks.1", "blocks.2", "out")),
    }
    for message, model in refused.items():
        with pytest.raises(fxpooch.UnsupportedModel, match=message):
            fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    with pytest.raises(fxpooch.UnsupportedModel, match="requires grad"):
        fxpooch.compile(sharded(), x.clone().requires_grad_(), "1GiB", **ANALYTIC)
    with pytest.raises(fxpooch.UnsupportedModel, match="the model given to fxpooch is not"):
        fxpooch.compile(nn.Sequential(sharded()), x, "1GiB", **ANALYTIC)
    model = sharded()  # torch.compile per block with the fxpooch backend: the blocks share one graph
    backend = fxpooch.backend("1GiB", **ANALYTIC)
    for block in model.blocks:
        block.compile(backend=backend)
    with pytest.raises(fxpooch.UnsupportedModel, match="runs twice in one step"):
        model(x)
    model = sharded()
    compiled = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    model.set_requires_gradient_sync(False)  # accumulating unsharded gradients: checked at each step
    with pytest.raises(fxpooch.UnsupportedModel, match="set_requires_gradient_sync"):
        compiled(x)
    model = Net()
    compiled = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    fully_shard(model)
    with pytest.raises(fxpooch.UnsupportedModel, match="applied after fxpooch.compile"):
        compiled(x)
    compiled = fxpooch.compile(Net(), x, "1GiB", **ANALYTIC)
    fully_shard(compiled)
    with pytest.raises(fxpooch.UnsupportedModel, match="applied after fxpooch.compile"):
        compiled(x)


def _measured_profile_case(rank: int) -> None:
    """A measured profile times each node alone: the captured inputs hold gathered parameters FSDP freed."""
    x = torch.randn(N, N) + rank
    torch.manual_seed(0)
    model, ref = sharded(), sharded()
    ref.load_state_dict(model.state_dict())
    compiled = fxpooch.compile(model, x, "1GiB", profile="measure")
    assert compiled.options.profile_mode == "per-node"
    _step(compiled, x)
    _step(ref, x)
    _assert_same(model, ref)
    with pytest.raises(fxpooch.InvalidOption, match="in-situ"):
        fxpooch.compile(sharded(), x, "1GiB", profile="measure", profile_mode="in-situ")


def _cases(rank: int) -> None:
    _peak_case(rank)
    _measured_profile_case(rank)
    _refused_case(rank)


def test_fsdp2_per_block_matches_plain_fsdp_and_stays_under_the_limit():
    """One pair of processes for every case (starting them is most of the time)."""
    torch.multiprocessing.spawn(_run, args=(_cases, _free_port()), nprocs=WORLD)
