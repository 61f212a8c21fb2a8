"""A linear-programming relaxation of the lower bound: the cuts of ``bounds`` solved together, on
one timeline, with the memory a recompute needs while it runs.

``Bounds.bound`` takes the largest of the cut bounds, each minimised on its own, so a plan near
the floor, which must evict at many cuts, is bounded by its single worst cut. Here every
activation gets one decision ``x_a^k + x_a^s + x_a^r = 1`` shared by all points, and each point
``p`` evicts fractions ``s_ap <= x_a^s``, ``r_ap <= x_a^r`` of its candidates. Any fitting plan
gives a feasible point (its decisions, its evictions, the times below, all 0/1 or its own), so
the minimum is a lower bound on its step time; :mod:`.milp` solves the same model with the
decisions and evictions integral (a stronger bound, still not the simulator).

**Points.** ``bounds``' cuts (the RUN of an op; a fitting plan has evicted ``e_c`` bytes there)
and, per backward op ``u`` that first reads a recomputable activation, the group of instructions
issued just before ``u`` (``Bounds.rebuild_points``). Let ``y_a`` say that recomputed ``a`` is
not present when ``u = first reader of a`` starts its group (it was not rebuilt by an earlier
chain). Then a chain is emitted at ``u`` for some head ``h`` first read by ``u``, and while ``h``'s
producer runs again (instant ``τ``) the device holds the in-core memory before ``u`` less the
activations absent at ``τ``, plus ``h``'s new storage and the buffers only the chain makes
(``Bounds.rebuild``, at the op of its chain where they are most; ``h`` is among the evicted). So the
evictions at ``τ`` are at least ``excess_u + min rebuild bytes`` whenever ``y_a = 1`` for an ``a``
first read by ``u``, none of them the swap of an activation ``u`` reads or ``a``'s shortest chain
reads: its prefetch was issued by the group's start (at its first use or earlier) and it stays
until its last reader (``Families.rebuild_swaps``; HF GPT-2's attention scores read the query
and key, then the softmax, where the chain's bytes are most, reads neither). And ``x_a^r <= y_a +
sum y_b`` over the ``b`` first read earlier whose chains (through every recomputable activation)
reach ``a``'s producer: a recomputed ``a`` is rebuilt at its own first reader or inside the chain
of such a ``b``, itself a head there. And at a backward
cut before ``a``'s first reader, a recomputed candidate ``a`` is evicted (``r_ap >= x_a^r - sum
v``) unless a chain not its own rebuilt it by then, which ran the chain of one of its readers
(``chains.rebuilt_by``: the ``v``): the cut's time then bounds the chains that rebuild it.

**Time.** ``θ_p`` is the compute stream's time at point ``p`` (for a rebuild point, where ``u``'s
group starts). In program order ``θ_q >= θ_p + compute between``. At a cut, the D2H copies of
the evicted swaps ended by ``θ_p``; the D2H stream runs them one at a time in producer order,
each no earlier than its producer ends: ``F_j >= F_{j-1} + d_j s_jp``, ``F_j >= release_j +
d_j s_jp``, ``θ_p >= F_last`` (a subset of a FIFO stream's jobs ends no earlier alone). Their
prefetches are issued after ``p`` (after the forward for a forward cut), so the H2D stream, in
first-reader order, has ``E_j >= E_{j-1} + h_j s_jp`` from ``θ_p + G_p``, and compute reaches
each first reader ``k`` only after: ``T >= E_j + tail_k``, and the next point after ``k`` starts
no earlier than ``E_j`` plus the compute in between. The evicted recomputes run after ``p`` and
before their first reader: ``T >= θ_p + tail_p + sum r_a r_ap`` and likewise up to the next
point after each first reader. ``T >= compute + sum r_a x_a^r``. (``r_a`` as in
``Bounds.recompute_costs``: shared segments are not counted twice.)

**Covers.** An evictee is whole: at each point, a candidate without which the others fall short
of the bytes to evict is evicted (where a rebuild point's head is rebuilt there), and so are at
least as many candidates as the largest ones that cover them (``Families.covers``).

**Near the floor**: the families of :mod:`.floor` (``Families``; each holds for every fitting
plan's point, so the bound stays valid with any of them, and with fewer points: a large graph's
model keeps the cuts alone, with the recomputes' chain work or without, :data:`FALLBACKS`).

**Scratch.** The memory an op takes inside itself (``StepGraph.op_scratch``) is in ``M_c`` at a
cut (every plan holds the op's scratch while it runs) and left out at a rebuild point (neither
``u``'s nor the chain's): bytes a plan holds that the model does not ask for only relax it, so the
bound stays valid (and :mod:`.milp`'s with it).

Solved by HiGHS through ``scipy.optimize`` (an optional dependency, ``pip install fxpooch[lp]``);
without scipy the cut bound is returned.
"""
from __future__ import annotations

