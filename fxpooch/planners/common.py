"""What every planner shares: the problem, a caching evaluator, the floor."""
from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InfeasibleMemoryLimit, InvalidOption
from ..graph import StepGraph
from ..schedule import Decision, Schedule, build_schedule, move_prefetches
from ..segments import NotRecomputable, Recomputes, can_recompute, chain_ops, member_owner, plan_recomputes
from ..footprint import Footprint, program_memory
from ..simulator import Timeline, simulate, static_memory
from ..types import Costs
from .prefetch import place_prefetches
from .sharing import partly_shared

log = logging.getLogger("fxpooch.planner")


#: plans over the limit in program order (or ruled out by ``Evaluator.time_bound``) that cost a
#: search one simulation: their program-order memory (:func:`~fxpooch.footprint.program_memory`)
#: takes about a tenth of a judged plan's time (GPT-2 at 6 and 12 layers at their floors: 1.0 and
#: 2.8 ms against 9.7 and 30 ms); the bound takes less
REJECTIONS_PER_SIMULATION = 8


@dataclass(frozen=True)
class Problem:
    """What a planner sees: the step's graph (integer ids only), its costs (``op_time[OpId]``,
    ``d2h_time[ActivationId]``, ...), and the device bytes its plan must fit."""

    graph: StepGraph
    costs: Costs
    mem_limit: int


@dataclass(frozen=True)
class Candidate:
    schedule: Schedule
    timeline: Timeline
    fits: bool

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return self.schedule.decisions

    @property
    def step_time(self) -> float:
        return self.timeline.step_time

    @property
    def shared(self) -> bool:
        """Does the schedule recompute shared segments once (see :func:`build_schedule`)?"""
        return self.schedule.shared

    @property
    def layout(self) -> Schedule:
        """The schedule in program order, for its memory without copy timing (``static_memory``):
        the schedule itself, or for an :class:`Unjudged` plan its just-in-time one, unsimulated."""
        return self.schedule


    @functools.cached_property
    def program_memory(self) -> np.ndarray:
        """Device bytes live during each instruction of :attr:`layout` (``static_memory``)."""
        return static_memory(self.layout)


class Unjudged(Candidate):
    """A plan that cannot fit, laid out and simulated only when its schedule or timeline is first read.

    Most plans a search tries near the floor are over the limit in program order already; their
    decisions and ``fits`` (False), and their program-order memory, are all a search reads of
    them. ``judge`` returns the candidate the evaluator would have made, so reading one gives the
    same values.
    """

    def __init__(self, decisions: tuple[Decision, ...], footprint: Footprint, layout: Callable[[], Schedule],
                 judge: Callable[[Schedule], Candidate]):
        object.__setattr__(self, "fits", False)
        object.__setattr__(self, "_decisions", decisions)
        object.__setattr__(self, "_footprint", footprint)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_judge", judge)

    @functools.cached_property
    def judged(self) -> Candidate:
        return self._judge(self.layout)

    @property
    def schedule(self) -> Schedule:
        return self.judged.schedule

    @property
    def timeline(self) -> Timeline:
        return self.judged.timeline

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return self._decisions

    @property
    def shared(self) -> bool:
        return self._footprint.shared

    @functools.cached_property
    def layout(self) -> Schedule:
        return self._layout()

    @property
    def program_memory(self) -> np.ndarray:
        return self._footprint.memory


