"""The host pool is bounded by what the machine can give, says when a plan needs more, and reports
what it holds (pinned only with CUDA)."""
from __future__ import annotations

import logging

import pytest
import torch
from zoo import MiB, mlp

import fxpooch
from fxpooch.errors import HostPoolExhausted
from fxpooch.limits import host_available_bytes

SWAP_ALL = {"planner": "swap-all", "profile": "analytic", "hardware": "cpu"}


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def test_the_default_bound_is_the_host_memory_available():
    model, x = mlp()
    before = host_available_bytes()
    cm = fxpooch.compile(model, x, "1GiB", **SWAP_ALL)
    assert 0 < cm.host_pool.limit_bytes <= _meminfo_total()
    assert abs(cm.host_pool.limit_bytes - before) < _meminfo_total() // 4  # the same figure, give or take other work


def test_a_plan_needing_more_host_memory_than_the_bound_warns_then_raises(caplog):
    model, x = mlp()
    with caplog.at_level(logging.WARNING, logger="fxpooch"):
        cm = fxpooch.compile(model, x, "1GiB", host_pool_limit="2MiB", **SWAP_ALL)
    assert cm.plan.host_bytes > 2 * MiB
    warning = next(r.getMessage() for r in caplog.records if "host memory per step" in r.getMessage())
    assert f"swaps {fxpooch.units.format_bytes(cm.plan.host_bytes)}" in warning and "2.00 MiB" in warning
    with pytest.raises(HostPoolExhausted):
        cm(x).sum().backward()


def test_pool_bytes_match_the_plan_and_nothing_is_pinned_on_cpu(caplog):
    model, x = mlp()
    with caplog.at_level(logging.WARNING, logger="fxpooch"):
        cm = fxpooch.compile(model, x, "1GiB", **SWAP_ALL)
    assert not any("host memory per step" in r.getMessage() for r in caplog.records)
    cm(x).sum().backward()
    assert cm.host_pool_bytes == cm.plan.host_bytes > 0
    assert cm.host_pool.pinned_bytes == (cm.host_pool_bytes if torch.cuda.is_available() else 0)
