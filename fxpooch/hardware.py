"""Hardware descriptions for the analytic cost model and the swap planner.

A :class:`Hardware` is a GPU (or host) roofline: peak FLOP/s per dtype, memory bandwidth,
kernel-launch overhead, memory capacity and the :class:`Link` that swaps tensors to host memory.
All numbers are nominal vendor figures unless a comment says "effective"; each preset cites
its source so a reader can check it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from types import MappingProxyType

import torch

from .errors import UnknownName
from .memory import CUDA_ALLOCATOR_ALIGNMENT

__all__ = ["Link", "LinkCalibration", "Hardware", "LINKS", "PRESETS", "fit_link", "get_hardware", "get_link",
           "dtype_name"]

# Bytes per gigabyte (decimal), as used by interconnect and HBM spec sheets.
_GB = 1e9
# HBM stacks come in power-of-two capacities, so "16GB" of HBM2 is 16 GiB of physical memory.
_GiB = 2**30

# Latency of one host<->device DMA (cudaMemcpyAsync): dominated by driver and DMA-engine setup,
# not by the wire, and measured at several microseconds up to ~10 us on PCIe and NVLink alike
# (Li et al., "Evaluating Modern GPU Interconnect: PCIe, NVLink, NV-SLI, NVSwitch and GPUDirect",
# IEEE TPDS 31(1), 2020). We use one round figure for every GPU link.
_DMA_LATENCY_S = 10e-6

# Cost of launching one CUDA kernel from eager PyTorch: a few microseconds (NVIDIA Developer
# Blog, "Getting Started with CUDA Graphs", 2019, measures ~2-3 us of pure launch time; framework
# dispatch adds more). 5 us is a round middle estimate.
_GPU_LAUNCH_S = 5e-6


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth`` to timed copies.

    Returns ``(latency, bandwidth)``; a negative intercept (noise on tiny copies) is clamped to
    0. Raises ``ValueError`` when the samples cannot give a bandwidth (fewer than two distinct
    sizes, or times that do not grow with size).
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"fit_link: {len(sizes)} sizes but {len(seconds)} times")
    if len(set(sizes)) < 2:
        raise ValueError(f"fit_link: need copies of at least two distinct sizes, got {sorted(set(sizes))}")
    if not all(math.isfinite(t) and t >= 0 for t in seconds):
        raise ValueError(f"fit_link: copy times must be finite and >= 0 s, got {list(seconds)}")
    n = len(sizes)
    mean_b, mean_t = sum(sizes) / n, sum(seconds) / n
    var = sum((b - mean_b) ** 2 for b in sizes)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, seconds)) / var
    if not slope > 0:
        raise ValueError(f"fit_link: copy times do not grow with size ({list(zip(sizes, seconds))}); "
                         "time larger copies")
    return max(0.0, mean_t - slope * mean_b), 1.0 / slope


@dataclass(frozen=True)
class LinkCalibration:
    """Pinned host<->device copies timed with CUDA events: seconds per copy of each size, device
    to host and host to device, on a side stream alone and while a memory-bound kernel runs on
    the compute stream (``*_concurrent``, what a swap overlapping compute sees). On a CPU host the
    copies the runtime makes, timed on the thread that runs the ops (into a reused host block, and
    into a new tensor); nothing runs beside them there, so ``*_concurrent`` repeats the figures."""

    device: str
    sizes: tuple[int, ...]
    d2h: tuple[float, ...]
    h2d: tuple[float, ...]
    d2h_concurrent: tuple[float, ...]
    h2d_concurrent: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("sizes", "d2h", "h2d", "d2h_concurrent", "h2d_concurrent"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if len(value) != len(self.sizes):
                raise ValueError(f"LinkCalibration.{name}: {len(value)} entries for {len(self.sizes)} sizes")

    def fit(self, direction: str, concurrent: bool = True) -> Link:
        """The fitted link of ``direction`` ("d2h" or "h2d"), next to compute or alone."""
        if direction not in ("d2h", "h2d"):
            raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
        seconds = getattr(self, f"{direction}_concurrent" if concurrent else direction)
        latency, bandwidth = fit_link(self.sizes, seconds)
        return Link(f"{self.device} {direction}{' concurrent' if concurrent else ''}", bandwidth, latency)


@dataclass(frozen=True)
class Link:
    """A host<->device link: ``bandwidth`` in bytes/s, ``latency`` in seconds, both directions.

    A measured link also carries its :class:`LinkCalibration`; its per-direction fits next to
    compute then time each direction (:meth:`directed`), and ``bandwidth``/``latency`` are the
    slower direction's.
    """

    name: str
    bandwidth: float
    latency: float
    calibration: LinkCalibration | None = None
    #: the copies run on the compute thread, one after another with the ops (a CPU host's
    #: memcpy), instead of on side streams that overlap compute (a GPU's DMA engines)
    on_compute_stream: bool = False

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"Link {self.name!r}: latency must be >= 0 s, got {self.latency!r}")

    @classmethod
    def calibrated(cls, name: str, calibration: LinkCalibration, on_compute_stream: bool = False) -> Link:
        """The link whose per-direction times are ``calibration``'s fits next to compute."""
        d2h, h2d = calibration.fit("d2h"), calibration.fit("h2d")
        return cls(name, min(d2h.bandwidth, h2d.bandwidth), max(d2h.latency, h2d.latency), calibration,
                   on_compute_stream)

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` one way: ``latency + nbytes / bandwidth`` (0 bytes -> 0.0)."""
        if nbytes < 0:
            raise ValueError(f"transfer_time: nbytes must be >= 0, got {nbytes!r}")
        if nbytes == 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth

    def directed(self, direction: str) -> Link:
        """The link of one direction ("d2h" or "h2d"): the calibrated fit next to compute when
        measured, else this link."""
        if self.calibration is None:
            return self
        return dataclasses.replace(self.calibration.fit(direction), on_compute_stream=self.on_compute_stream)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency}
        if self.calibration is not None:
            out["calibration"] = dataclasses.asdict(self.calibration)
        if self.on_compute_stream:
            out["on_compute_stream"] = True
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Link:
        """Inverse of :meth:`to_json` (also reads links saved before calibrations were recorded)."""
        cal = data.get("calibration")
        return cls(data["name"], float(data["bandwidth"]), float(data["latency"]),
                   None if cal is None else LinkCalibration(**cal), bool(data.get("on_compute_stream", False)))


LINKS: Mapping[str, Link] = MappingProxyType({
    # PCIe 3.0 x16: 8 GT/s x 16 lanes x 128b/130b = 15.75 GB/s per direction nominal (PCI-SIG,
    # PCI Express Base Specification 3.0). Effective pinned-memory copies reach ~12 GB/s
    # (CUDA samples `bandwidthTest --memory=pinned` on x86 PCIe3 hosts reports 11-13 GB/s).
    "pcie3": Link("pcie3", bandwidth=12 * _GB, latency=_DMA_LATENCY_S),
    # PCIe 4.0 x16: 31.5 GB/s per direction nominal (PCI-SIG Base Spec 4.0); ~25 GB/s effective
    # pinned (bandwidthTest on A100 PCIe hosts).
    "pcie4": Link("pcie4", bandwidth=25 * _GB, latency=_DMA_LATENCY_S),
    # PCIe 5.0 x16: 63 GB/s per direction nominal (PCI-SIG Base Spec 5.0); ~50 GB/s effective
    # pinned (bandwidthTest on H100 PCIe5 hosts).
    "pcie5": Link("pcie5", bandwidth=50 * _GB, latency=_DMA_LATENCY_S),
    # NVLink 2.0 between POWER9 and V100 (IBM AC922): 3 bricks x 25 GB/s = 75 GB/s per direction.
    # NOMINAL figure (IBM Redpaper REDP-5472, "IBM Power System AC922 Introduction and Technical
    # Overview"), the one the POOCH paper uses; measured copies reach roughly 63-68 GB/s.
    "nvlink2": Link("nvlink2", bandwidth=75 * _GB, latency=_DMA_LATENCY_S),
    # NVLink-C2C in GH200: 900 GB/s bidirectional = 450 GB/s per direction, nominal
    # (NVIDIA Grace Hopper Superchip Architecture Whitepaper, 2023).
    "c2c": Link("c2c", bandwidth=450 * _GB, latency=_DMA_LATENCY_S),
    # "Swapping" on a CPU-only host is a memcpy within DRAM: ~20 GB/s is a typical single-thread
    # memcpy rate on current x86 servers (STREAM-copy class figure); no DMA setup, so no latency.
    # The copy runs on the thread that runs the ops, so it does not overlap them.
    "host": Link("host", bandwidth=20 * _GB, latency=0.0, on_compute_stream=True),
})


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32 -> "float32"``: the key :attr:`Hardware.flops` uses for ``dtype``."""
    return str(dtype).removeprefix("torch.")


class _FrozenRates(Mapping[str, float]):
    """An immutable, hashable ``{dtype name: flop/s}`` mapping (keeps frozen dataclasses hashable)."""

    __slots__ = ("_items",)

    def __init__(self, rates: Mapping[str, float]):
        items = sorted((str(k), float(v)) for k, v in rates.items())
        self._items: tuple[tuple[str, float], ...] = tuple(items)

    def __getitem__(self, key: str) -> float:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return repr(dict(self._items))


@dataclass(frozen=True)
class Hardware:
    """A device roofline plus the link it swaps over.

    ``flops`` maps a dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"tf32"``, ...)
    to peak FLOP/s; ``mem_bandwidth`` is device-memory bytes/s; ``launch_overhead`` is seconds
    per kernel; ``memory_bytes`` is device capacity; ``allocator_alignment`` is the allocator's
    block granularity in bytes.
    """

    name: str
    flops: Mapping[str, float]
    mem_bandwidth: float
    launch_overhead: float
    memory_bytes: int
    link: Link
    allocator_alignment: int = CUDA_ALLOCATOR_ALIGNMENT

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", _FrozenRates(self.flops))
        if "float32" not in self.flops:
            raise ValueError(f"Hardware {self.name!r}: flops needs a 'float32' rate (the fallback), "
                             f"got keys {sorted(self.flops)}")
        bad = {k: v for k, v in self.flops.items() if not v > 0}
        if bad:
            raise ValueError(f"Hardware {self.name!r}: flop rates must be > 0, got {bad}")
        if not self.mem_bandwidth > 0:
            raise ValueError(f"Hardware {self.name!r}: mem_bandwidth must be > 0, got {self.mem_bandwidth!r}")
        if not self.launch_overhead >= 0:
            raise ValueError(f"Hardware {self.name!r}: launch_overhead must be >= 0 s, "
                             f"got {self.launch_overhead!r}")
        if not (isinstance(self.memory_bytes, int) and self.memory_bytes > 0):
            raise ValueError(f"Hardware {self.name!r}: memory_bytes must be a positive int, "
                             f"got {self.memory_bytes!r}")
        if not (isinstance(self.allocator_alignment, int) and self.allocator_alignment >= 1):
            raise ValueError(f"Hardware {self.name!r}: allocator_alignment must be an int >= 1, "
                             f"got {self.allocator_alignment!r}")

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; the float32 rate for dtypes without an entry (e.g. integers).

        float32 maps to the plain fp32 rate, not TF32: callers that enable TF32 matmuls can look
        up ``hw.flops["tf32"]`` themselves.
        """
        return self.flops.get(dtype_name(dtype), self.flops["float32"])

    def with_link(self, link: Link) -> Hardware:
        """A copy of this hardware that swaps over ``link``."""
        return dataclasses.replace(self, link=link)


# NVIDIA Tesla V100 datasheet (SXM2, 16 GB HBM2): 15.7 TFLOPS fp32, 7.8 fp64, 125 tensor-core
# fp16, 900 GB/s. No bf16/tf32 hardware, so those fall back to the fp32 rate.
_V100_FLOPS = {"float32": 15.7e12, "float64": 7.8e12, "float16": 125e12}
# NVIDIA A100 Tensor Core GPU datasheet (40 GB SXM): 19.5 TFLOPS fp32, 9.7 fp64, 156 tf32,
# 312 bf16/fp16 (dense), 1555 GB/s HBM2.
_A100_FLOPS = {"float32": 19.5e12, "float64": 9.7e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}
# NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB): 67 TFLOPS fp32, 34 fp64, 494.5 tf32 and
# 989 bf16/fp16 dense (the sheet's 989 tf32 / 1979 bf16 figures assume 2:4 sparsity), 3.35 TB/s.
# The H200 and GH200 datasheets list the same compute figures.
_H100_FLOPS = {"float32": 67e12, "float64": 34e12, "tf32": 494.5e12, "bfloat16": 989e12, "float16": 989e12}

PRESETS: Mapping[str, Hardware] = MappingProxyType({
    "v100-pcie3": Hardware("v100-pcie3", _V100_FLOPS, mem_bandwidth=900 * _GB,
                           launch_overhead=_GPU_LAUNCH_S, memory_bytes=16 * _GiB, link=LINKS["pcie3"]),
    "v100-nvlink2": Hardware("v100-nvlink2", _V100_FLOPS, mem_bandwidth=900 * _GB,
                             launch_overhead=_GPU_LAUNCH_S, memory_bytes=16 * _GiB, link=LINKS["nvlink2"]),
    "a100-pcie4": Hardware("a100-pcie4", _A100_FLOPS, mem_bandwidth=1555 * _GB,
                           launch_overhead=_GPU_LAUNCH_S, memory_bytes=40 * _GiB, link=LINKS["pcie4"]),
    "h100-pcie5": Hardware("h100-pcie5", _H100_FLOPS, mem_bandwidth=3350 * _GB,
                           launch_overhead=_GPU_LAUNCH_S, memory_bytes=80 * _GiB, link=LINKS["pcie5"]),
    # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", _H100_FLOPS, mem_bandwidth=4800 * _GB,
                     launch_overhead=_GPU_LAUNCH_S, memory_bytes=141 * _GiB, link=LINKS["pcie5"]),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: 96 GB HBM3 at 4 TB/s, NVLink-C2C to Grace.
    "gh200": Hardware("gh200", _H100_FLOPS, mem_bandwidth=4000 * _GB,
                      launch_overhead=_GPU_LAUNCH_S, memory_bytes=96 * _GiB, link=LINKS["c2c"]),
    # A generic multi-core x86 host, for planning CPU runs: ~100 GFLOP/s fp32 (a few AVX2/AVX-512
    # cores at ~30-50 GFLOP/s each), ~50 GB/s DRAM (dual-channel DDR5 class), ~5 us per op of
    # eager-dispatch overhead, 24 GiB memory, byte-granular allocations.
    "cpu": Hardware("cpu", {"float32": 1e11}, mem_bandwidth=50 * _GB, launch_overhead=5e-6,
                    memory_bytes=24 * _GiB, link=LINKS["host"], allocator_alignment=1),
})


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (see :data:`PRESETS`); raises :class:`UnknownName` otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise UnknownName("hardware preset", name, tuple(PRESETS)) from None


def get_link(name: str) -> Link:
    """The link called ``name`` (see :data:`LINKS`); raises :class:`UnknownName` otherwise."""
    try:
        return LINKS[name]
    except (KeyError, TypeError):
        raise UnknownName("link preset", name, tuple(LINKS)) from None
