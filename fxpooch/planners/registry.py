"""The planners by name: ``@register("name")`` adds one, :func:`get_planner` finds one.

A planner is a function ``Problem -> Candidate``. Wherever a planner is asked for (``compile``,
``plan``, :func:`fxpooch.pipeline.plan_graph`), a registered name or such a function may be given;
:func:`resolve_planner` turns either into ``(name, function)``.
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidOption, UnknownName
from .common import Candidate, Problem

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


def resolve_planner(planner: str | Planner) -> tuple[str, Planner]:
    """``(name, function)`` of a registered name or of a planner function (named by its
    ``__name__``); an unknown name raises :class:`~fxpooch.errors.UnknownName`."""
    if isinstance(planner, str):
        return planner, get_planner(planner)
    if callable(planner):
        return getattr(planner, "__name__", type(planner).__name__), planner
    raise InvalidOption(f"planner={planner!r}: pass a registered planner name (fxpooch.PLANNERS) or a function "
                        "Problem -> Candidate")
