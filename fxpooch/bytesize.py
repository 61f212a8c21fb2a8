"""Byte counts rendered for messages (``format_bytes``).

A leaf module: :mod:`fxpooch.errors` words its messages with it, and :mod:`fxpooch.units` (which
parses byte counts and raises those errors) re-exports it.
"""
from __future__ import annotations

__all__ = ["format_bytes"]

# Binary prefixes used by format_bytes, smallest first.
_BINARY_STEPS = (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40), ("PiB", 2**50))


def format_bytes(n: int) -> str:
    """Render a byte count with binary units: ``512 -> "512 B"``, ``2**20 -> "1.00 MiB"``."""
    n = int(n)
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    if magnitude < 2**10:
        return f"{sign}{magnitude} B"
    name, scale = _BINARY_STEPS[0]
    for step_name, step_scale in _BINARY_STEPS:
        if magnitude >= step_scale:
            name, scale = step_name, step_scale
    return f"{sign}{magnitude / scale:.2f} {name}"
