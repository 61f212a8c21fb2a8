"""Planners: ``Problem -> Candidate``, registered by name. They see only the framework-free StepGraph."""
from __future__ import annotations

from . import baselines, pooch, search  # noqa: F401  (registration)
from .common import Candidate, Evaluator, Problem
from .registry import PLANNERS, Planner, get_planner, register, resolve_planner

__all__ = ["PLANNERS", "Candidate", "Evaluator", "Planner", "Problem", "get_planner", "register", "resolve_planner"]
