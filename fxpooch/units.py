"""Byte-count parsing and formatting.

``parse_bytes`` turns a user-facing memory limit (``16 * 2**30`` or ``"16GiB"``) into a
positive int number of bytes; ``format_bytes`` renders a byte count for messages.
"""
from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from decimal import Decimal, localcontext
from types import MappingProxyType

from .errors import InvalidMemoryLimit

__all__ = ["MAX_BYTES", "UNITS", "parse_bytes", "format_bytes"]

# Decimal (SI) and binary (IEC 80000-13) byte units, keyed by lower-cased suffix.
UNITS: Mapping[str, int] = MappingProxyType({
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
})

# A signed decimal number (digits with an optional fraction, or a leading-dot fraction, optional
# exponent) followed by an optional unit; blanks allowed around and between. The sign is accepted
# here only so that "-1GiB" is reported as "must be positive" rather than as unparseable.
_PATTERN = re.compile(r"^\s*(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(?P<unit>[a-z]*)\s*$",
                      re.IGNORECASE)

# Largest accepted limit: a 64-bit size_t cannot address more, so anything above is a typo.
MAX_BYTES = 2**64
# Decimal digits kept while scaling (default context keeps 28, too few for MAX_BYTES * 2**40 exactly).
_DECIMAL_PRECISION = 64

_HINT = "pass a positive int number of bytes or a string like '16GiB', '500MiB' or '16GB'"

# Binary prefixes used by format_bytes, smallest first.
_BINARY_STEPS = (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40), ("PiB", 2**50))


def parse_bytes(value: object) -> int:
    """Return ``value`` as a positive int number of bytes.

    Accepts a positive ``int`` (bytes; numpy integers too) or a string: plain digits
    (``"1024"``, bytes) or a number followed by a unit, case-insensitive, with optional blanks
    (``"16GiB"``, ``"1.5 gib"``, ``"16GB"``). Units: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000)
    and ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024). Fractional bytes are rounded down.

    Raises:
        InvalidMemoryLimit: for ``bool``, ``float``, ``None`` and other types, for strings
            that do not parse, and for values that are zero, negative, not finite or above
            ``MAX_BYTES``.
    """
    if isinstance(value, bool):  # bool is an int subclass: True would silently mean 1 byte
        raise InvalidMemoryLimit(f"memory limit {value!r} is a bool, not a byte count; {_HINT}")
    if isinstance(value, numbers.Integral):  # int, and numpy integers (registered as Integral)
        if value <= 0:
            raise InvalidMemoryLimit(f"memory limit {value!r} must be positive; {_HINT}")
        if value > MAX_BYTES:
            raise InvalidMemoryLimit(f"memory limit {value!r} is larger than 2**64 bytes; {_HINT}")
        return int(value)
    if isinstance(value, float):
        raise InvalidMemoryLimit(
            f"memory limit {value!r} is a float; pass an int number of bytes or a string like '16GiB'")
    if not isinstance(value, str):
        raise InvalidMemoryLimit(
            f"memory limit {value!r} has type {type(value).__name__}; {_HINT}")
    return _parse_string(value)


def _parse_string(text: str) -> int:
    """Parse the string form accepted by :func:`parse_bytes`."""
    match = _PATTERN.match(text)
    if match is None:
        raise InvalidMemoryLimit(f"cannot parse memory limit {text!r}; {_HINT}")
    unit = match["unit"].lower() or "b"
    if unit not in UNITS:
        raise InvalidMemoryLimit(
            f"unknown unit {match['unit']!r} in memory limit {text!r}; use one of "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB ({_HINT})")
    # Decimal keeps "4.35KB" exactly 4350 bytes (float gives 4349.999...); int() truncates, which
    # rounds fractional byte counts down because the value is positive whenever it is accepted.
    number = Decimal(match["num"])
    if number.copy_abs() > MAX_BYTES:  # checked before scaling so huge exponents stay cheap
        raise InvalidMemoryLimit(f"memory limit {text!r} is larger than 2**64 bytes; {_HINT}")
    with localcontext(prec=_DECIMAL_PRECISION):
        nbytes = int(number * UNITS[unit])
    if nbytes > MAX_BYTES:
        raise InvalidMemoryLimit(f"memory limit {text!r} is larger than 2**64 bytes; {_HINT}")
    if nbytes <= 0:
        raise InvalidMemoryLimit(
            f"memory limit {text!r} is {nbytes} bytes; it must be at least 1 byte ({_HINT})")
    return nbytes


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
