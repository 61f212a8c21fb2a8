"""Byte-count parsing and formatting.

``parse_bytes`` turns a user-facing byte count (``16 * 2**30``, ``"16GiB"``, ``"16G"``) into a
positive int number of bytes; ``parse_limit`` also accepts the memory-limit forms that need the
step or the device to resolve (``"60%"`` of the in-core peak, ``"device"``); ``format_bytes``
renders a byte count for messages (defined in :mod:`fxpooch.bytesize`, a leaf module).
"""
from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, localcontext
from types import MappingProxyType

from .bytesize import format_bytes
from .errors import InvalidMemoryLimit

__all__ = ["MAX_BYTES", "UNITS", "DEVICE", "InCoreShare", "parse_bytes", "parse_limit", "format_bytes"]

# Decimal (SI) and binary (IEC 80000-13) byte units, keyed by lower-cased suffix. A bare letter
# ("16G", "512M") is binary, as Docker, Slurm and `free -g` read it.
UNITS: Mapping[str, int] = MappingProxyType({
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
})

#: the memory limit "all the memory the device can give" (see :func:`parse_limit`)
DEVICE = "device"
_DEVICE_WORDS = (DEVICE, "all")
_PERCENT = re.compile(r"^\s*(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*%\s*$")

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
_LIMIT_HINT = f"{_HINT}, a share of the in-core peak like '60%', or 'device' (all the device can give)"


def parse_bytes(value: object, what: str = "memory limit") -> int:
    """Return ``value`` as a positive int number of bytes.

    Accepts a positive ``int`` (bytes; numpy integers too) or a string: plain digits
    (``"1024"``, bytes) or a number followed by a unit, case-insensitive, with optional blanks
    (``"16GiB"``, ``"1.5 gib"``, ``"16GB"``, ``"16G"``). Units: ``B``, ``KB``/``MB``/``GB``/``TB``
    (powers of 1000) and ``KiB``/``MiB``/``GiB``/``TiB`` or ``K``/``M``/``G``/``T`` (powers of 1024).
    Fractional bytes are rounded down. ``what`` names the value in error messages ("margin", ...).

    Raises:
        InvalidMemoryLimit: for ``bool``, ``float``, ``None`` and other types, for strings
            that do not parse, and for values that are zero, negative, not finite or above
            ``MAX_BYTES``.
    """
    if isinstance(value, bool):  # bool is an int subclass: True would silently mean 1 byte
        raise InvalidMemoryLimit(f"{what} {value!r} is a bool, not a byte count; {_HINT}")
    if isinstance(value, numbers.Integral):  # int, and numpy integers (registered as Integral)
        if value <= 0:
            raise InvalidMemoryLimit(f"{what} {value!r} must be positive; {_HINT}")
        if value > MAX_BYTES:
            raise InvalidMemoryLimit(f"{what} {value!r} is larger than 2**64 bytes; {_HINT}")
        return int(value)
    if isinstance(value, float):
        raise InvalidMemoryLimit(
            f"{what} {value!r} is a float; pass an int number of bytes or a string like '16GiB'")
    if not isinstance(value, str):
        raise InvalidMemoryLimit(
            f"{what} {value!r} has type {type(value).__name__}; {_HINT}")
    return _parse_string(value, what)


def _parse_string(text: str, what: str) -> int:
    """Parse the string form accepted by :func:`parse_bytes`."""
    match = _PATTERN.match(text)
    if match is None:
        raise InvalidMemoryLimit(f"cannot parse {what} {text!r}; {_HINT}")
    unit = match["unit"].lower() or "b"
    if unit not in UNITS:
        raise InvalidMemoryLimit(
            f"unknown unit {match['unit']!r} in {what} {text!r}; use one of "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T ({_HINT})")
    # Decimal keeps "4.35KB" exactly 4350 bytes (float gives 4349.999...); int() truncates, which
    # rounds fractional byte counts down because the value is positive whenever it is accepted.
    number = Decimal(match["num"])
    if number.copy_abs() > MAX_BYTES:  # checked before scaling so huge exponents stay cheap
        raise InvalidMemoryLimit(f"{what} {text!r} is larger than 2**64 bytes; {_HINT}")
    with localcontext(prec=_DECIMAL_PRECISION):
        nbytes = int(number * UNITS[unit])
    if nbytes > MAX_BYTES:
        raise InvalidMemoryLimit(f"{what} {text!r} is larger than 2**64 bytes; {_HINT}")
    if nbytes <= 0:
        raise InvalidMemoryLimit(
            f"{what} {text!r} is {nbytes} bytes; it must be at least 1 byte ({_HINT})")
    return nbytes


@dataclass(frozen=True)
class InCoreShare:
    """A memory limit given as a share of the step's in-core peak (``"60%"``): resolved once the step
    is captured, for each input shape (see :func:`parse_limit`)."""

    percent: float

    def of(self, in_core_peak: int) -> int:
        return max(1, int(in_core_peak * self.percent / 100))

    def __str__(self) -> str:
        return f"{self.percent:g}% of the in-core peak"


def parse_limit(value: object) -> int | InCoreShare | str:
    """A memory limit in any of its forms, each with one meaning wherever a limit is taken
    (``compile``, ``plan``, ``--mem-limit``):

    * bytes: an int or a string for :func:`parse_bytes` (``"16GiB"``, ``"16GB"``, ``"16G"``);
    * ``"60%"``: that share of the step's in-core peak (every activation kept), an
      :class:`InCoreShare`;
    * ``"device"`` (or ``"all"``): all the memory the device can give, returned as :data:`DEVICE`
      (``fxpooch.limits.device_memory`` resolves it).

    Raises :class:`InvalidMemoryLimit` otherwise.
    """
    if isinstance(value, str):
        if value.strip().lower() in _DEVICE_WORDS:
            return DEVICE
        match = _PERCENT.match(value)
        if match:
            percent = float(match["num"])
            if not 0 < percent:
                raise InvalidMemoryLimit(f"memory limit {value!r} must be a positive percentage of the in-core peak")
            return InCoreShare(percent)
        if value.strip().endswith("%"):
            raise InvalidMemoryLimit(f"cannot parse memory limit {value!r}; a percentage looks like '60%'")
        try:
            return parse_bytes(value)
        except InvalidMemoryLimit as e:
            if "cannot parse" in str(e):
                raise InvalidMemoryLimit(f"cannot parse memory limit {value!r}; {_LIMIT_HINT}") from None
            raise
    return parse_bytes(value)
