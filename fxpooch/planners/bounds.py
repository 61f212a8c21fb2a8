"""Lower bounds on the simulated step time of every plan that fits, and of every completion of a
partial plan (what the exact search prunes with).

Notation: ``T`` is a fitting candidate's step time, ``F`` / ``B`` the forward / backward compute
(every op runs once, so ``T >= F + B``), ``cap = mem_limit``; ``d_a``, ``h_a`` are activation
``a``'s D2H / H2D seconds and ``r_a`` the cost of its recompute chain when every other
activation is available, less ops already counted for a lower-numbered activation (every
realised chain that rebuilds ``a`` runs those ops, and a shared segment runs an op once for all
the activations it rebuilds, so ``r`` of a set adds up to at most what its recomputes run).

**Cut bound.** Take a cut ``c``: the RUN instruction of one op, issued at compute time ``θ``.
The simulator's timed memory curve is the running sum of (issue time, instruction) ordered
allocations and (free time, last reader + 1/2) ordered frees, and its maximum is ``peak_bytes``.
Issue times grow along program order, so the events ordered before and at ``c``'s allocations
form a prefix of that curve and their sum is at most the peak. Compared with the in-core plan
(every activation kept), whose program-order memory at ``c`` is ``M_c`` (resident included),
that prefix lacks only activations that are *evicted at c*:

* at a forward cut, an activation whose last forward reader precedes ``c`` and that is
  recomputed, or swapped with its D2H copy ended by ``θ`` (its storage is freed when both its
  readers and its copy are done);
* at a backward cut, an activation first read after ``c`` that is recomputed (its copy is
  made just before its first reader), or swapped with its D2H copy ended by ``θ`` and its
  prefetch issued after ``c`` (a prefetch allocates when issued);

and, at a backward cut, a swapped activation already brought back holds ``transfer_bytes``
rather than its storage's bytes (``slack``). Every other device instance of the in-core plan
is allocated by the same op and last read by the same op in every plan. So a fitting plan
evicts bytes ``>= e_c = M_c - cap - slack`` at ``c``. Let ``X`` be the swapped evictees and
``Y`` the recomputed ones. Then

* ``θ >= P_c``, the compute before ``c`` (plus the chains of recomputes read before ``c``),
  and ``θ >= D(X)``: the D2H stream ran those copies one at a time before ``θ``;
* after ``θ`` compute runs the rest of the forward ``G_c``, then the backward after ``c``
  ``Q_c`` and the chains of ``Y`` (they run at their first reader, after ``c``);
* every prefetch of ``X`` is issued after the forward ends (after ``c`` for a backward cut),
  so the H2D stream is busy ``H(X)`` after ``θ + G_c``.

Hence ``T >= max(P_c, D(X)) + G_c + max(Q_c + R(Y), H(X))``. Besides, compute waits for the
copies of ``X`` first read by op ``k`` or earlier before it runs ``k``, so
``T >= max(P_c, D(X)) + G_c + H(X ∩ read by k) + tail_k`` (``tail_k``: compute from ``k`` on) for
each backward op ``k``; the bound takes the largest over a few ``k``, minimised over every split
of the evicted bytes (:func:`.cutbound.split_bound`). No split reaches ``e``: no plan fits (the
bound is infinite). This holds for any number of forward/backward pairs: the
argument uses program order only. For a partial plan, kept activations leave the candidates,
recomputed ones are evicted for sure at a forward cut; at a backward cut a shared segment may
have rebuilt them earlier, so they stay optional evictees there.

**Keep completion.** For a partial plan, set every undecided activation to keep and simulate
it with no memory limit and every prefetch issued at the start of its graph's backward
(``Evaluator.unconstrained_time``). Every completion ``d`` of the partial plan takes at least
that long when the H2D order of the decided swaps does not depend on the completion:

1. ``evaluate(d).step_time >= unconstrained_time(d)``: a memory limit only adds waits, and
   prefetches issued earlier (all earlier placements keep the H2D order, which is by first
   use) start no later; every stream time is a max / sum of earlier ones (induction).
2. Turning a swap of ``d`` into a keep removes one D2H copy, one H2D copy and one wait and
   leaves the H2D order of the rest: no time grows. Turning a recompute into a keep removes
   its chain and shrinks the chains through it; a swapped activation those chains read may get
   a later first use, which moves its wait later (never slower: ``max(t, ready) + s >=
   max(t + s, ready)``) but may also move its copy later in the H2D FIFO, behind a copy that is
   released late, which is *not* monotone. So the bound is claimed only when the H2D order of
   the decided swaps is the same in every completion.

``keep_completion_is_bound`` checks that: each decided swap's first use lies between the one of
the keep completion and the earliest any completion could give it (chains through every
undecided activation), and the order is fixed when those intervals do not interleave.
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..graph import Phase
from ..schedule import Decision, Kind
from ..segments import NotRecomputable, chain_ops, recompute_chain
from ..simulator import static_memory
from .common import Evaluator
from .cutbound import split_bound

log = logging.getLogger("fxpooch.planner.bounds")

Partial = Sequence[Decision | None]  # per activation; None: not decided yet
#: per cut, the earliest first readers of swap candidates used as deadlines (each costs a solve)
DEADLINES = 3
#: cut bounds each ``Bounds`` remembers (least recently used out): each a few candidates' tuples
SPLIT_BOUND_MEMO = 1 << 14


@dataclass(frozen=True)
class Cut:
    """The RUN of op ``op``: where the in-core plan's memory exceeds the limit by ``excess``."""

    op: int
    backward: bool
    before: float  # compute issued before the cut
    between: float  # forward compute from the cut on (0 for a backward cut)
    after: float  # backward compute from the cut on
    excess: int  # bytes a fitting plan has evicted at the cut
    candidates: tuple[int, ...]  # activations whose eviction counts there


