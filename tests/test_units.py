"""Tests for fxpooch.units: parse_bytes and format_bytes."""
from __future__ import annotations

import numpy as np
import pytest

from fxpooch.errors import InvalidMemoryLimit
from fxpooch.units import DEVICE, MAX_BYTES, InCoreShare, format_bytes, parse_bytes, parse_limit


@pytest.mark.parametrize("value, expected", [
    (1, 1),
    (16 * 2**30, 16 * 2**30),
    (np.int64(4096), 4096),
    ("1024", 1024),
    ("16GiB", 16 * 2**30),
    ("16GB", 16 * 10**9),
    ("500MiB", 500 * 2**20),
    ("512KiB", 512 * 2**10),
    ("1.5GiB", 3 * 2**29),
    ("1 GiB", 2**30),
    ("  2 gb  ", 2 * 10**9),
    ("16gib", 16 * 2**30),
    ("16GIB", 16 * 2**30),
    ("3B", 3),
    ("7KB", 7000),
    ("7MB", 7 * 10**6),
    ("2TB", 2 * 10**12),
    ("2TiB", 2 * 2**40),
    ("4.35KB", 4350),          # exact decimal arithmetic: float would give 4349
    ("1.0009KiB", 1024),       # 1024.9216 bytes rounds down
    (".5KiB", 512),
    ("1e3", 1000),
])
def test_parse_bytes_accepts(value, expected):
    result = parse_bytes(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize("value, fragment", [
    (True, "bool"),
    (False, "bool"),
    (1.5, "float"),
    (16e9, "float"),
    (float("nan"), "float"),
    (None, "NoneType"),
    ([16], "list"),
    (0, "must be positive"),
    (-5, "must be positive"),
    (MAX_BYTES + 1, "larger than 2**64"),
    ("", "cannot parse"),
    ("GiB", "cannot parse"),
    ("abc", "cannot parse"),
    ("nan", "cannot parse"),
    ("inf GiB", "cannot parse"),
    ("1.2.3GB", "cannot parse"),
    ("16 G iB", "cannot parse"),
    ("16XB", "unknown unit"),
    ("16gibs", "unknown unit"),
    ("0", "at least 1 byte"),
    ("0GiB", "at least 1 byte"),
    ("0.5B", "at least 1 byte"),
    ("-1GiB", "at least 1 byte"),
    ("1e30", "larger than 2**64"),
    ("1e999999999GiB", "larger than 2**64"),
])
def test_parse_bytes_rejects(value, fragment):
    with pytest.raises(InvalidMemoryLimit) as info:
        parse_bytes(value)
    message = str(info.value)
    assert fragment in message
    assert repr(value) in message  # says what was given
    assert "'16GiB'" in message     # and what to pass instead


def test_invalid_memory_limit_is_value_error():
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_float_message_names_the_alternatives():
    with pytest.raises(InvalidMemoryLimit, match=r"pass an int number of bytes or a string like '16GiB'"):
        parse_bytes(2.0)


@pytest.mark.parametrize("n, expected", [
    (0, "0 B"),
    (512, "512 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (2**20, "1.00 MiB"),
    (16 * 2**30, "16.00 GiB"),
    (3 * 2**40, "3.00 TiB"),
    (-2 * 2**20, "-2.00 MiB"),
])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [512, 2**20, 3 * 2**29, 16 * 2**30, 5 * 2**40])
def test_format_output_parses_back(n):
    assert parse_bytes(format_bytes(n)) == n


@pytest.mark.parametrize("value, expected", [("16G", 16 * 2**30), ("512m", 512 * 2**20), ("2 T", 2 * 2**40),
                                             ("1k", 1024)])
def test_single_letter_units_are_binary(value, expected):
    assert parse_bytes(value) == expected


def test_parse_limit_forms():
    assert parse_limit("16GiB") == parse_limit(16 * 2**30) == 16 * 2**30
    assert parse_limit("60%") == InCoreShare(60.0) and InCoreShare(60.0).of(1000) == 600
    assert parse_limit("device") == parse_limit(" ALL ") == DEVICE
    for bad, words in (("-5%", "positive percentage"), ("x%", "percentage looks like"), ("lots", "'device'")):
        with pytest.raises(InvalidMemoryLimit, match=words):
            parse_limit(bad)


def test_messages_name_the_option():
    with pytest.raises(InvalidMemoryLimit, match="^cannot parse margin 'big'"):
        parse_bytes("big", "margin")
    with pytest.raises(InvalidMemoryLimit, match="^host_pool_limit -1 must be positive"):
        parse_bytes(-1, "host_pool_limit")
