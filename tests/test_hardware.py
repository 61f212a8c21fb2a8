"""Tests for fxpooch.hardware: links, presets and lookups."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpooch.errors import UnknownName
from fxpooch.hardware import LINKS, PRESETS, Hardware, Link, get_hardware, get_link


@pytest.mark.parametrize("bandwidth, latency, nbytes, expected", [
    (10e9, 10e-6, 0, 0.0),
    (10e9, 10e-6, 1, 10e-6 + 1e-10),
    (10e9, 10e-6, 10**9, 10e-6 + 0.1),
    (12e9, 0.0, 12 * 10**9, 1.0),
    (75e9, 5e-6, 3 * 75 * 10**9, 3.0 + 5e-6),
])
def test_transfer_time(bandwidth, latency, nbytes, expected):
    assert Link("l", bandwidth, latency).transfer_time(nbytes) == pytest.approx(expected, rel=1e-12)


def test_transfer_time_zero_bytes_has_no_latency():
    assert Link("l", 1e9, 1.0).transfer_time(0) == 0.0


def test_transfer_time_rejects_negative_bytes():
    with pytest.raises(ValueError, match="nbytes"):
        Link("l", 1e9, 0.0).transfer_time(-1)


@pytest.mark.parametrize("bandwidth, latency", [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1e9, -1e-6)])
def test_link_validates(bandwidth, latency):
    with pytest.raises(ValueError):
        Link("bad", bandwidth, latency)


@pytest.mark.parametrize("name, bandwidth", [
    ("pcie3", 12e9), ("pcie4", 25e9), ("pcie5", 50e9), ("nvlink2", 75e9), ("c2c", 450e9), ("host", 20e9),
])
def test_link_presets(name, bandwidth):
    link = get_link(name)
    assert link is LINKS[name]
    assert link.name == name
    assert link.bandwidth == bandwidth


def test_gpu_links_have_dma_latency_and_host_has_none():
    assert all(LINKS[n].latency > 0 for n in ("pcie3", "pcie4", "pcie5", "nvlink2", "c2c"))
    assert LINKS["host"].latency == 0.0


@pytest.mark.parametrize("name, link, memory, bandwidth, bf16", [
    ("v100-pcie3", "pcie3", 16 * 2**30, 900e9, 15.7e12),      # no bf16 units: fp32 fallback
    ("v100-nvlink2", "nvlink2", 16 * 2**30, 900e9, 15.7e12),
    ("a100-pcie4", "pcie4", 40 * 2**30, 1555e9, 312e12),
    ("h100-pcie5", "pcie5", 80 * 2**30, 3.35e12, 989e12),
    ("h200", "pcie5", 141 * 2**30, 4.8e12, 989e12),
    ("gh200", "c2c", 96 * 2**30, 4e12, 989e12),
    ("cpu", "host", 24 * 2**30, 50e9, 1e11),
])
def test_hardware_presets(name, link, memory, bandwidth, bf16):
    hw = get_hardware(name)
    assert hw is PRESETS[name]
    assert hw.name == name
    assert hw.link == LINKS[link]
    assert hw.memory_bytes == memory
    assert hw.mem_bandwidth == pytest.approx(bandwidth)
    assert hw.peak_flops(torch.bfloat16) == pytest.approx(bf16)


def test_gpu_alignment_is_cuda_allocator_block_and_cpu_is_byte():
    assert get_hardware("a100-pcie4").allocator_alignment == 512
    assert get_hardware("cpu").allocator_alignment == 1


@pytest.mark.parametrize("dtype, expected", [
    (torch.float32, 19.5e12),
    (torch.float16, 312e12),
    (torch.bfloat16, 312e12),
    (torch.float64, 9.7e12),
    (torch.int64, 19.5e12),   # no integer rate: fp32 fallback
    (torch.bool, 19.5e12),
])
def test_peak_flops_by_dtype(dtype, expected):
    assert get_hardware("a100-pcie4").peak_flops(dtype) == expected


def test_hardware_is_hashable_comparable_and_frozen():
    a = Hardware("x", {"float32": 1e12, "bfloat16": 2e12}, 1e9, 1e-6, 2**30, LINKS["pcie3"])
    b = Hardware("x", {"bfloat16": 2e12, "float32": 1e12}, 1e9, 1e-6, 2**30, LINKS["pcie3"])
    assert a == b and hash(a) == hash(b)
    assert a != dataclasses.replace(a, flops={"float32": 3e12})
    assert a.flops == {"float32": 1e12, "bfloat16": 2e12}
    assert len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "y"
    with pytest.raises(TypeError):
        a.flops["float32"] = 5.0


def test_hardware_copies_the_flops_dict():
    rates = {"float32": 1e12}
    hw = Hardware("x", rates, 1e9, 1e-6, 2**30, LINKS["pcie3"])
    rates["float32"] = 9e12
    assert hw.peak_flops(torch.float32) == 1e12


@pytest.mark.parametrize("field, value, fragment", [
    ("flops", {"bfloat16": 1e12}, "float32"),
    ("flops", {"float32": 0.0}, "flop rates"),
    ("mem_bandwidth", 0.0, "mem_bandwidth"),
    ("launch_overhead", -1.0, "launch_overhead"),
    ("memory_bytes", 0, "memory_bytes"),
    ("memory_bytes", 1.5, "memory_bytes"),
    ("allocator_alignment", 0, "allocator_alignment"),
])
def test_hardware_validates(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        dataclasses.replace(get_hardware("cpu"), **{field: value})


def test_with_link_swaps_only_the_link():
    v100 = get_hardware("v100-pcie3")
    moved = v100.with_link(get_link("nvlink2"))
    assert moved.link == LINKS["nvlink2"]
    assert v100.link == LINKS["pcie3"]
    assert dataclasses.replace(moved, name="v100-nvlink2") == get_hardware("v100-nvlink2")


@pytest.mark.parametrize("lookup, kind, known", [
    (get_hardware, "hardware preset", PRESETS),
    (get_link, "link preset", LINKS),
])
def test_unknown_name_lists_choices(lookup, kind, known):
    with pytest.raises(UnknownName) as info:
        lookup("tpu-v9")
    message = str(info.value)
    assert f"unknown {kind} 'tpu-v9'" in message
    for name in known:
        assert name in message
    assert info.value.known == tuple(known)
    assert isinstance(info.value, KeyError)


def test_unhashable_name_is_unknown_not_type_error():
    with pytest.raises(UnknownName):
        get_hardware(["a100-pcie4"])
