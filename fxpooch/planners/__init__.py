"""Planners: ``Problem -> Plan``, registered by name. They see only the framework-free StepGraph."""
from __future__ import annotations

from collections.abc import Callable

from ..errors import UnknownName
from .common import Candidate, Evaluator, Problem

Planner = Callable[[Problem], Candidate]
PLANNERS: dict[str, Planner] = {}


def register(name: str) -> Callable[[Planner], Planner]:
    def deco(fn: Planner) -> Planner:
        PLANNERS[name] = fn
        return fn

    return deco


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]
    except KeyError:
        raise UnknownName("planner", name, PLANNERS) from None


from . import baselines, pooch, search  # noqa: E402,F401  (registration)

__all__ = ["PLANNERS", "Candidate", "Evaluator", "Planner", "Problem", "get_planner", "register"]
