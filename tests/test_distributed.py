"""fxpooch under DistributedDataParallel, two processes on gloo (loopback) (FSDP2: tests/test_fsdp.py).

Each rank trains a planned copy and a plain-DDP copy of the same model on its own batch and
checks, on every rank: gradients and updated parameters equal to plain DDP's, and the step's
peak, measured by an independent counter (tests/measure.py's StepCounter, entered around DDP's
construction so its gradient buckets are counted), equal to the plan's and under the limit.
Sizes are whole MiB (512 x 512 fp32).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
import torch
import torch.nn as nn

import fxpooch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not built", allow_module_level=True)

from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WORLD = 2
N = 512  # 512 x 512 fp32 = 1 MiB
BATCH = 4 * N  # activations of 4 MiB, parameters of 1 MiB: the activations make the peak
MiB = 2**20
ANALYTIC = dict(profile="analytic", hardware="cpu")
BUCKET_MB = 1  # a bucket per layer: several all-reduces per step


class Block(nn.Module):
    """A user module (its forward is not torch's own code)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(N, N), nn.Linear(N, N)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + x


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(N, N), nn.ReLU(), nn.Linear(N, N), nn.ReLU(), nn.Linear(N, N), nn.ReLU(),
                         nn.Linear(N, N))


def user_module() -> nn.Module:
    return nn.Sequential(Block(), nn.ReLU(), Block())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _spawn(fn) -> None:
    torch.multiprocessing.spawn(_run, args=(fn, _free_port()), nprocs=WORLD)


def _run(rank: int, fn, port: int) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))  # the spawned process imports tests' helpers
    _init(rank, port)
    try:
        fn(rank)
    finally:
        dist.destroy_process_group()


def _train(wrapped, model: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = wrapped(x)
        out.backward(torch.ones_like(out))
        if _ < steps - 1:
            opt.step()


def _assert_same(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{name}.grad")


def _settled(counter, expected: int, seconds: float = 5.0) -> int:
    """The counter's live bytes once DDP's construction has settled: its parameter broadcast's
    flattened buffers are released by gloo's worker thread a moment after ``wait()`` returns."""
    deadline = time.monotonic() + seconds
    while counter.current_bytes != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return counter.current_bytes


def _peak_case(order: str, make, rank: int) -> None:
    """One order of DDP and fxpooch at a limit that needs the plan: same gradients as plain DDP,
    the measured per-rank peak equal to the plan's and under the limit."""
    from measure import HOST_OPS, StepCounter

    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(BATCH, N) + rank  # each rank its own batch: the all-reduce averages different gradients
    probe = fxpooch.compile(DDP(make(), bucket_cap_mb=BUCKET_MB), x, "1TiB", **ANALYTIC).plan
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        fxpooch.replan(probe, mem_limit=1)
    limit = info.value.min_feasible_bytes  # the tightest limit: the plan swaps or recomputes
    assert limit < probe.in_core_peak_bytes
    counter = StepCounter(host_ops=HOST_OPS)
    counter.seed(model, x)
    with counter:  # DDP's buckets are allocated here: the counter sees them alive through the step
        if order == "DDP(compile(model))":
            compiled = fxpooch.compile(model, x, limit, **ANALYTIC)
            wrapped = DDP(compiled, bucket_cap_mb=BUCKET_MB)
        else:
            wrapped = compiled = fxpooch.compile(DDP(model, bucket_cap_mb=BUCKET_MB), x, limit, **ANALYTIC)
    buckets = _settled(counter, sum(p.nbytes for p in model.parameters()))
    assert buckets == sum(p.nbytes for p in model.parameters()), buckets
    counter.reset_peak()
    with counter:
        out = wrapped(x)
        out.backward(torch.ones_like(out))
    del out
    measured = sum(t.nbytes for t in [*model.parameters(), x]) + counter.peak_bytes
    plan = compiled.plan
    assert plan.counts()["keep"] < len(plan.decisions), plan.decisions  # the limit needed the plan
    assert measured == plan.static_peak_bytes, (order, measured, plan.static_peak_bytes)
    assert measured <= limit, (order, measured, limit)
    ref_ddp = DDP(ref, bucket_cap_mb=BUCKET_MB)
    ref_ddp(x).backward(torch.ones(BATCH, N))
    _assert_same(model, ref)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    counter.reset_peak()
    with counter:  # later steps: DDP rebuilds its buckets (both sets alive for a moment), an optimizer step
        _train(wrapped, model, x)
    later = sum(t.nbytes for t in [*model.parameters(), x]) + counter.peak_bytes
    assert later <= limit, (order, later, limit)
    _train(ref_ddp, ref, x)
    _assert_same(model, ref)


def _options_case(rank: int) -> None:
    """DDP's options and gradient accumulation under no_sync, in both orders: gradients of plain DDP."""
    x = torch.randn(N, N) + rank
    for options in [dict(find_unused_parameters=True), dict(static_graph=True), dict(gradient_as_bucket_view=True),
                    dict(accumulate=True)]:
        accumulate = options.pop("accumulate", False)
        for order in ("DDP(compile(model))", "compile(DDP(model))"):
            torch.manual_seed(0)
            model, ref = sequential(), sequential()
            ref.load_state_dict(model.state_dict())
            if order == "DDP(compile(model))":
                wrapped = DDP(fxpooch.compile(model, x, "1GiB", **ANALYTIC), **options)
            else:
                wrapped = fxpooch.compile(DDP(model, **options), x, "1GiB", **ANALYTIC)
            ref_ddp = DDP(ref, **options)
            for module in (wrapped, ref_ddp):
                for i in range(3):
                    with module.no_sync() if accumulate and i < 2 else contextlib.nullcontext():
                        module(x).sum().backward()
            _assert_same(model, ref)


def _moving_case(rank: int) -> None:
    """A compiled module used inside DDP and alone, in turns: each place keeps its own plan (inside DDP
    the buckets are resident), nothing is planned again, and the gradients are those of eager."""
    torch.manual_seed(0)
    model, ref = sequential(), sequential()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(N, N) + rank
    compiled = fxpooch.compile(model, x, "1GiB", **ANALYTIC)
    wrapped = DDP(compiled)
    resident = {}
    for _ in range(2):
        for name, module in (("DDP", wrapped), ("alone", compiled)):
            model.zero_grad(set_to_none=True)
            module(x).sum().backward()
            resident[name] = compiled.plan.graph.resident_bytes
    assert compiled.replans == 0
    assert resident["DDP"] - resident["alone"] == sum(p.nbytes for p in model.parameters())
    ref(x).sum().backward()  # alone: no all-reduce, the local gradients
    _assert_same(model, ref)


def _cases(rank: int) -> None:
    _peak_case("DDP(compile(model))", sequential, rank)
    _peak_case("compile(DDP(model))", sequential, rank)
    _peak_case("compile(DDP(model))", user_module, rank)
    _options_case(rank)
    _moving_case(rank)


def test_ddp_both_orders_match_plain_ddp_and_stay_under_the_limit():
    """One pair of processes for every case (starting them is most of the time)."""
    _spawn(_cases)
