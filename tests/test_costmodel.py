"""Tests for fxpooch.costmodel on small make_fx (aten-level, fake-traced) graphs."""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxpooch.costmodel import analytic_time, node_bytes, node_flops
from fxpooch.hardware import LINKS, Hardware, get_hardware
from fxpooch.opkind import is_kernel_free

aten = torch.ops.aten


def trace(f, *inputs, mode="fake"):
    return make_fx(f, tracing_mode=mode)(*inputs)


def only(gm, target):
    """The single node of ``gm`` calling ``target``."""
    nodes = [n for n in gm.graph.nodes if n.target is target]
    assert len(nodes) == 1, [n.target for n in gm.graph.nodes]
    return nodes[0]


@pytest.mark.parametrize("m, k, n", [(4, 8, 3), (64, 32, 16), (1, 1, 1)])
def test_mm_flops_and_bytes(m, k, n):
    gm = trace(torch.mm, torch.randn(m, k), torch.randn(k, n))
    mm = only(gm, aten.mm.default)
    assert node_flops(mm) == 2 * m * n * k
    assert node_bytes(mm) == 4 * (m * k + k * n + m * n)
    assert not is_kernel_free(mm)


@pytest.mark.parametrize("batch, cin, cout, hw_in, kernel, stride, padding", [
    (2, 3, 5, 8, 3, 1, 0),
    (1, 4, 6, 9, 3, 2, 1),
])
def test_conv2d_flops(batch, cin, cout, hw_in, kernel, stride, padding):
    x, w = torch.randn(batch, cin, hw_in, hw_in), torch.randn(cout, cin, kernel, kernel)
    gm = trace(lambda x, w: torch.nn.functional.conv2d(x, w, stride=stride, padding=padding), x, w)
    conv = only(gm, aten.convolution.default)
    hw_out = (hw_in + 2 * padding - kernel) // stride + 1
    assert node_flops(conv) == 2 * batch * cout * hw_out * hw_out * cin * kernel * kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_relu_bytes_read_plus_write(dtype):
    x = torch.ones(3, 5, 7, dtype=dtype)
    relu = only(trace(torch.relu, x), aten.relu.default)
    assert node_bytes(relu) == 2 * x.nbytes
    assert node_flops(relu) == 0


def test_input_read_once_even_if_passed_twice():
    x = torch.randn(4, 6)
    cat = only(trace(lambda x: torch.cat([x, x]), x), aten.cat.default)
    assert node_bytes(cat) == x.nbytes + 2 * x.nbytes


@pytest.mark.parametrize("f, target", [
    (lambda x: x.view(-1), aten.view.default),
    (lambda x: x.t(), aten.t.default),
    (lambda x: x.transpose(0, 1), aten.transpose.int),
    (lambda x: x.unsqueeze(0), aten.unsqueeze.default),
    (lambda x: x[1], aten.select.int),
    (lambda x: x.expand(2, 4, 6), aten.expand.default),
    (lambda x: x.permute(1, 0), aten.permute.default),
    (lambda x: x.detach(), aten.detach.default),
])
def test_views_are_kernel_free(f, target):
    node = only(trace(f, torch.randn(4, 6)), target)
    assert is_kernel_free(node)
    assert node_bytes(node) == 0
    assert node_flops(node) == 0
    assert analytic_time(node, get_hardware("a100-pcie4")) == 0.0


def test_structural_and_getitem_nodes_are_kernel_free():
    def f(x):
        var, mean = torch.ops.aten.var_mean.correction(x, [1])
        out, _, _ = torch.ops.aten.native_layer_norm.default(x, [6], None, None, 1e-5)
        return var + mean, out

    gm = trace(f, torch.randn(4, 6))
    hw = get_hardware("h100-pcie5")
    by_op = {}
    for node in gm.graph.nodes:
        by_op.setdefault(node.op if node.op != "call_function" else node.target, []).append(node)
    getitems = by_op[operator.getitem]
    assert len(getitems) >= 2
    for node in by_op["placeholder"] + by_op["output"] + getitems:
        assert is_kernel_free(node)
        assert analytic_time(node, hw) == 0.0
    for op in (aten.var_mean.correction, aten.native_layer_norm.default):
        (node,) = by_op[op]
        assert not is_kernel_free(node)
        assert analytic_time(node, hw) >= hw.launch_overhead


