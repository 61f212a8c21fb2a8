"""Exact checks of the independent live-memory counter in ``tests/memcount.py``."""
from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

from memcount import LiveStorageCounter, resident_bytes, storage_pyobject_preserved

MiB = 1 << 20
N = 512  # a (N, N) fp32 tensor is exactly 1 MiB
FP32 = 4  # bytes per float32 element


# ---------------------------------------------------------------- custom ops for host tests
@torch.library.custom_op("memcounttest::offload", mutates_args=())
def _offload(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for a device->host copy (on CPU it is just a copy)."""
    return x.clone()


@torch.library.custom_op("memcounttest::reload", mutates_args=())
def _reload(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for a host->device copy."""
    return x.clone()


def one_mib() -> torch.Tensor:
    """A fresh 1 MiB fp32 tensor."""
    return torch.empty(N, N)


# ---------------------------------------------------------------- the technique itself
def test_storage_pyobject_is_preserved():
    assert storage_pyobject_preserved()


def test_storage_freed_from_cpp_is_observed():
    """A tensor saved for backward and released by autograd (C++) is seen freed."""
    w = torch.randn(N, N, requires_grad=True)
    with LiveStorageCounter() as c:
        y = torch.randn(N, N).mul(w)  # randn (1 MiB, saved by MulBackward), y (1 MiB)
        assert c.current_bytes == 2 * MiB
        y.backward(torch.ones(N, N))
        # the saved randn is freed by autograd; ones is freed once backward returns;
        # y and w.grad stay alive.
        assert c.current_bytes == 2 * MiB
        del y
        assert c.current_bytes == MiB
        w.grad = None
        assert c.current_bytes == 0
        assert c.live_storages == 0


# ---------------------------------------------------------------- basic allocations
def test_single_tensor_peak():
    with LiveStorageCounter() as c:
        t = one_mib()
        assert c.current_bytes == MiB
    assert c.peak_bytes == MiB
    del t
    assert c.current_bytes == 0
    assert c.peak_bytes == MiB


def test_sequential_create_delete_peak_is_one():
    with LiveStorageCounter() as c:
        a = one_mib()
        del a
        b = one_mib()
        del b
    assert c.peak_bytes == MiB
    assert c.current_bytes == 0
    assert c.allocated_bytes == 2 * MiB
    assert c.num_allocations == 2


def test_two_alive_peak_is_two():
    with LiveStorageCounter() as c:
        a = one_mib()
        b = one_mib()
        assert c.current_bytes == 2 * MiB
        del a, b
    assert c.peak_bytes == 2 * MiB
    assert c.current_bytes == 0


def test_views_and_inplace_do_not_double_count():
    with LiveStorageCounter() as c:
        a = one_mib()
        v1 = a.view(-1)
        v2 = a[1:]
        v3 = a.t()
        a.add_(1)
        a.relu_()
        parts = a.split(N // 2)
        assert c.current_bytes == MiB
        del a
        assert c.current_bytes == MiB  # views keep the storage alive
        del v1, v2, v3
        assert c.current_bytes == MiB
        del parts
        assert c.current_bytes == 0
    assert c.peak_bytes == MiB


def test_preexisting_storages_are_not_counted():
    outside = torch.zeros(N, N)
    with LiveStorageCounter() as c:
        outside.view(-1)
        outside.t().contiguous()  # a real copy: counted, then freed at once
        outside.mul_(2)
        assert c.current_bytes == 0
    assert c.peak_bytes == MiB


def test_zero_byte_storage_ignored_then_resize_counted():
    with LiveStorageCounter() as c:
        e = torch.empty(0)
        assert c.current_bytes == 0
        e.resize_(N, N)
        assert c.current_bytes == MiB
        del e
    assert c.peak_bytes == MiB
    assert c.current_bytes == 0


def test_exact_sizes_of_odd_shapes():
    with LiveStorageCounter() as c:
        a = torch.empty(3, 5, dtype=torch.float64)  # 15 * 8 bytes
        b = torch.empty(7, dtype=torch.int16)  # 7 * 2 bytes
        assert c.current_bytes == 15 * 8 + 7 * 2
        del a, b


def test_reset_and_reset_peak():
    c = LiveStorageCounter()
    with c:
        a = one_mib()
        b = one_mib()
        del b
    assert (c.peak_bytes, c.current_bytes) == (2 * MiB, MiB)
    c.reset_peak()
    assert c.peak_bytes == MiB
    c.reset()
    assert (c.peak_bytes, c.current_bytes, c.live_storages) == (0, 0, 0)
    del a  # must not drive current_bytes negative after reset
    assert c.current_bytes == 0


# ---------------------------------------------------------------- autograd
def test_backward_ops_run_on_calling_thread_and_are_seen():
    threads: set[int] = set()

    class Spy(LiveStorageCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            threads.add(threading.get_ident())
            return super().__torch_dispatch__(func, types, args, kwargs)

    lin = nn.Linear(N, N, bias=False)
    x = torch.randn(N, N)
    with Spy() as c:
        y = lin(x)
        ops_after_forward = c.num_ops
        y.backward(torch.ones_like(y))
    assert c.num_ops > ops_after_forward
    assert threads == {threading.get_ident()}
    assert lin.weight.grad is not None


def test_linear_fwd_bwd_exact_peak():
    """y = x @ W^T; y.backward(g): peak = y + grad_W = 2 MiB exactly."""
    torch.manual_seed(0)
    lin = nn.Linear(N, N, bias=False)
    x = torch.randn(N, N)
    g = torch.ones(N, N)
    with LiveStorageCounter() as c:
        y = lin(x)  # mm -> 1 MiB
        assert c.current_bytes == MiB
        y.backward(g)  # grad_W = x^T g -> 1 MiB, stolen by AccumulateGrad
    assert c.peak_bytes == 2 * MiB
    assert c.current_bytes == 2 * MiB
    assert resident_bytes(lin) == 2 * MiB  # weight + its grad
    del y
    assert c.current_bytes == MiB
    lin.weight.grad = None
    assert c.current_bytes == 0


def test_two_layer_mlp_exact_peak():
    """Hand-computed peak of Linear -> ReLU -> Linear with biases, x without grad.

    Forward: a1 = addmm (1 MiB); h = relu(a1) (1 MiB, a1 then dies); y = addmm (1 MiB).
    Backward of layer 2 (AddmmBackward): grad_h = g @ W2 (1 MiB), grad_W2 (1 MiB),
    grad_b2 = g.sum(0) (N fp32). Live: h, y, grad_h, grad_W2, grad_b2.
    ReluBackward: threshold_backward -> grad_a1 (1 MiB) while grad_h is still an
    input: live h, y, grad_h, grad_W2, grad_b2, grad_a1 = 5 MiB + N * 4 B (the peak).
    Layer 1 then frees h and grad_h and adds grad_W1 (1 MiB) and grad_b1.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N, N), nn.ReLU(), nn.Linear(N, N))
    x = torch.randn(N, N)
    g = torch.ones(N, N)
    bias_grad = N * FP32
    with LiveStorageCounter(record_events=True) as c:
        y = model(x)
        assert c.current_bytes == 2 * MiB  # h (saved by ReLU and Linear2) + y
        assert c.peak_bytes == 2 * MiB  # a1 + h at the ReLU
        y.backward(g)
    assert c.peak_bytes == 5 * MiB + bias_grad
    assert c.peak_op == "aten.threshold_backward.default"
    # y + two weight grads + two bias grads remain
    assert c.current_bytes == 3 * MiB + 2 * bias_grad
    del y
    model.zero_grad(set_to_none=True)
    assert c.current_bytes == 0


# ---------------------------------------------------------------- host ops
def test_host_op_outputs_are_excluded():
    x = torch.randn(N, N)
    with LiveStorageCounter(host_ops={"memcounttest::offload"}) as c:
        y = x * 2  # 1 MiB device
        h = torch.ops.memcounttest.offload(y)  # host copy: not counted
        hv = h.view(-1)  # a view of host memory: not counted either
        assert c.current_bytes == MiB
        del y
        assert c.current_bytes == 0
        z = torch.ops.memcounttest.reload(h)  # back on "device": counted
        assert c.current_bytes == MiB
        del h, hv, z
    assert c.peak_bytes == MiB
    assert c.current_bytes == 0


@pytest.mark.parametrize("spelling", ["memcounttest::offload", "memcounttest::offload.default",
                                      "memcounttest.offload.default", "memcounttest.offload"])
def test_host_op_name_spellings(spelling):
    x = torch.randn(N, N)
    with LiveStorageCounter(host_ops={spelling}) as c:
        h = torch.ops.memcounttest.offload(x)
    assert c.peak_bytes == 0
    del h


def test_without_host_ops_custom_op_is_counted():
    x = torch.randn(N, N)
    with LiveStorageCounter() as c:
        h = torch.ops.memcounttest.offload(x)
    assert c.peak_bytes == MiB
    del h


# ---------------------------------------------------------------- resident_bytes
def test_resident_bytes_modules_and_tensors():
    lin = nn.Linear(N, N)  # weight 1 MiB + bias N*4
    bn = nn.BatchNorm1d(N)  # weight, bias, running_mean, running_var (N*4 each) + num_batches_tracked (8 B)
    assert resident_bytes(lin) == MiB + N * FP32
    assert resident_bytes(bn) == 4 * N * FP32 + 8  # int64 counter
    t = torch.empty(N, N)
    assert resident_bytes(t, t.view(-1), t[0]) == MiB  # one storage
    assert resident_bytes([t, {"w": lin.weight}], None) == 2 * MiB
    lin.weight.grad = torch.zeros(N, N)
    assert resident_bytes(lin) == 2 * MiB + N * FP32
    tied = nn.ModuleList([lin, lin])
    assert resident_bytes(tied) == 2 * MiB + N * FP32
    with pytest.raises(TypeError):
        resident_bytes(3)


def test_resident_bytes_ignores_empty():
    assert resident_bytes(torch.empty(0)) == 0
    assert resident_bytes() == 0


def test_counter_does_not_keep_storages_alive():
    with LiveStorageCounter() as c:
        a = one_mib()
    ref_storage = a.untyped_storage()
    del a
    gc.collect()
    assert c.current_bytes == MiB  # ref_storage still holds it
    del ref_storage
    assert c.current_bytes == 0