import bisect
import functools
import logging
import math
from dataclasses import dataclass, replace

from ..segments import chain_inputs, chain_ops
from .bounds import Bounds
from .common import Evaluator
from .chains import chain_readers, chain_sharing, rebuilt_by
from .floor import chain_deadlines, chain_work, covers, read_before_chains, read_by_chains, streams
from .issue_order import issue_order
from .lpmodel import IPM_FROM, MAX_NONZEROS, MIP_REL_GAP, Model, ModelTooLarge, solve  # noqa: F401 (the callers' names)
from .probing import probe

log = logging.getLogger("fxpooch.planner.lp")

#: nonzeros past which probing's model is not built (about 240 bytes a nonzero while built: GPT-2
#: 6L with every family is 10M nonzeros and 2.5 GB)
PROBE_NONZEROS = 16_000_000


@dataclass(frozen=True)
class _Point:
    op: int
    group: bool  # a rebuild point (before ``op``'s group) rather than a cut (``op``'s RUN)
    forward: bool
    excess: int
    candidates: tuple[int, ...]
    rebuilt: tuple[int, ...] = ()
    rebuild: int = 0
    heads: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def key(self) -> tuple[int, int]:
        return self.op, 0 if self.group else 1


@dataclass(frozen=True)
class Families:
    """Which families of inequalities near the floor (:mod:`.floor`) the model has: all
    by default; fewer only to measure what each adds."""

    cut_ends: bool = True  # the first and last cut of each candidate set; prefetches after a cut's op
    streams: bool = True  # every swap's two copies, evicted at a point or not
    chain_reads: bool = True  # a swap read by a recompute chain is on the device from then on
    head_reads: bool = True  # at a rebuild point, each head's own chain bytes and inputs
    fifo_cuts: bool = True  # an evicted swap's offload ends by the cut behind every earlier offload
    chain_work: bool = True  # every op of a recomputed activation's shortest chain runs, after each point it is evicted at
    chain_deadlines: bool = True  # a swap read by a recompute chain is back before the chain runs
    issue_order: bool = True  # prefetches leave in the order they are first needed (issue_order.py)
    covers: bool = True  # the candidates every cover of a point's bytes needs, and how many it needs
    timing_cuts: bool = True  # with cut_ends: the first and last cut of each candidate set are points too
    rebuild_points: bool = True  # the points where a recompute runs (its first reader's group)
    rebuild_swaps: bool = True  # at a rebuild point, the swaps its op or a head's shortest chain reads are back

    @classmethod
    def none(cls) -> Families:
        """The model without any of them: its points' memory and the rebuilds."""
        return cls(**{f: f == "rebuild_points" for f in cls.__dataclass_fields__})


#: the families whose size grows as the points times their candidates, as the model without them
#: does (the others grow about as activations^3): what a large graph's bound falls back to
CORE = Families(chain_reads=False, chain_work=False, chain_deadlines=False, issue_order=False)
#: :data:`CORE` on the cuts alone: near the floor the other points add little (GPT-2 6L's PCIe3
#: floor: 1.250x in-core in 80 s, 1.253x in 405 s with the timing cuts; the rebuild points add
#: nothing there, nor at 2L's, 1.337x either way)
LARGE = Families(chain_reads=False, chain_work=False, chain_deadlines=False, issue_order=False,
                 timing_cuts=False, rebuild_points=False)
