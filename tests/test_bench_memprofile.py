"""benchmarks/memprofile.py: the profiler's allocator events give exact peaks, the dispatch-mode
counter's on an eager step, and what happens inside an inductor kernel (which no dispatch mode sees)."""
from __future__ import annotations

import pytest
import torch

from measure import StepCounter
from zoo import MiB, mlp
from memprofile import profiled_memory, storage_bytes

FLOATS_PER_MIB = MiB // 4  # 512 x 512 fp32


def mib(n: int) -> torch.Tensor:
    return torch.empty(n * FLOATS_PER_MIB)


def test_known_allocations_in_whole_mib():
    keep = mib(1)  # allocated before profiling: not counted
    with profiled_memory() as mem:
        a, b = mib(1), mib(2)
        del a  # 3 MiB held, then 2
        c = mib(3)  # 5 MiB: the peak
        del b, c
        d = mib(1)
    assert mem.peak_bytes == 5 * MiB
    assert mem.end_bytes == 1 * MiB  # d
    assert (mem.allocations, mem.frees) == (4, 3)
    del d, keep


def test_equals_the_dispatch_counter_on_an_eager_step():
    model, x = mlp()

    def step() -> None:
        out = model(x)
        out.backward(torch.ones_like(out))
        del out

    step()  # warm: the first step's lazy allocations are not the steady state
    model.zero_grad(set_to_none=True)
    counter = StepCounter()
    counter.seed(model, x)
    with counter:
        step()
    model.zero_grad(set_to_none=True)
    with profiled_memory() as mem:
        step()
    # 4 layers of 4 MiB activations, 1 MiB weights: whole MiB plus the 2 KiB biases' gradients
    assert counter.peak_bytes > 16 * MiB
    assert mem.peak_bytes == counter.peak_bytes


def test_sees_inside_an_inductor_kernel():
    x = mib(4).normal_()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2  # a 4 MiB intermediate in eager, fused away by inductor
        return y.relu() + y

    with profiled_memory() as eager:
        f(x)
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    compiled(x)
    with profiled_memory() as fused:
        compiled(x)
    assert eager.peak_bytes == 12 * MiB  # y, relu(y) and the output, alive at once
    assert fused.peak_bytes == 4 * MiB  # one kernel writes the output buffer it allocated


def test_storage_bytes_counts_shared_storage_once():
    w = mib(2)
    assert storage_bytes([w, w.view(2, -1), w[: FLOATS_PER_MIB], mib(1)]) == 3 * MiB


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="pass one of"):
        with profiled_memory("tpu"):
            pass
