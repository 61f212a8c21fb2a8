"""Stage 8, the measured peak: a compiled plan run once on the example inputs, its peak checked.

Inductor runs other code than the graphs the profile measured op by op: it lays convolutions out
channels-last on CPU, relays weights in kernels of its own and lowers ops into fused kernels, so
the scratch memory its code takes is not the profiled scratch (on the CNN of benchmarks/CPU.md its
step measured 0.8 MiB above the plan). :func:`fit_measured` closes the loop: the plan, compiled,
runs a training step on the example inputs (its effects undone), the allocator's peak of that step
is read (:func:`allocator_peak`: on CUDA its peak statistic, on CPU the profiler's allocator
events), and while it is above the limit (less the margin), the plan is made again with the memory
measured above the plan kept free as margin (a tighter limit for the planner), then compiled and
measured again, for a bounded number of rounds. A limit no such plan meets raises
:class:`~fxpooch.errors.InfeasibleMemoryLimit` naming the lowest peak measured.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from . import _torch_compat as compat
from .bytesize import format_bytes
from .capture import preserved_state
from .errors import InfeasibleMemoryLimit
from .memory import Margin
from .pipeline import replan
from .plan import Plan
from .planners import Planner

log = logging.getLogger("fxpooch.peakcheck")

#: steps run per measurement: the first fills the host pool (and inductor's lazily made state), the
#: last is measured
MEASURED_STEPS = 2


@dataclass(frozen=True)
class Measured:
    """A plan and the peak its compiled step measured (resident bytes included)."""

    plan: Plan
    peak_bytes: int

    @property
    def undercount(self) -> int:
        """Bytes the compiled step took above the plan's peak (0 if none)."""
        return max(0, self.peak_bytes - self.plan.peak_bytes)


def allocator_peak(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes the allocator of ``device`` held at most while ``run()`` ran, above what it held before
    (CUDA: ``max_memory_allocated``; CPU: the profiler's allocator events summed in time order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in compat.profiler_events(prof) if e.name == compat.MEMORY_EVENT and e.device_type == "cpu"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns):  # stable: same-time events keep their order
        held += e.nbytes
        peak = max(peak, held)
    return peak


def run_backward(outputs: list[object], held: bool) -> None:
    """The backward a training step runs on ``outputs[0]`` (a one-item list, emptied here unless the
    caller holds the outputs through the backward, ``held``): from its scalar tensors that need
    gradients (a loss; the other outputs get autograd's zero gradient), or, if none is scalar, from
    every output that needs gradients, with a gradient of ones."""
    tensors = [t for t in compat.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    roots = [t for t in tensors if t.dim() == 0] or tensors
    del tensors
    if not held:
        outputs.clear()
    torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


@contextlib.contextmanager
def undone(model: nn.Module, inputs: object) -> Iterator[None]:
    """Run the block, then put back the model's buffers, the inputs, the RNG states and the gradients."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    try:
        with preserved_state(model, inputs):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def step_peak(model: nn.Module, inputs: object, device: torch.device, step: Callable[[], object]) -> int:
    """Peak bytes above the start of the last of :data:`MEASURED_STEPS` runs of ``step()`` (forward
    and backward), on copies of the gradients it accumulates into; everything it changes is undone."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    peak = 0
    with undone(model, inputs), torch.enable_grad():
        for _ in range(MEASURED_STEPS):
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.clone()
            peak = allocator_peak(device, step)
    return peak


def fit_measured(plan: Plan, measure: Callable[[Plan], int], *, rounds: int, planner: str | Planner,
                 margin: Margin) -> Measured:
    """``plan`` if its compiled step (``measure(plan)``: the measured peak) fits the limit less
    ``margin``, else a plan made again with the memory measured above the plan kept free, up to
    ``rounds`` times. Raises :class:`InfeasibleMemoryLimit` naming the lowest measured peak (a limit
    that plan met) when none fits, or the planner's floor plus what its code took above the plan."""
    limit = plan.mem_limit
    target = limit - margin.of(limit)
    tried: list[Measured] = []
    extra = 0
    for round_ in range(rounds + 1):
        found = Measured(plan, measure(plan))
        tried.append(found)
        log.info("round %d: the compiled step measured %d bytes, planned %d, limit %d (less the margin: %d)",
                 round_, found.peak_bytes, plan.peak_bytes, limit, target)
        if found.peak_bytes <= target:
            return found
        if round_ == rounds:
            break
        # keep free what the code took above this plan, and at least the excess more than the last round
        extra = max(found.undercount, extra + found.peak_bytes - target)
        tighter = Margin(margin.share, margin.nbytes + extra)
        try:
            plan = replan(plan, planner=planner, mem_limit=limit, margin=tighter)
        except InfeasibleMemoryLimit as e:
            floor = e.min_feasible_bytes
            log.info("no plan leaves %d bytes free under the limit (smallest limit for that: %d)", extra, floor)
            best = min(tried, key=lambda m: m.peak_bytes)
            raise InfeasibleMemoryLimit(
                limit, min(floor, best.peak_bytes), e.live, e.planner, margin_bytes=margin.of(limit),
                note=(f"The compiled step took up to {format_bytes(found.undercount)} more than its plan "
                      "counts (measured on the example inputs: the compiled code's own buffers and scratch)."),
            ) from None
        log.warning("the compiled step measured %d bytes above the limit of %d: planned again with %d bytes kept "
                    "free for what the compiled code takes beyond the plan", found.peak_bytes - target, limit, extra)
    best = min(tried, key=lambda m: m.peak_bytes)
    raise InfeasibleMemoryLimit(
        limit, best.peak_bytes, (), plan.planner, margin_bytes=margin.of(limit),
        note=(f"After {rounds} plans made again with more memory kept free, the compiled step still measured "
              f"above the limit; the lowest peak measured was {format_bytes(best.peak_bytes)}."))
