"""Stage 8, the measured step: a compiled plan run on the example inputs, its peak checked and its
time taken as the measure of its compute.

Inductor runs other code than the graphs the profile measured op by op: it lays convolutions out
channels-last on CPU, relays weights in kernels of its own and lowers ops into fused kernels, so
the scratch memory its code takes is not the profiled scratch (on the CNN of benchmarks/CPU.md its
step measured 0.85 MiB above the plan). :func:`fit_measured` closes the loop: the plan, compiled,
runs a training step on the example inputs (its effects undone), the allocator's peak of that step
is read (:func:`allocator_peak`: on CUDA its peak statistic, on CPU the profiler's allocator
events), and while it is above the limit (less the margin), the plan is made again with the memory
measured above the plan kept free as margin (a tighter limit for the planner), then compiled and
measured again, for a bounded number of rounds. A limit no such plan meets raises
:class:`~fxpooch.errors.InfeasibleMemoryLimit` naming the smallest limit whose margin leaves room
for the lowest peak measured.

The profile times the graphs op by op, unfused (inductor's CNN step ran 2.4 times faster than that
predicted), so the first measured step also calibrates the costs (:func:`calibrated`): every op's
time is scaled by the step's measured time over its predicted time, and the step is planned again
on those costs (the same plan and compiled code where the schedule does not change).

A ``torch.compile`` backend owns no step to run: :class:`LiveCheck` drives the same search
(:func:`fitting`, a generator sent each measurement) over the caller's own steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

from . import _torch_compat as compat
from .bytesize import format_bytes
from .state import preserved_state
from .errors import InfeasibleMemoryLimit
from .memory import Margin
from .pipeline import replan
from .plan import Plan
from .planners import Planner
from .scratch import cpu_allocator_events, running_peak
from .timing import ProfileOptions, thread_clock, wall_clock
from .units import parse_bytes

log = logging.getLogger("fxpooch.peakcheck")

#: steps run per memory measurement: the first fills the host pool (and inductor's lazily made
#: state), the last is measured
MEASURED_STEPS = 2
#: steps timed after them
TIMED_STEPS = 5


@dataclass(frozen=True)
class Measured:
    """A plan, the peak its compiled step measured (resident bytes included) and its seconds."""

    plan: Plan
    peak_bytes: int
    seconds: float

    @property
    def undercount(self) -> int:
        """Bytes the compiled step took above the plan's peak (0 if none)."""
        return max(0, self.peak_bytes - self.plan.peak_bytes)


#: the ``record_function`` name marking where a measured span ends
END_MARK = "fxpooch.peakcheck:end"


class AllocatorMeter:
    """The allocator's peak on ``device`` from :meth:`start` to :meth:`end`, above what it held at the
    start (CUDA: ``max_memory_allocated``; CPU: the profiler's allocator events summed in time order),
    read by :meth:`stop`.

    The calls may come from different places: a step's first forward, its last backward. On CPU,
    :meth:`end` marks the span's end in the profiler and :meth:`stop` must come later, outside any
    backward: the autograd engine runs a backward on a copy of the calling thread's profiler state and
    puts the caller's back after it, so a profiler stopped inside would stay enabled on the thread."""

    def __init__(self, device: torch.device):
        self.device = device
        self._before = 0
        self._peak: int | None = None
        self._profiler: profile | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()

    def end(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device) - self._before
        else:
            with record_function(END_MARK):
                pass

    def stop(self) -> int:
        """The peak (on CPU, the events up to the end mark, all of them if :meth:`end` was not called)."""
        if self.device.type == "cuda":
            if self._peak is None:
                self.end()
            return self._peak
        prof, self._profiler = self._profiler, None
        if prof is None:
            raise RuntimeError("AllocatorMeter.stop() without start()")
        prof.stop()
        events = compat.profiler_events(prof)
        cut = min((e.start_ns for e in events if e.name == END_MARK), default=None)
        return running_peak(cpu_allocator_events([e for e in events if cut is None or e.start_ns <= cut]))[0]