def simulation_budget(graph: StepGraph, work: int, at_most: int, at_least: int = 1) -> int:
    """Simulations that ``work`` op-simulations buy on ``graph`` (one simulation of a step of n ops
    costs n), at least ``at_least`` and at most ``at_most``: a budget that does not depend on the
    machine. Up to ``work / at_least`` ops the planning time stays about the same, past it it grows
    linearly with the graph's size."""
    return max(1, at_least, min(at_most, work // max(1, len(graph.ops))))


class Evaluator:
    """Decisions -> simulated candidate, memoised; every planner judges plans through this.

    The ``cache_size`` most recently used candidates are kept (each holds its schedule and
    timeline: about a megabyte for a step of 4,000 instructions); searches revisit recent plans.
    """

    def __init__(self, problem: Problem, cache_size: int = 256, share_in_part_always: bool = False):
        self.problem = problem
        #: :meth:`evaluate` tries sharing in part wherever the shared schedule is over the limit,
        #: not only where the unshared one fits (the exact search: its plans meet the MILP's
        #: bound, which is over every sharing)
        self.share_in_part_always = share_in_part_always
        self.graph = problem.graph
        self.owner = member_owner(problem.graph)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[tuple[Decision, ...], bool, bool | None], Candidate | None] = OrderedDict()
        self._free_time: dict[tuple[Decision, ...], float] = {}
        self.evaluations = 0  # decision vectors judged (cache misses)
        self.rejected = 0  # of those, over the limit in program order and not simulated (yet)
        self.outrun = 0  # decision vectors :meth:`cannot_beat` settled without judging them
        self._recomputes: tuple[tuple[Decision, ...], Recomputes] | None = None  # the last shared ones planned

    @property
    def simulations(self) -> int:
        """Plans judged so far, with or without the limit: what search budgets count."""
        return (self.evaluations - self.rejected + (self.rejected + self.outrun) // REJECTIONS_PER_SIMULATION
                + len(self._free_time))

    @property
    def budget(self) -> int:
        return self.problem.mem_limit - self.graph.resident_bytes

    def evaluate(self, decisions: Sequence[Decision], early_prefetch: bool = True,
                 share: bool | None = None) -> Candidate | None:
        """The simulated plan, or None when a recompute decision cannot be realised.

        ``share``: recompute shared segments once (see :func:`build_schedule`); None: do so
        where that fits, else where the unshared schedule fits (it holds fewer rebuilt
        activations at once), the faster of it and one whose chains are shared in part
        (:mod:`.sharing`) that fits. Only there: near the floor most plans fit neither way, and
        the search spends its budget better on other plans than on sharing them in part
        (ResNet-50's PCIe5 floor: 1.750x in-core; 1.905x trying every plan over the limit, at
        most 4 memories each); with ``share_in_part_always``, wherever the shared one does not fit.
        """
        key = (tuple(decisions), early_prefetch, share)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if len(key[0]) != len(self.graph.activations):
            raise InvalidOption(f"{len(key[0])} decisions for a graph of {len(self.graph.activations)} activations: "
                                "give one per activation of problem.graph.activations, in their order")
        if share is None:
            candidate = self.evaluate(decisions, early_prefetch, True)
            if (candidate is not None and not candidate.fits and candidate.shared
                    and self.forward_may_fit(candidate)):
                alone = self.evaluate(decisions, early_prefetch, False)
                alone_fits = alone is not None and alone.fits
                if alone_fits or self.share_in_part_always:
                    partly = self._partly_shared(candidate, early_prefetch)
                    if alone_fits:
                        candidate = partly if partly is not None and partly.step_time < alone.step_time else alone
                    elif partly is not None:
                        candidate = partly
        else:
            candidate = self._evaluate(key[0], early_prefetch, share)
        self._cache[key] = candidate
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return candidate

    def known(self, decisions: Sequence[Decision], share: bool | None = None) -> Candidate | None:
        """The candidate :meth:`evaluate` made for ``decisions`` (early prefetches) and ``share``
        if it is still remembered, else None; judges nothing."""
        return self._cache.get((tuple(decisions), True, share))

    @functools.cached_property
    def rebuild_times(self) -> tuple[float, ...]:
        """Per activation: seconds of its shortest recompute chain (every other activation available)."""
        op_time = self.problem.costs.op_time
        return tuple(sum(op_time[o] for o in chain_ops(self.graph, a, lambda _: False, self.owner, strict=False))
                     for a in range(len(self.graph.activations)))

    def cannot_beat(self, decisions: Sequence[Decision], step_time: float) -> bool:
        """True when no plan of ``decisions`` can run the step in less than ``step_time``: by
        :meth:`time_bound`, or its candidate (known already) is slower or does not fit. A search
        looking only for faster plans skips those without judging them."""
        key = tuple(decisions)
        known = self._cache.get((key, True, None), False)
        if known is not False:
            return known is None or not known.fits or known.step_time >= step_time
        shared = self._cache.get((key, True, True))  # fitting, it is the plan ``evaluate`` picks
        if shared is not None and shared.fits:
            return shared.step_time >= step_time
        try:
            bound = self.time_bound(decisions)
        except NotRecomputable:
            return True
        self.outrun += bound >= step_time
        return bound >= step_time

    def time_bound(self, decisions: Sequence[Decision]) -> float:
        """A lower bound on the step time of every schedule of ``decisions``: the compute stream
        runs each op, and each op of every recompute chain, one after another, and each link moves
        its copies one after another (with ``Costs.serial_copies``, the compute stream makes them
        too). Chains counted shared: a schedule with chains apart (or none shared) runs each of
        their ops at least as often. Raises NotRecomputable where ``decisions`` cannot be realised."""
        costs = self.problem.costs
        op_time = costs.op_time
        recomputes = self.shared_recomputes(decisions)
        first_use = recomputes.first_use
        compute = self._all_ops_time + sum(
            op_time[o] for b, chain in recomputes.chains.items() if b in first_use for o in chain)
        swapped = [a for a, d in enumerate(decisions) if d is Decision.SWAP]
        d2h = sum(costs.d2h_time[a] for a in swapped)
        h2d = sum(costs.h2d_time[a] for a in swapped if a in first_use)
        return compute + d2h + h2d if costs.serial_copies else max(compute, d2h, h2d)

    @functools.cached_property
    def _all_ops_time(self) -> float:
        return sum(self.problem.costs.op_time)

    def shared_recomputes(self, decisions: Sequence[Decision]) -> Recomputes:
        """``plan_recomputes(graph, decisions, share=True)``, remembered for the last vector asked."""
        key = tuple(decisions)
        if self._recomputes is None or self._recomputes[0] != key:
            self._recomputes = (key, plan_recomputes(self.graph, key, True))
        return self._recomputes[1]

    def _evaluate(self, decisions: tuple[Decision, ...], early: bool, share: bool) -> Candidate | None:
        try:
            footprint = program_memory(self.graph, decisions, share,
                                       self.shared_recomputes(decisions) if share else None)
        except NotRecomputable:
            return None
        self.evaluations += 1
        if footprint is None:  # a graph program_memory does not handle: read it off the schedule
            jit = build_schedule(self.graph, decisions, share=share)
            footprint = Footprint(static_memory(jit), -1, Recomputes(jit.first_use, jit.chains, jit.materialises,
                                                                      jit.shared))
        else:
            jit = None

        def layout() -> Schedule:
            return jit if jit is not None else build_schedule(self.graph, decisions, share=share,
                                                              recomputes=footprint.recomputes)
        # early prefetches only raise the program-order peak: over the limit, nothing fits
        if not self.fits_program(footprint.memory):
            self.rejected += jit is None
            return Unjudged(decisions, footprint, layout, lambda schedule: self._judged_late(schedule, early, jit is None))
        return self._judged(layout(), early, footprint.memory)

    def _partly_shared(self, shared: Candidate, early: bool) -> Candidate | None:
        """The plan of ``shared``'s decisions with recompute segments shared in part
        (:mod:`.sharing`) where it fits (None: not found, or ``shared`` was judged already). Each
        program-order memory it computes counts as a plan rejected."""
        if not isinstance(shared, Unjudged):
            return None
        recomputes, tried = partly_shared(self.graph, shared.decisions, shared._footprint, self.fits_program)
        self.evaluations += tried
        self.rejected += tried - (recomputes is not None)
        if recomputes is None:
            return None
        c = self.evaluate_recomputes(shared.decisions, recomputes, early)
        return c if c.fits else None

    def evaluate_recomputes(self, decisions: Sequence[Decision], recomputes: Recomputes,
                            early_prefetch: bool = True) -> Candidate:
        """The simulated plan of ``decisions`` with the recompute chains ``recomputes`` (say,
        ``plan_recomputes(graph, decisions, apart=...)``), not memoised."""
        return self._judged(build_schedule(self.graph, decisions, recomputes=recomputes), early_prefetch)

    def _judged_late(self, jit: Schedule, early: bool, rejected: bool) -> Candidate:
        """An :class:`Unjudged` plan judged when read: a simulation after all."""
        self.rejected -= rejected
        return self._judged(jit, early)

    def _judged(self, jit: Schedule, early: bool, memory: np.ndarray | None = None) -> Candidate:
        """The simulated candidate of ``jit``'s decisions: with ``early``, prefetches placed as
        early as memory allows where that fits, else just in time where that fits. ``memory``:
        ``static_memory(jit)`` where the caller has it."""
        if early and any(d is Decision.SWAP for d in jit.decisions):
            memory = static_memory(jit) if memory is None else memory
            positions = place_prefetches(self.graph, jit, self.budget, memory)
            if positions != list(jit.prefetch_before):
                early_c = self._judge(move_prefetches(jit, positions))
                # over the limit in program order, ``jit`` cannot fit (the simulated peak is never
                # below it: frees happen no earlier than in program order): not judged
                if early_c.fits or not self.fits_program(memory):
                    return early_c
                jit_c = self._judge(jit)
                return jit_c if jit_c.fits else early_c
        return self._judge(jit)

    def fits_program(self, memory: np.ndarray) -> bool:
        """Whether a program-order memory curve (``static_memory``) stays under the limit."""
        return self.graph.resident_bytes + max(int(memory.max()) if len(memory) else 0, 0) <= self.problem.mem_limit

    def forward_may_fit(self, candidate: Candidate) -> bool:
        """False when ``candidate``'s forward (its ops and offloads, laid out first) is over the limit
        in program order already: then so is every schedule of its decisions, recompute segments
        shared or not (they differ in the backward only), and none is built to learn that."""
        n = sum(stop - start for start, stop in self.graph.forward_range) + candidate.decisions.count(Decision.SWAP)
        return self.fits_program(candidate.program_memory[:n])

    def _judge(self, schedule: Schedule) -> Candidate:
        tl = simulate(self.graph, schedule, self.problem.costs, self.problem.mem_limit)
        return Candidate(schedule, tl, tl.peak_bytes <= self.problem.mem_limit)

    def unconstrained_time(self, decisions: Sequence[Decision]) -> float:
        """Step time of ``decisions`` if memory never made anything wait (a baseline for overheads):
        every swap-in issued when its backward starts, no limit."""
        key = tuple(decisions)
        if key not in self._free_time:
            starts = [self.graph.backward_range[act.graph][0] for act in self.graph.activations]
            schedule = build_schedule(self.graph, key, starts)
            self._free_time[key] = simulate(self.graph, schedule, self.problem.costs).step_time
        return self._free_time[key]

    def can_recompute(self, a: int, decisions: Sequence[Decision]) -> bool:
        return can_recompute(self.graph, a, decisions, self.owner)

    # -- reference plans -------------------------------------------------------------------
    def all_keep(self) -> tuple[Decision, ...]:
        return tuple(Decision.KEEP for _ in self.graph.activations)

    def all_swap(self) -> tuple[Decision, ...]:
        return tuple(Decision.SWAP if a.swappable else Decision.KEEP for a in self.graph.activations)

    @functools.cached_property
    def recomputable_alone(self) -> tuple[bool, ...]:
        """Per activation: whether its recompute chain is realisable with every other activation
        available (its ops neither random nor mutating, no unsaved input). Where other activations
        are recomputed too, the chain runs on through theirs: it is realisable iff those are, so a
        set of recomputed activations is realisable iff each member is realisable alone."""
        keep = self.all_keep()
        return tuple(self.can_recompute(a, keep) for a in range(len(keep)))

    def all_recompute(self) -> tuple[Decision, ...]:
        """Recompute wherever possible (each chain then starts from kept values), swap the rest."""
        return tuple(Decision.RECOMPUTE if ok else d for ok, d in zip(self.recomputable_alone, self.all_swap()))

    def floor(self) -> Candidate:
        """The most memory-frugal of the reference plans (just-in-time prefetch).

        Its program-order peak is the smallest feasible limit: under any limit at least that
        high, allocations wait for offloads still copying instead of exceeding it.
        """
        options = [self.evaluate(d, early_prefetch=False, share=False)
                   for d in (self.all_swap(), self.all_recompute(), self.all_keep())]
        return min((c for c in options if c is not None),
                   key=lambda c: (c.timeline.static_peak_bytes, c.step_time))

    def infeasible(self, planner: str) -> InfeasibleMemoryLimit:
        floor = self.floor()
        return InfeasibleMemoryLimit(self.problem.mem_limit, floor.timeline.static_peak_bytes,
                                     live_at_peak(self.graph, floor), planner)


def instances_at_peak(sched: Schedule) -> tuple[int, list[int]]:
    """The instruction at ``sched``'s program-order peak and the device instances live there
    (-1 and none for an empty schedule)."""
    mem = static_memory(sched)
    if len(mem) == 0:
        return -1, []
    at = int(mem.argmax())
    return at, [x for x, n in enumerate(sched.instance_bytes)
                if n and 0 <= sched.first_alloc[x] <= at and (sched.persistent[x] or sched.last_reader[x] >= at)]


def live_at_peak(graph: StepGraph, candidate: Candidate) -> list[tuple[str, int]]:
    """Names and sizes of the device buffers live at the candidate's (program-order) peak."""
    sched = candidate.schedule
    live = [(graph.buffers[sched.instance_buffer[x]].name, sched.instance_bytes[x])
            for x in instances_at_peak(sched)[1]]
    return sorted(live, key=lambda t: -t[1])


def require_fit(ev: Evaluator, candidate: Candidate | None, planner: str) -> Candidate:
    if candidate is None or not candidate.fits:
        raise ev.infeasible(planner)
    return candidate
