"""What the machine can give: device memory for ``mem_limit="device"``, host memory for the pinned pool.

* :func:`device_memory`: on CUDA the memory this process can still get (free on the card plus what
  its caching allocator already holds); on ``meta`` the capacity of the hardware preset the plan
  is for (``h100-pcie5`` unless told); on CPU the host memory available.
* :func:`host_available_bytes`: host memory available to new allocations (``MemAvailable`` of
  ``/proc/meminfo``, else free physical pages), the default bound of the pinned host pool.
* :func:`resolve_limit`: a parsed memory limit (:func:`fxpooch.units.parse_limit`) made bytes as far
  as the device allows; a share of the in-core peak stays an :class:`~fxpooch.units.InCoreShare`
  until the step is captured.
"""
from __future__ import annotations

import logging
import os

import torch

from .hardware import Hardware, get_hardware
from .memory import Margin
from .units import DEVICE, InCoreShare, parse_limit

log = logging.getLogger("fxpooch.limits")

#: the preset a plan on the meta device is for when no hardware is given (as the analytic profile uses)
DEFAULT_META_HARDWARE = "h100-pcie5"
#: the host preset: plans for it are CPU runs, every other preset is a GPU
HOST_PRESET = "cpu"
_MEMINFO = "/proc/meminfo"


def host_available_bytes() -> int:
    """Host memory available to new allocations now (bytes)."""
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB (KiB)
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 0


def _hardware(hardware: str | Hardware | None) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    return get_hardware(hardware or DEFAULT_META_HARDWARE)


def plans_for_gpu(device: torch.device, hardware: str | Hardware | None) -> bool:
    """True when a plan on ``device`` is for a GPU: a CUDA device, or meta with a GPU preset."""
    if device.type == "cuda":
        return True
    return device.type == "meta" and _hardware(hardware).name != HOST_PRESET


def default_margin(device: torch.device, hardware: str | Hardware | None = None) -> Margin:
    """The allocator margin ``compile`` keeps on ``device``; on meta, the one it would keep on the
    preset's card, so a plan made on a laptop fits the same limit as on the GPU."""
    return Margin.default_for("cuda" if plans_for_gpu(device, hardware) else device)


def device_memory(device: torch.device, hardware: str | Hardware | None = None) -> int:
    """All the memory ``device`` can give this process (see the module docstring)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    if device.type == "meta":
        return _hardware(hardware).memory_bytes
    return host_available_bytes()


def resolve_limit(mem_limit: object, device: torch.device, hardware: str | Hardware | None = None) -> int | InCoreShare:
    """``mem_limit`` in bytes, or an :class:`InCoreShare` to resolve against the captured step."""
    limit = parse_limit(mem_limit)
    if limit == DEVICE:
        limit = device_memory(device, hardware)
        log.info("mem_limit='device': %d bytes on %s", limit, device)
    return limit