def test_multi_output_op_writes_all_outputs():
    x = torch.randn(4, 6)
    var_mean = only(trace(lambda x: torch.ops.aten.var_mean.correction(x, [1]), x), aten.var_mean.correction)
    assert node_bytes(var_mean) == x.nbytes + 2 * (4 * 4)  # read x, write var[4] and mean[4]


def test_split_is_a_view_but_unsafe_view_is_a_kernel():
    gm = trace(lambda x: (torch.split(x, 2)[0] * 2, torch.ops.aten._unsafe_view(x, [24])), torch.randn(4, 6))
    assert is_kernel_free(only(gm, aten.split.Tensor))
    assert not is_kernel_free(only(gm, aten._unsafe_view.default))


def test_in_place_op_is_a_kernel():
    add_ = only(trace(lambda x: x.add_(1), torch.randn(4, 6)), aten.add_.Tensor)
    assert not is_kernel_free(add_)
    assert node_bytes(add_) == 2 * 4 * 24


def test_mm_analytic_time_is_the_roofline():
    m, k, n = 256, 512, 128
    gm = trace(torch.mm, torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16))
    mm = only(gm, aten.mm.default)
    hw = get_hardware("a100-pcie4")
    flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
    expected = max(flops / 312e12, nbytes / 1555e9) + hw.launch_overhead
    assert analytic_time(mm, hw) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("peak, bandwidth, bound", [(1e9, 1e15, "compute"), (1e18, 1e6, "memory")])
def test_roofline_picks_the_slower_side(peak, bandwidth, bound):
    m = k = n = 32
    mm = only(trace(torch.mm, torch.randn(m, k), torch.randn(k, n)), aten.mm.default)
    hw = Hardware("toy", {"float32": peak}, bandwidth, 1e-6, 2**30, LINKS["pcie3"])
    compute, memory = 2 * m * n * k / peak, 4 * 3 * m * n / bandwidth
    assert analytic_time(mm, hw) == pytest.approx((compute if bound == "compute" else memory) + 1e-6)


def test_symbolic_shapes_use_hints():
    gm = trace(torch.mm, torch.randn(8, 16), torch.randn(16, 4), mode="symbolic")
    mm = only(gm, aten.mm.default)
    assert node_flops(mm) == 2 * 8 * 4 * 16
    assert node_bytes(mm) == 4 * (8 * 16 + 16 * 4 + 8 * 4)


def test_missing_meta_val_counts_no_flops():
    gm = trace(torch.mm, torch.randn(4, 8), torch.randn(8, 3))
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    mm = only(gm, aten.mm.default)
    assert node_flops(mm) == 0
    assert node_bytes(mm) == 0


def test_deterministic_and_does_not_mutate_graph():
    gm = trace(lambda a, b: torch.mm(a, b).relu(), torch.randn(16, 8), torch.randn(8, 4))
    before = gm.code
    hw = get_hardware("v100-pcie3")
    first = [analytic_time(n, hw) for n in gm.graph.nodes]
    second = [analytic_time(n, hw) for n in gm.graph.nodes]
    assert first == second
    assert gm.code == before


def test_in_place_op_without_outputs_is_charged_for_its_writes():
    def f(a, b):
        torch._foreach_add_([a, b], 1)
        return a, b

    a, b = torch.randn(4), torch.randn(8)
    node = only(trace(f, a, b), aten._foreach_add_.Scalar)
    assert not is_kernel_free(node)
    assert node_bytes(node) == 2 * (a.nbytes + b.nbytes)  # read both lists, write them back


def test_unbacked_sizes_use_the_fallback():
    from fxpooch.costmodel import UNBACKED_SIZE_FALLBACK

    gm = trace(lambda x: x.nonzero().float(), torch.randn(4), mode="symbolic")
    to_copy = only(gm, aten._to_copy.default)
    # reads int64[u0, 1], writes float32[u0, 1]
    assert node_bytes(to_copy) == UNBACKED_SIZE_FALLBACK * (8 + 4)