#: :data:`LARGE` with the work of each recomputed activation's chain after each point that evicts
#: it (``chain_work``): at the floors measured it is smaller than :data:`CORE` (but at GPT-2 6L's,
#: 2.8M nonzeros against 2.2M) and its MILP tighter (h100-pcie5: test:cnn_bn 1.464x in-core
#: against 1.356x, test:resnet_small 1.730x against 1.700x, test:transformer_block 1.149x against
#: 1.130x; GPT-2 2L's PCIe3 floor 1.077x, the MILP with every family, in 53k nonzeros against
#: 233k, where both LARGE and CORE stop at 1.042x; at 6L's, 1.189x after 600 s against LARGE's
#: 1.111x, ``local`` 1.199x)
CUT_CHAINS = replace(LARGE, chain_work=True)
#: what :func:`probed_relaxation` builds, in order, where the model asked for is too large
FALLBACKS = (CUT_CHAINS, CORE, LARGE)
#: the model probing solves (:mod:`.probing`): the points' memory, the rebuilds and the chain
#: reads, which keep a recompute whose chain reads swaps out of a point just after its reader
#: where the swaps' bytes do not fit (HF GPT-2 at 2 layers at its PCIe3 floor: the attention's
#: dropout output, whose chain reads the query and key, back on the device through the softmax's
#: backward; the bound on the cuts alone 1.337x -> 1.418x in-core)
PROBING = replace(Families.none(), chain_reads=True, rebuild_swaps=True)