class StepOutOfMemory(Exception):
    """A measured step ran out of device memory: ``peak_bytes`` is what the allocator held at most
    before the failing allocation, above the start, plus the bytes that allocation asked for."""

    def __init__(self, peak_bytes: int, message: str):
        super().__init__(message)
        self.peak_bytes = peak_bytes


#: the size in torch's out-of-memory message ("Tried to allocate 230.00 MiB")
_ASKED = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGT]?i?B)")


def allocator_peak(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes the allocator of ``device`` held at most while ``run()`` ran, above what it held before
    (:class:`AllocatorMeter`). Raises :class:`StepOutOfMemory` where ``run()`` ran out of memory
    (under a per-process cap, a step can fail before its allocated bytes reach the limit)."""
    meter = AllocatorMeter(device)
    meter.start()
    failed = None
    try:
        run()
    except torch.OutOfMemoryError as e:  # handled outside: the traceback would keep the step's tensors
        failed = " ".join(str(e).split())
    finally:
        peak = meter.stop()
    if failed is not None:
        asked = _ASKED.search(failed)
        raise StepOutOfMemory(peak + (parse_bytes(asked[1].replace(" ", "")) if asked else 0), failed[:300])
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


def measure_step(model: nn.Module, inputs: object, device: torch.device, step: Callable[[], object]) -> tuple[int, float]:
    """Peak bytes above the start of the last of :data:`MEASURED_STEPS` runs of ``step()`` (forward
    and backward), then the seconds of :data:`TIMED_STEPS` more, timed and summarised as a measured
    profile times its ops (:class:`~fxpooch.timing.ProfileOptions`: on one CPU thread the thread's CPU
    time, their median; else the wall clock, their least), on copies of the gradients it accumulates
    into; everything it changes is undone."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    peak, seconds = 0, []
    timing = ProfileOptions()  # the clock and summary a measured profile uses
    on_thread_clock = device.type == "cpu" and timing.thread_clock()
    with undone(model, inputs), torch.enable_grad():
        for i in range(MEASURED_STEPS + TIMED_STEPS):
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.clone()
            if i < MEASURED_STEPS:
                peak = allocator_peak(device, step)
                continue
            clock = thread_clock() if on_thread_clock else wall_clock()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(clock())
    return peak, timing.summary(seconds, on_cuda=device.type == "cuda")


def calibrated(plan: Plan, seconds: float, *, planner: str | Planner, margin: Margin) -> Plan:
    """``plan``'s step planned again with every op's time scaled by ``seconds`` (its compiled step,
    measured) over its predicted time, so that its predicted time is what the compiled code takes;
    ``plan`` itself when the step took longer than predicted.

    Only downwards: a compiled step faster than its op-by-op profile ran fused kernels (inductor) or
    without the launch gaps of ops timed alone. A slower one waited for what its ops' times do not
    hold (on an H100 under a memory cap, GPT-2's step measured 1.22 times its prediction, with 25
    allocator synchronizations a step): slower ops would hide copies behind compute that is not there."""
    factor = seconds / plan.step_time
    if factor >= 1:
        log.info("the compiled step took %.4g s, predicted %.4g s: op times kept", seconds, plan.step_time)
        return plan
    profile = plan.profile.scaled(factor, "the compiled step's measured time")
    timed = dataclasses.replace(plan, profile=profile, in_core_time=plan.in_core_time * factor)
    log.info("the compiled step took %.4g s, predicted %.4g s: op times scaled by %.3g", seconds,
             plan.step_time, factor)
    return replan(timed, planner=planner, mem_limit=plan.mem_limit, margin=margin)


def most_frugal(plan: Plan, planner: str | Planner) -> Plan:
    """``plan``'s step planned at the planner's floor (its plan of the lowest peak), under ``plan``'s
    limit with the rest kept free."""
    try:
        replan(plan, planner=planner, mem_limit=1, margin=Margin())
        return plan
    except InfeasibleMemoryLimit as e:
        floor = e.min_feasible_bytes
    return replan(plan, planner=planner, mem_limit=plan.mem_limit, margin=Margin(nbytes=max(0, plan.mem_limit - floor)))


def fit_measured(plan: Plan, measure: Callable[[Plan], tuple[int, float]], *, rounds: int,
                 planner: str | Planner, margin: Margin, calibrate: bool = True) -> Measured:
    """``plan`` if its compiled step (``measure(plan)``: the measured peak and seconds) fits the
    limit less ``margin``, else the plan :func:`fitting` makes next, measured in its turn. Raises
    :class:`InfeasibleMemoryLimit` naming the smallest limit whose margin leaves room for the lowest
    measured peak (a limit that plan met) when none fits."""
    search = fitting(plan, rounds=rounds, planner=planner, margin=margin, calibrate=calibrate)
    plan = next(search)
    while True:
        try:
            plan = search.send(measure(plan))
        except StopIteration as done:
            return done.value


def fitting(plan: Plan, *, rounds: int, planner: str | Planner, margin: Margin,
            calibrate: bool = True) -> Generator[Plan, tuple[int, float], Measured]:
    """The search :func:`fit_measured` drives, as a generator for callers whose measurements come
    later (a ``torch.compile`` backend measures the caller's own steps): it yields each plan to
    measure and is sent its step's (peak bytes, seconds); it returns the first :class:`Measured`
    within the limit less ``margin``.

    After ``plan``, a plan made again with the memory measured above the plan kept free, up to
    ``rounds`` times, and last the planner's most frugal plan (:func:`most_frugal`). ``calibrate``:
    the first step measured to its end scales the costs (:func:`calibrated`, the memory kept free so
    far still kept free); a plan whose schedule that changes is measured in its turn (not a round),
    and where it does not fit, a plan measured before it that did is returned. Raises
    :class:`InfeasibleMemoryLimit` naming the smallest limit whose margin leaves room for the lowest
    measured peak when none fits."""
    limit = plan.mem_limit
    target = limit - margin.of(limit)
    tried: list[Measured] = []
    extra = round_ = 0
    frugal = False  # the most frugal plan was measured
    while True:
        found = Measured(plan, *(yield plan))
        log.info("round %d: the compiled step measured %d bytes, planned %d, limit %d (less the margin: %d)",
                 round_, found.peak_bytes, plan.peak_bytes, limit, target)
        if calibrate and plan.step_time > 0 and found.seconds > 0:  # no seconds: the step did not run through
            calibrate = False  # planned again keeping free what earlier rounds found the code takes beyond its plans
            plan = calibrated(plan, found.seconds, planner=planner, margin=Margin(margin.share, margin.nbytes + extra))
            if plan.schedule != found.plan.schedule:  # other decisions on these costs: compile and measure them
                log.info("on the measured costs the plan changes (%s -> %s)", found.plan.counts(), plan.counts())
                tried.append(found)
                continue
            found = dataclasses.replace(found, plan=plan)
        tried.append(found)
        if found.peak_bytes <= target:
            return found
        fitted = [t for t in tried if t.peak_bytes <= target]
        if fitted:  # the plan the calibrated costs made did not fit: the one measured before them did
            log.info("the plan made on the measured costs measured %d bytes above the limit: the plan measured "
                     "before them is kept", found.peak_bytes - target)
            return fitted[-1]
        plan = None if frugal else _tighter(found, target, extra, round_ < rounds, planner, margin)
        if plan is None:
            frugal, plan = True, most_frugal(found.plan, planner)
            if any(t.plan.schedule == plan.schedule for t in tried):
                break
            log.warning("the compiled step measured %d bytes above the limit of %d: its most frugal plan next",
                        found.peak_bytes - target, limit)
            continue
        extra = plan.margin_bytes - margin.of(limit)
        round_ += 1
    best = min(tried, key=lambda m: m.peak_bytes)
    # the smallest limit whose margin leaves that peak room: the limit a plan met, as the message says
    raise InfeasibleMemoryLimit(
        limit, margin.limit_for(best.peak_bytes), (), found.plan.planner, margin_bytes=margin.of(limit),
        note=(f"Measured, the compiled step took up to "
              f"{format_bytes(max(t.undercount for t in tried))} more than its plan counts (the compiled code's "
              f"own buffers and scratch); of {len(tried)} plans tried the lowest peak measured was "
              f"{format_bytes(best.peak_bytes)}."))


class LiveCheck:
    """The search of :func:`fitting` over a caller's own training steps, for a ``torch.compile``
    backend, which owns no step to run: :meth:`begin` before a step of :attr:`plan` starts, :meth:`end`
    after its last backward, :meth:`collect` outside the backward (before the next step).

    The :data:`MEASURED_STEPS`-th step of each plan is measured (the first fills the host pool and
    makes the compiled code's lazy state) and the search is sent its peak; :meth:`collect` returns the
    plan for the next steps while it is above the limit, and raises :class:`InfeasibleMemoryLimit`
    when no plan fits. The measured step has run: its peak may be above the limit, which is what the
    measurement finds. Costs are not calibrated: a step under the CPU profiler runs slower."""

    def __init__(self, plan: Plan, device: torch.device, *, rounds: int, planner: str | Planner, margin: Margin):
        self.device = device
        self._search = fitting(plan, rounds=rounds, planner=planner, margin=margin, calibrate=False)
        #: the plan the next steps run
        self.plan: Plan = next(self._search)
        #: every step measured, in order
        self.measured: list[Measured] = []
        #: the measured step within the limit, once found
        self.result: Measured | None = None
        self._runs = 0
        self._meter: AllocatorMeter | None = None
        self._ended = False

    def begin(self) -> None:
        """A step of :attr:`plan` starts (before its first forward)."""
        self._runs += 1
        if self.result is not None or self._runs != MEASURED_STEPS:
            return
        if self.device.type == "cpu" and compat.profiler_active():
            log.info("a profiler is running: the step's peak is measured in a later step")
            self._runs -= 1
            return
        self._meter, self._ended = AllocatorMeter(self.device), False
        self._meter.start()

    def end(self) -> None:
        """The step's last backward has run."""
        if self._meter is not None:
            self._meter.end()
            self._ended = True

    def abandon(self) -> None:
        """The step that began ended otherwise (no backward, or other graphs ran): not measured."""
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.stop()
            self._runs -= 1

    def collect(self) -> Plan | None:
        """After :meth:`end`, outside the backward: the plan to run from the next step on, if it changes."""
        if not self._ended:
            self.abandon()
            return None
        meter, self._meter, self._ended = self._meter, None, False
        peak = meter.stop() + self.plan.graph.resident_bytes
        self.measured.append(Measured(self.plan, peak, 0.0))
        try:
            plan = self._search.send((peak, 0.0))
        except StopIteration as done:
            self.result = done.value
            return None
        self.plan, self._runs = plan, 0
        return plan


def _tighter(found: Measured, target: int, extra: int, again: bool, planner: str | Planner,
             margin: Margin) -> Plan | None:
    """The plan made again with what ``found``'s code took above its plan kept free (beyond the
    ``extra`` kept free so far); None when no round is left (``again``) or no plan keeps that free."""
    if not again:
        return None
    # keep free what the code took above this plan, at least the excess more than the last round, and
    # enough that the planner must plan below this plan's peak (the same schedule measures the same)
    extra = max(found.undercount, extra + found.peak_bytes - target, target - found.plan.peak_bytes + 1)
    try:
        plan = replan(found.plan, planner=planner, mem_limit=found.plan.mem_limit,
                      margin=Margin(margin.share, margin.nbytes + extra))
    except InfeasibleMemoryLimit as e:
        log.info("no plan leaves %d bytes free under the limit (smallest limit for that: %d)", extra,
                 e.min_feasible_bytes)
        return None
    log.warning("the compiled step measured %d bytes above the limit of %d: planned again with %d bytes kept free "
                "for what the compiled code takes beyond the plan", found.peak_bytes - target, found.plan.mem_limit,
                extra)
    return plan