@dataclass(frozen=True)
class RebuildPoint:
    """Just before backward op ``op`` and the group of instructions issued for it: if a chain is
    emitted there, a fitting plan has evicted ``excess + rebuild`` bytes of ``candidates``."""

    op: int
    rebuilt: tuple[int, ...]  # recomputable activations first read by ``op``: a chain there rebuilds one
    rebuild: int  # the least ``Bounds.rebuild`` bytes among them
    excess: int  # in-core memory there (resident included) beyond the limit, less the swap slack
    candidates: tuple[int, ...]  # live activations first read by ``op`` or later
    #: per rebuilt activation: its ``Bounds.rebuild`` bytes and the candidates on the device
    #: while its chain holds them (its own chain emitted there evicts ``excess`` + those bytes of
    #: the other candidates)
    heads: tuple[tuple[int, int, tuple[int, ...]], ...] = ()


class Bounds:
    """Per problem: the cuts, each activation's costs, and the bounds built from them."""

    def __init__(self, ev: Evaluator, not_recomputed: frozenset[int] = frozenset()):
        self.ev = ev
        #: activations no fitting plan recomputes (``lp.not_recomputable``, by probing): each
        #: bound treats them as not recomputable
        self.not_recomputed = frozenset(not_recomputed)
        graph, costs = ev.graph, ev.problem.costs
        acts = graph.activations
        self.nbytes = [graph.buffers[a.buffer].nbytes for a in acts]
        readers = [graph.backward_readers(a) for a in acts]
        self.first_reader = [r[0] if r else None for r in readers]
        self.d2h = [costs.d2h_time[a] if act.swappable else math.inf for a, act in enumerate(acts)]
        self.h2d = [costs.h2d_time[a] if readers[a] else 0.0 for a in range(len(acts))]
        self.compute = sum(costs.op_time)
        self.suffix = [0.0] * (len(graph.ops) + 1)  # compute from each op to the end of the step
        for o in reversed(range(len(graph.ops))):
            self.suffix[o] = self.suffix[o + 1] + costs.op_time[o]
        self.cuts, self.timing_cuts = self._cuts(ev.all_keep())
        #: ``split_bound`` memoised: a search's partial plans that differ only away from a cut (a
        #: swap or keep of a non-candidate) give that cut the same arguments (about two in three
        #: of the branch and bound's on test:cnn_bn)
        self._split_bound = functools.lru_cache(maxsize=SPLIT_BOUND_MEMO)(split_bound)
        self.evaluations = 0  # calls of ``bound``: a search's work (each takes one to a few simulations' time)
        log.debug("%d cuts (%d more for timing) over %d ops", len(self.cuts), len(self.timing_cuts), len(graph.ops))

    def recompute_costs(self, decided: Partial) -> list[float]:
        """Per activation: compute its recompute surely runs in any plan that recomputes it
        (infinite where no completion of ``decided`` can recompute it).

        That is its chain with every other activation available, less the ops already counted
        for a lower-numbered activation: a shared segment (``build_schedule(share=True)``) runs
        an op once for all the activations it rebuilds, so the costs of any set of recomputed
        activations add up to at most what their recomputes run. Infinite for ``not_recomputed``.
        """
        keep = [Decision.KEEP if d is None else d for d in decided]
        out = []
        counted: set[int] = set()
        for a, d in enumerate(decided):
            if self.first_reader[a] is None:  # never read in the backward: a recompute runs nothing
                out.append(0.0)
                continue
            if a in self.not_recomputed:
                out.append(math.inf)
                continue
            try:
                recompute_chain(self.ev.graph, a, [*keep[:a], Decision.RECOMPUTE, *keep[a + 1:]], self.ev.owner)
            except NotRecomputable:
                out.append(math.inf)
                continue
            alone = [Decision.KEEP] * len(decided)
            alone[a] = Decision.RECOMPUTE
            chain = set(recompute_chain(self.ev.graph, a, alone, self.ev.owner)) - counted
            counted |= chain
            out.append(sum(self.ev.problem.costs.op_time[o] for o in chain))
        return out

    def _layout(self, keep: Sequence[Decision]):
        """The in-core plan in program order: its schedule, each op's RUN index, the memory during
        each instruction, and per activation its (alloc, last reader, last forward use) indices."""
        graph, ev = self.ev.graph, self.ev
        sched = ev.evaluate(keep, early_prefetch=False).schedule
        at = {ins.op: i for i, ins in enumerate(sched.instrs) if ins.kind is Kind.RUN}  # op -> its RUN
        mem = static_memory(sched)
        instance = {buf: x for x, buf in enumerate(sched.instance_buffer)}
        born = [-1] * len(sched.instance_bytes)
        last_forward = [-1] * len(sched.instance_bytes)
        for i, ins in enumerate(sched.instrs):
            for x in ins.allocs:
                born[x] = i if born[x] < 0 else born[x]
            if graph.ops[ins.op].phase is Phase.FORWARD:
                for x in ins.allocs + ins.reads:
                    last_forward[x] = i
        span = []
        for act in graph.activations:
            x = instance[act.buffer]
            span.append((born[x], -1 if sched.persistent[x] else sched.last_reader[x],
                         max(last_forward[x], *(at[m] for m in act.members))))
        return sched, at, mem, span

    def _cuts(self, keep: Sequence[Decision]) -> tuple[list[Cut], list[Cut]]:
        """One cut per set of candidates in the forward and one in the backward: the op where the
        in-core plan exceeds the limit most; and, for :mod:`.lp` to time its copies at, the ops
        with that set where the excess first reaches each new high (it bounds when the D2H copies
        have ended: an earlier op with as much to evict is a stricter deadline) and, the mirror,
        where it last stands at each level (it bounds when the prefetches may start: a later op
        with as much to evict holds them back longer). Every cut holds on its own.

        A forward and a backward op may have the same candidates (everything saved, around the
        loss), but not the same deadlines: they are cut apart."""
        graph, ev = self.ev.graph, self.ev
        _, at, mem, span = self._layout(keep)
        acts = graph.activations
        prefix = [0.0]
        for t in ev.problem.costs.op_time:
            prefix.append(prefix[-1] + t)
        forward_end = max(stop for _, stop in graph.forward_range)
        base = graph.resident_bytes - ev.problem.mem_limit
        every: dict[tuple[bool, tuple[int, ...]], list[Cut]] = {}  # per candidate set, in program order
        for c in range(len(graph.ops)):
            i = at[c]
            backward = c >= forward_end
            live = [a for a in range(len(acts)) if span[a][0] <= i <= span[a][1]]
            if backward:
                cand = tuple(a for a in live if self.first_reader[a] is not None and self.first_reader[a] > c)
                slack = sum(max(0, self.nbytes[a] - acts[a].transfer_bytes) for a in live if acts[a].swappable)
            else:
                cand = tuple(a for a in live if span[a][2] < i)
                slack = 0
            # mem[i] holds the op's own scratch (StepGraph.op_scratch), as every plan does while it runs
            excess = int(base + mem[i] - slack)
            if excess <= 0:
                continue
            between = prefix[forward_end] - prefix[c] if not backward else 0.0
            cut = Cut(c, backward, prefix[c], between, prefix[-1] - prefix[c] - between, excess, cand)
            key = (backward, cand)  # a forward and a backward cut may evict the same set, by different times
            every.setdefault(key, []).append(cut)
        rising = [_new_highs(cuts) for cuts in every.values()]  # the worst cut (the first at its level) last
        chosen = [highs[-1] for highs in rising]
        falling = [cut for cuts in every.values() for cut in _new_highs(cuts[::-1])]
        most = {cut.op for cut in chosen}
        timing = {cut.op: cut for cut in sorted([*(c for highs in rising for c in highs), *falling],
                                                key=lambda cut: cut.op) if cut.op not in most}
        return chosen, list(timing.values())

    def rebuild(self, a: int, recomputable: Sequence[float]) -> tuple[int, set[int]]:
        """While a chain rebuilds activation ``a`` at its first reader: the device bytes it holds
        beyond the in-core plan's memory before that reader's group, at the op of ``a``'s shortest
        chain where they are largest, and the other activations on the device then.

        At each op of the shortest chain (every chain that rebuilds ``a`` runs it), the buffers it
        and the chain's earlier ops allocate that a later op of it reads, and ``a``'s new storage
        once allocated, count (not other activations' storages, which the in-core plan holds
        too); ``a`` itself is among the evicted there. On the device then: the activations that op
        reads, and those the chain reads that cannot be recomputed (kept, or brought back before
        the chain; a recomputable one read earlier may be rebuilt and freed before, when chains
        are not shared). ``recomputable``: ``recompute_costs`` of nothing decided."""
        graph, owner = self.ev.graph, self.ev.owner
        act = graph.activations[a]
        chain = sorted(chain_ops(graph, a, lambda c: False, owner, strict=False))
        stored = {x.buffer for x in graph.activations} - {act.buffer}
        last = {}
        for o in chain:
            for b in graph.recompute_read_buffers[o]:
                last[b] = o
        live: dict[int, int] = {}
        best, at = 0, act.producer
        for o in chain:
            live.update((b, graph.buffers[b].nbytes) for b in graph.recompute_allocs[o] if b not in stored)
            held = sum(live.values())
            if held > best:
                best, at = held, o
            for b in [b for b in live if last.get(b, -1) <= o and b != act.buffer]:
                del live[b]
        inputs = {owner[v] for o in chain for v in graph.ops[o].recompute_args if v in owner} - {a}
        direct = {owner[v] for v in graph.ops[at].recompute_args if v in owner} - {a}
        return best, direct | {c for c in inputs if recomputable[c] == math.inf}

    def rebuild_points(self) -> list[RebuildPoint]:
        """Per backward op ``u`` that first reads a recomputable activation: the point just before
        ``u`` and its group (prefetches, waits, recomputes). See ``lp``'s module docstring."""
        graph, ev = self.ev.graph, self.ev
        keep = ev.all_keep()
        sched, at, mem, span = self._layout(keep)
        acts = graph.activations
        recomputable = self.recompute_costs([None] * len(acts))
        by_reader: dict[int, list[int]] = {}
        for a, u in enumerate(self.first_reader):
            if u is not None and recomputable[a] < math.inf:
                by_reader.setdefault(u, []).append(a)
        base = graph.resident_bytes - ev.problem.mem_limit
        out = []
        for u, rebuilt in sorted(by_reader.items()):
            i = at[u]
            # not u's scratch either (held while u runs, after its group); the scratch of the chain's
            # ops is left out of ``rebuild``: fewer bytes than a plan holds, so the bound stays valid
            before = int(mem[i]) - (sched.instr_scratch[i] if sched.instr_scratch else 0) - sum(
                sched.instance_bytes[x] for x in set(sched.instrs[i].allocs) if sched.first_alloc[x] == i)
            live = [a for a in range(len(acts)) if span[a][0] < i <= span[a][1]]
            held = [self.rebuild(a, recomputable) for a in rebuilt]
            read = set.intersection(*(inputs for _, inputs in held))  # on the device while it runs
            cand = tuple(a for a in live if self.first_reader[a] is not None and self.first_reader[a] >= u
                         and a not in read)
            slack = sum(max(0, self.nbytes[a] - acts[a].transfer_bytes) for a in live if acts[a].swappable)
            heads = tuple((a, nbytes, tuple(sorted(inputs & set(cand)))) for a, (nbytes, inputs) in zip(rebuilt, held))
            out.append(RebuildPoint(u, tuple(rebuilt), min(nbytes for nbytes, _ in held),
                                    int(base + before - slack), cand, heads))
        return out

    def cut_bound(self, cut: Cut, decided: Partial, recompute: Sequence[float]) -> float:
        """The cut's bound over every completion of ``decided`` (``recompute``: ``recompute_costs``)."""
        before, after, excess = cut.before, cut.after, cut.excess
        members = set(cut.candidates)
        optional = set()  # decided recomputes a shared segment may have rebuilt before a backward cut
        for a, d in enumerate(decided):
            if d is not Decision.RECOMPUTE:
                continue
            if cut.backward and self.first_reader[a] is not None and self.first_reader[a] <= cut.op:
                before += recompute[a]
            elif cut.backward:
                if a in members:
                    optional.add(a)
            elif a in members:  # evicted at the cut for sure
                excess -= self.nbytes[a]
                after += recompute[a]
            else:
                after += recompute[a]
        swap = [(self.d2h[a], self.h2d[a], self.nbytes[a], self.first_reader[a]) for a in cut.candidates
                if decided[a] in (None, Decision.SWAP) and self.d2h[a] < math.inf]
        rec = [(recompute[a], self.nbytes[a]) for a in cut.candidates
               if (decided[a] is None or a in optional) and recompute[a] < math.inf]
        dues = sorted({due for *_, due in swap})[:DEADLINES]
        return self._split_bound(before, cut.between, after, excess, tuple(swap), tuple(rec),
                                 tuple((k, self.suffix[k]) for k in dues))

    def bound(self, decided: Partial | None = None) -> float:
        """A lower bound on the step time of every fitting plan that agrees with ``decided``.

        Infinite when none fits. With nothing decided it bounds every plan.
        """
        self.evaluations += 1
        decided = [None] * len(self.nbytes) if decided is None else decided
        recompute = self.recompute_costs(decided)
        out = self.compute + sum(recompute[a] for a, d in enumerate(decided) if d is Decision.RECOMPUTE)
        for cut in self.cuts:
            if out == math.inf:
                break
            out = max(out, self.cut_bound(cut, decided, recompute))
        return out

    def keep_completion_is_bound(self, decided: Partial) -> bool:
        """Is the H2D order of the decided swaps the same in every completion of ``decided``?

        It is by first use; each decided swap's first use lies between the one the keep
        completion gives it and the earliest any completion could (chains through every
        undecided activation). The order is fixed when those intervals do not interleave.
        """
        swaps = [a for a, d in enumerate(decided) if d is Decision.SWAP and self.first_reader[a] is not None]
        if len(swaps) < 2:
            return True
        earliest = self._first_uses(decided, lambda d: d is None or d is Decision.RECOMPUTE)
        latest = self._first_uses(decided, lambda d: d is Decision.RECOMPUTE)
        spans = sorted((earliest.get(a, self.first_reader[a]), a, latest.get(a, self.first_reader[a])) for a in swaps)
        return all((hi, a) < (lo, b) for (_, a, hi), (lo, b, _) in zip(spans, spans[1:]))

    def _first_uses(self, decided: Partial, recomputed) -> dict[int, int]:
        """Swapped activation -> the earliest first reader of a recompute chain that reads it,
        chains passing through every activation for which ``recomputed(decision)`` holds."""
        graph, owner = self.ev.graph, self.ev.owner
        out: dict[int, int] = {}
        for b, d in enumerate(decided):
            if not recomputed(d) or self.first_reader[b] is None:
                continue
            seen = chain_ops(graph, b, lambda c: recomputed(decided[c]), owner, strict=False)
            for a in {owner[y] for o in seen for y in graph.ops[o].recompute_args if y in owner} - {b}:
                if decided[a] is Decision.SWAP:
                    out[a] = min(out.get(a, self.first_reader[a]), self.first_reader[b])
        return out


def lower_bound(ev: Evaluator) -> float:
    """A step time no fitting plan beats: the largest cut bound, at least the in-core compute."""
    return Bounds(ev).bound()


def _new_highs(cuts: Sequence[Cut]) -> list[Cut]:
    """Each of ``cuts`` whose excess is above every one's before it: in program order, the first op
    at each new high; in reverse, the last op at each level."""
    out: list[Cut] = []
    for cut in cuts:
        if not out or cut.excess > out[-1].excess:
            out.append(cut)
    return out
