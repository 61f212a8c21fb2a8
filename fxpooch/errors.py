"""Typed errors raised by fxpooch. Each message says what to do next."""
from __future__ import annotations

from collections.abc import Sequence

from .bytesize import format_bytes


class FxpoochError(Exception):
    """Base class of every error fxpooch raises on purpose."""


class UntestedTorchWarning(UserWarning):
    """Issued once, when fxpooch is imported with a torch release it is not tested with."""


class InvalidMemoryLimit(FxpoochError, ValueError):
    """``mem_limit`` is not a positive byte count or a string such as ``"16GiB"``."""


class InvalidOption(FxpoochError, ValueError):
    """An option of ``compile`` / ``plan`` that is neither a memory size nor a name (e.g. ``max_plans``)."""


class InfeasibleMemoryLimit(FxpoochError, ValueError):
    """No plan keeps the step's peak under ``mem_limit``.

    ``min_feasible_bytes`` is the smallest limit the planner can meet; ``live`` names what
    is resident at the peak of the most memory-frugal plan (largest first).
    """

    def __init__(self, mem_limit: int, min_feasible_bytes: int, live: Sequence[tuple[str, int]] = (),
                 planner: str = "pooch", margin_bytes: int = 0, note: str = ""):
        self.mem_limit = mem_limit
        self.min_feasible_bytes = min_feasible_bytes
        self.live = tuple(live)
        self.planner = planner
        self.margin_bytes = margin_bytes
        top = ", ".join(f"{name} ({format_bytes(n)})" for name, n in self.live[:5])
        msg = (
            f"mem_limit={format_bytes(mem_limit)} ({mem_limit} bytes) is below what planner "
            f"{planner!r} can fit: the smallest feasible limit is {format_bytes(min_feasible_bytes)} "
            f"({min_feasible_bytes} bytes). Raise mem_limit to at least that, or reduce the batch size."
        )
        if margin_bytes:
            msg += (f" Both limits include the allocator margin kept free under them ({format_bytes(margin_bytes)} "
                    "at this limit; the margin option of compile sets it).")
        if note:
            msg += f" {note}"
        if top:
            msg += f" Live at the floor's peak: {top}."
        super().__init__(msg)


class UnsupportedModel(FxpoochError, TypeError):
    """The model or its inputs use something fxpooch cannot plan; the message says what instead."""


class InvalidProfile(FxpoochError, ValueError):
    """A saved profile does not match the graphs being planned (or is not a profile at all)."""


class UnknownName(FxpoochError, KeyError):
    """A planner, hardware preset or link preset name that is not registered."""

    def __init__(self, kind: str, name: str, known: Sequence[str]):
        self.kind, self.name, self.known = kind, name, tuple(known)
        super().__init__(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(known))}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class HostPoolExhausted(FxpoochError, MemoryError):
    """The host copies of swapped activations need more than the pool's ``host_pool_limit``."""

    def __init__(self, limit: int, in_use: int, need: int):
        self.limit, self.in_use, self.need = limit, in_use, need
        super().__init__(
            f"the host pool needs a {format_bytes(need)} block but already holds {format_bytes(in_use)} of host "
            f"copies not yet brought back, and its limit is {format_bytes(limit)} ({limit} bytes). Raise "
            "host_pool_limit (at least the plan's host bytes, plan.host_bytes, for each forward whose backward has "
            "not run yet), or run backward before the next forward.")


class ReplanLimitExceeded(FxpoochError, RuntimeError):
    """A compiled module needed more plans than ``max_plans``: something the compiled graphs depend
    on keeps changing from step to step. ``cause`` says what (dynamo's recompile reason)."""

    def __init__(self, plans: int, cause: str):
        self.plans, self.cause = plans, cause
        super().__init__(
            f"this compiled module already holds {plans} plans and needs another: {cause}. Each set of graphs "
            "dynamo compiles for a step needs its own plan, and a value dynamo specialises on (a Python number, "
            "the result of .item(), an input's strides, autocast, a module switched between train and eval) "
            "makes a new set whenever it changes. Keep that value fixed, pass it as a tensor, or raise "
            "fxpooch.compile's max_plans if the number of variants is bounded.")


class PendingBackward(FxpoochError, RuntimeError):
    """A compiled module ran forward again while the previous forward's backward had not run."""

    def __init__(self) -> None:
        super().__init__(
            "forward called again before the previous forward's backward: the plan covers one forward "
            "followed by its backward, and both forwards' activations would be live at once (beyond "
            "mem_limit). Call backward on each forward's loss before the next forward (gradients accumulate "
            "into .grad the same way), or concatenate the inputs into one batch; for an evaluation that "
            "needs no gradient run it under torch.no_grad(), or drop the previous outputs first.")