def relaxation(bounds: Bounds, families: Families = Families(), max_nonzeros: int | None = None) -> Model:
    """The model of the module docstring for ``bounds``' problem; :class:`ModelTooLarge` past
    ``max_nonzeros``."""
    ev = bounds.ev
    graph, costs = ev.graph, ev.problem.costs
    acts = graph.activations
    n = len(acts)
    unit = bounds.compute or 1.0  # times in units of the step's compute: HiGHS's tolerances are absolute
    rec = [t / unit for t in bounds.recompute_costs([None] * n)]
    d2h, h2d = [t / unit for t in bounds.d2h], [t / unit for t in bounds.h2d]
    prefix = [0.0]
    for t in costs.op_time:
        prefix.append(prefix[-1] + t / unit)
    forward_end = max(stop for _, stop in graph.forward_range)
    suffix = [t / unit for t in bounds.suffix]
    model = Model(unit=unit, max_nonzeros=max_nonzeros)
    x = model.decisions = {(d, a): model.var(1.0, True) for a in range(n) for d in "ksr"}
    for a in range(n):
        model.eqs.append(([(x[(d, a)], 1.0) for d in "ksr"], 1.0))
        if d2h[a] == math.inf:
            model.hi[x[("s", a)]] = 0.0
        if rec[a] == math.inf:
            model.hi[x[("r", a)]] = 0.0

    timing = bounds.timing_cuts if families.cut_ends and families.timing_cuts else []
    points = [_Point(c.op, False, not c.backward, c.excess, c.candidates) for c in bounds.cuts + timing]
    for rp in bounds.rebuild_points() if families.rebuild_points else ():
        if rp.excess + max(nbytes for _, nbytes, _ in rp.heads) > 0:
            points.append(_Point(rp.op, True, False, rp.excess, rp.candidates, rp.rebuilt, rp.rebuild, rp.heads))
    points.sort(key=lambda p: p.key)
    keys = [p.key for p in points]
    theta = [model.var() for _ in points]

    def at_or_after(op: int) -> int | None:
        """The first point at or after ``op``'s RUN."""
        i = bisect.bisect_left(keys, (op, 1))
        return i if i < len(points) else None

    def last_before_end_of(op: int) -> int | None:
        """The last point at or before ``op``'s RUN (``op`` ends after it)."""
        i = bisect.bisect_right(keys, (op, 1)) - 1
        return i if i >= 0 else None

    for i, p in enumerate(points):
        if i == 0:
            model.ge([(theta[i], 1.0)], prefix[p.op])
        else:
            model.ge([(theta[i], 1.0), (theta[i - 1], -1.0)], prefix[p.op] - prefix[points[i - 1].op])

    # y_a: recomputed a absent when its first reader's group starts
    y = {a: model.var(1.0, True) for a in range(n) if rec[a] < math.inf and bounds.first_reader[a] is not None}
    heads: dict[int, list[int]] = {}  # a -> the b whose chains may rebuild a before its first reader
    for a, ya in y.items():
        model.ge([(x[("r", a)], 1.0), (ya, -1.0)], 0.0)
        producer = acts[a].producer
        heads[a] = [b for b in y if bounds.first_reader[b] < bounds.first_reader[a]
                    and producer in chain_ops(graph, b, lambda c: True, ev.owner, strict=False)]
        model.ge([(ya, 1.0), *((y[b], 1.0) for b in heads[a]), (x[("r", a)], -1.0)], 0.0)
    sigma, reruns = chain_sharing(bounds, model, x, y, rec)
    readers = chain_readers(bounds, model, x, rec)
    if not families.chain_work:
        model.ge([(0, 1.0)] + [(x[("r", a)], -rec[a]) for a in range(n) if rec[a] < math.inf]
                 + [(z, -cost) for _, z, cost in reruns], 1.0)

    inputs_of = functools.cache(lambda a: frozenset(chain_inputs(graph, a, ev.owner)))
    evicted_swap: dict[tuple[int, int], int] = {}  # (point, activation) -> s_ap
    evicted_recompute: dict[tuple[int, int], int] = {}  # (point, activation) -> r_ap
    deadlines = chain_deadlines(bounds, model, x, rec) if families.chain_deadlines else {}
    h2d_chains: list[tuple[float, list[tuple[int, int, int, int]]]] = []  # per point: start, (k, a, s_ap, E)
    for i, p in enumerate(points):
        model.op = p.op
        s_vars, r_vars = [], []
        may = None if p.forward or p.group else rebuilt_by(readers, bounds.first_reader, x, p.op)
        for a in p.candidates:
            # a swap first read by a rebuild point's op was prefetched by its group's start
            if d2h[a] < math.inf and not (p.group and families.rebuild_swaps and bounds.first_reader[a] == p.op):
                j = model.var(1.0, True)
                model.ge([(x[("s", a)], 1.0), (j, -1.0)], 0.0)
                s_vars.append((a, j))
                evicted_swap[(i, a)] = j
            if rec[a] < math.inf:
                j = model.var(1.0, True)
                model.ge([(x[("r", a)], 1.0), (j, -1.0)], 0.0)
                if not p.forward and a in y:  # absent here: not rebuilt yet by its own chain or one that runs later
                    later = [y[b] for b in heads[a] if (bounds.first_reader[b], 0) >= p.key]
                    model.ge([(y[a], 1.0), *((yb, 1.0) for yb in later), (j, -1.0)], 0.0)
                if may is not None and bounds.first_reader[a] is not None and bounds.first_reader[a] > p.op:
                    model.ge([(j, 1.0), (x[("r", a)], -1.0), *((v, 1.0) for v in may(a))], 0.0)  # absent unless rebuilt
                r_vars.append((a, j))
                evicted_recompute[(i, a)] = j
        if p.group:
            for a, nbytes, held in p.heads if families.head_reads else ((a, p.rebuild, ()) for a in p.rebuilt):
                # where a chain rebuilds a in this group (y_a), the swaps a's shortest chain reads
                # are on the device from the group's start; with head_reads, a's own chain holds
                # ``nbytes`` with its ``held`` inputs (recomputed or not) on the device
                back = inputs_of(a) if families.rebuild_swaps else frozenset()
                evicted = [(b, j) for b, j in s_vars if b not in back] + r_vars
                model.ge([*((j, float(bounds.nbytes[b])) for b, j in evicted if b not in held),
                          (y[a], -float(p.excess + nbytes))], 0.0)
                if families.covers:
                    covers(model, bounds, evicted, p.excess + nbytes, y[a], set(held))
        else:
            model.ge([(j, float(bounds.nbytes[a])) for a, j in s_vars + r_vars], p.excess)
            if families.covers:
                covers(model, bounds, s_vars + r_vars, p.excess, None)
        # D2H: the evicted swaps' copies end by θ (at a cut; a rebuild point's evictions are later)
        if not p.group:
            prev = None
            for a, j in sorted(s_vars, key=lambda t: (max(acts[t[0]].members), t[0])):
                f = model.var()
                m = max(acts[a].members)
                k = last_before_end_of(m)
                if k is None or k >= i:
                    model.ge([(f, 1.0), (j, -d2h[a])], prefix[m + 1])
                else:
                    model.ge([(f, 1.0), (theta[k], -1.0), (j, -d2h[a])], prefix[m + 1] - prefix[points[k].op])
                if prev is not None:
                    model.ge([(f, 1.0), (prev, -1.0), (j, -d2h[a])], 0.0)
                prev = f
            if prev is not None:
                model.ge([(theta[i], 1.0), (prev, -1.0)], 0.0)
        # H2D: from the end of the forward (a forward cut) or θ, in first-reader order
        # a backward cut's evictees are not on the device while its op runs: their prefetches are
        # issued after it ends
        ends = not p.group and families.cut_ends
        between = prefix[forward_end] - prefix[p.op] if p.forward else costs.op_time[p.op] / unit if ends else 0.0
        prev = None
        h2d_chains.append((between, []))
        for a, j in sorted(s_vars, key=lambda t: (bounds.first_reader[t[0]], t[0])):
            k = bounds.first_reader[a]
            if k is None:
                continue
            e = model.var()
            h2d_chains[-1][1].append((k, a, j, e))
            model.ge([(e, 1.0), (prev if prev is not None else theta[i], -1.0), (j, -h2d[a])],
                     0.0 if prev is not None else between)
            model.ge([(0, 1.0), (e, -1.0)], suffix[k])
            q = at_or_after(k)
            if q is not None and q > i:
                model.ge([(theta[q], 1.0), (e, -1.0)], prefix[points[q].op] - prefix[k])
            prev = e
        # recomputes: after θ, each before its first reader (with chain_work, its stronger chain instead)
        prev = None
        for a, j in sorted(r_vars, key=lambda t: (bounds.first_reader[t[0]] or 0, t[0])) if not families.chain_work else ():
            if bounds.first_reader[a] is None:
                continue
            r = model.var()
            model.ge([(r, 1.0), (j, -rec[a])] + ([(prev, -1.0)] if prev is not None else []), 0.0)
            q = at_or_after(bounds.first_reader[a])
            if q is not None and q > i:
                model.ge([(theta[q], 1.0), (theta[i], -1.0), (r, -1.0)], prefix[points[q].op] - prefix[p.op])
            prev = r
        model.ge([(0, 1.0), (theta[i], -1.0)] + ([(prev, -1.0)] if prev is not None else []), suffix[p.op])
    model.op = None
    if deadlines:
        read_before_chains(bounds, model, x, points, theta, prefix, suffix, h2d, h2d_chains, deadlines)
    if families.streams:
        ends, prefetched = streams(bounds, model, x, points, theta, prefix, suffix, d2h, h2d, deadlines)
        if families.issue_order:
            issue_order(bounds, model, x, points, theta, [start for start, _ in h2d_chains], evicted_swap,
                        prefetched, prefix, suffix, d2h, h2d, rec, deadlines)
        if families.fifo_cuts:
            for (i, a), j in evicted_swap.items():  # evicted at a cut: its offload and the earlier ones ended
                if not points[i].group and a in ends:
                    f, upper = ends[a]
                    model.ge([(theta[i], 1.0), (f, -1.0), (j, -upper)], -upper)
    if families.chain_reads:
        read_by_chains(bounds, model, x, points, evicted_swap, rec)
    if families.chain_work:
        chain_work(bounds, model, x, points, theta, prefix, suffix, evicted_recompute, sigma, reruns, rec)
    return model


def probed_relaxation(bounds: Bounds, families: Families = Families(), max_nonzeros: int | None = None,
                      ruled_out: frozenset[int] | None = None) -> Model:
    """:func:`relaxation`'s model with ``families``, or where it would pass ``max_nonzeros`` the
    first of :data:`FALLBACKS` that does not, with the recomputes ``ruled_out`` fixed at 0
    (default: :func:`not_recomputable`'s); :class:`ModelTooLarge` where every one would pass it."""
    n = len(bounds.ev.graph.activations)
    for tried in dict.fromkeys((families, *FALLBACKS)):
        try:
            model = relaxation(bounds, tried, max_nonzeros)
            break
        except ModelTooLarge as e:
            log.info("LP relaxation: %s (%d activations); fewer families", e, n)
    else:
        raise ModelTooLarge(f"more than {max_nonzeros} nonzeros")
    for a in not_recomputable(bounds) if ruled_out is None else ruled_out:
        model.hi[model.decisions[("r", a)]] = 0.0
    return model


def not_recomputable(bounds: Bounds) -> frozenset[int]:
    """The activations no fitting plan recomputes, by :func:`.probing.probe` on :data:`PROBING`'s
    model (built up to :data:`PROBE_NONZEROS`; past it, none)."""
    try:
        bare = relaxation(bounds, PROBING, PROBE_NONZEROS)
    except ModelTooLarge as e:
        log.info("probing: %s (%d activations); no recompute ruled out", e, len(bounds.ev.graph.activations))
        return frozenset()
    fixed = set(probe(bare, bounds))
    return frozenset(a for (d, a), j in bare.decisions.items() if d == "r" and j in fixed)


def probed_cut_bound(bounds: Bounds) -> tuple[float, frozenset[int]]:
    """The cut bound with the recomputes :func:`not_recomputable` rules out taken as not
    recomputable (``Bounds(not_recomputed=...)``; at GPT-2 6L's PCIe3 floor 1.069x -> 1.158x
    in-core), and those recomputes. Where the cut bound alone says no plan fits, it alone."""
    cut_bound = bounds.bound()
    if cut_bound == math.inf:
        return cut_bound, frozenset()
    ruled_out = not_recomputable(bounds)
    return (max(cut_bound, Bounds(bounds.ev, ruled_out).bound()) if ruled_out else cut_bound), ruled_out


def lp_lower_bound(ev: Evaluator, max_nonzeros: int | None = MAX_NONZEROS) -> float:
    """The LP relaxation's bound after probing (:mod:`.probing`), never below
    :func:`probed_cut_bound`: that one is kept when larger, and returned alone where the LP fails
    or would pass ``max_nonzeros`` (GPT-2 from 12 layers on, ResNet-50). Probing comes first and
    takes minutes on such graphs (454 CPU s at GPT-2 12L's PCIe3 floor, whose probing model has
    11.9M nonzeros, 6L's 1.8M: at 24 layers it would pass :data:`PROBE_NONZEROS`). Without
    scipy, the cut bound (``bounds.lower_bound``)."""
    bounds = Bounds(ev)
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        log.info("scipy is not installed: the cut bound only")
        return bounds.bound()
    cut_bound, ruled_out = probed_cut_bound(bounds)
    if cut_bound == math.inf:
        return cut_bound
    try:
        model = probed_relaxation(bounds, max_nonzeros=max_nonzeros, ruled_out=ruled_out)
    except ModelTooLarge as e:
        log.warning("LP relaxation: %s (%d activations); the cut bound after probing only", e,
                    len(ev.graph.activations))
        return cut_bound
    res = solve(model)
    if res.status == 2:  # infeasible: no split of the evictions meets every point
        return math.inf
    if res.status != 0:
        log.warning("LP relaxation: %s; the cut bound after probing only", res.message)
        return cut_bound
    return max(cut_bound, float(res.fun) * model.unit)
