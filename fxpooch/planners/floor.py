"""Valid inequalities of :func:`.lp.relaxation`'s model near the floor, where a plan must evict at
many points at once and the copy streams and the recompute chains, not the compute, set the step
time. Each holds at the point every fitting plan gives the model (see :mod:`.lp`), so the LP's and
the MILP's bounds stay lower bounds with any of them (``lp.Families`` picks them):

* *Cut ends.* Besides the cut where the in-core plan exceeds the limit most, each candidate set
  also gets the ops where the excess first reaches each new high, and those where it last stands
  at each level (``Bounds.timing_cuts``; every cut holds on its own): the rising ones bound when
  the D2H copies must have ended (at GPT-2's loss, the first backward op must already have
  evicted 1.7 of the 1.9 GiB the worst cut, two matmuls later, asks for), the falling ones when
  the prefetches may start (test:resnet_small at its NVLink2 floor: a conv's backward and the add
  after it need as much evicted as the worst cut, three ops after it; without the add, a
  prefetch the add holds back seemed to overlap both). And an activation evicted at a backward cut is not on the device while
  the cut's op runs, so its prefetch (an instruction of the compute stream, allocating when
  issued) is issued after that op *ends*: the H2D chain of a backward cut starts at
  ``θ_p + t_p``, not ``θ_p``.
* *Streams.* Every swap's copies, evicted at a point or not. Offloads are issued after their
  producers in program order, so in producer order the D2H stream's time ``F_j >= F_{j-1} +
  d_j x_j^s`` and ``F_j >= release_j + d_j x_j^s``; a prefetch starts after its own offload ended
  (the simulator's ``d2h_end``), so with ``U_j`` the D2H time if every earlier activation were
  swapped (no minimal ``F_j`` exceeds it), ``G_j >= F_j + h_j x_j^s - U_j (1 - x_j^s)`` is a
  swapped ``j``'s prefetch end, and compute runs ``j``'s first reader ``k`` after it: ``T >= G_j +
  tail_k``, the first point after ``k`` no earlier than ``G_j`` plus the compute in between. Every
  prefetch is issued after the forward ends (``φ``, at least every forward point's ``θ`` plus
  the forward compute after it), so the copies of the swaps first read by ``k`` or earlier, in
  whatever order the H2D stream runs them, end no earlier than ``φ`` plus their sum, and compute
  reaches ``k`` after that. A swap ``j`` evicted at a cut ``p`` has ended its offload, and so
  every offload before it, by then: ``θ_p >= F_j - U_j (1 - s_jp)`` (``Families.fifo_cuts``).
* *Chain reads.* A recompute chain that reads a swapped activation ``d`` makes it issue ``d``'s
  (single) prefetch before that chain (``build_schedule``: a swap's first use is the earliest
  chain that reads it), and ``d`` then stays on the device until its last reader. Every chain
  that rebuilds ``c`` runs ``c``'s shortest chain (its ops with every other activation
  available), which reads ``c``'s inputs; an input that is recomputed is rebuilt by then too (by
  the same chain, or earlier and still held). So with ``q_bb = x_b^r`` and ``q_bc' >= q_bc +
  x_c'^r - 1`` for ``c'`` an input of ``c``'s shortest chain (``q_bc = 1``: ``c``'s shortest chain
  ran by ``b``'s first reader), a swapped input ``d`` of ``c`` is on the device at every
  backward point from ``b``'s first reader's RUN on: ``s_dp + q_bc <= 1`` (at a rebuild point
  of ``b``'s own first reader only when ``b``'s chain ran first, which is not known: left out).
* *Head reads* (in :func:`.lp.relaxation`'s rebuild points). The rebuild point of ``u`` bounds
  the evictions when *some* head's chain runs there by the least ``Bounds.rebuild`` bytes over
  the heads first read by ``u``, over the candidates none of their chains reads. Per head ``a``
  instead: if ``y_a = 1``, ``a``'s chain runs in ``u``'s group, and at its op where its buffers
  are most it holds ``Bounds.rebuild(a)`` bytes with the inputs that op reads (and the chain's
  unrecomputable inputs) on the device; the group issues no RUN, so nothing is freed in it and
  what is absent then was absent at the group's start (the point's evictions). So the point's
  evictions outside ``a``'s held inputs cover ``excess + rebuild(a)`` whenever ``y_a = 1``.
* *Chain work.* Every chain that rebuilds ``a`` runs each op of ``a``'s shortest chain (``chain_ops``
  with every other activation available), and a shared segment runs an op once for all it
  rebuilds: so the step runs each op ``o`` in the shortest chain of some recomputed activation,
  ``T >= compute + sum_o t_o u_o`` with ``u_o >= x_a^r`` for each such ``a``, plus the reruns of the
  chains apart (``z_ac``; :func:`.chains.chain_sharing`). This is the recompute term of the
  model's whole step, tighter than the costs of ``Bounds.recompute_costs``, which give an op to
  the lowest-numbered activation whose chain has it, recomputed or not (a conv's batch norm
  counted for its statistics, a small activation kept, and never for the large one recomputed).
  An op in the shortest chains of two recomputed activations computes no saved value (a chain
  stops at those), so no chain reuses another's output of it: it runs once in every chain that
  rebuilds one of them. Where no chain of ``a`` can rebuild ``b`` (``b``'s members are not in
  what ``a``'s chains may run, :func:`.chains.reach`), a chain that rebuilds both is not ``a``'s own,
  and a chain reaches ``a``'s members only through an op that reads them, in the shortest chain
  of a recomputed activation ``c`` that reads ``a``. So ``e_o >= x_a^r + x_b^r - 1 - sum x_c^r``
  over those readers ``c`` counts ``o``'s second run (a batch norm run again for its statistics
  after the chain of the conv after its ReLU ran it).
  And the same after each point ``p``: what is evicted there is rebuilt after ``θ_p``, so ``T >=
  θ_p + tail_p + sum_o t_o v_op`` with ``v_op >= r_ap`` over the evicted ``a`` whose shortest chain
  has ``o``. Apart, ``a``'s own chain runs at its first reader, rerunning the chains
  of the recomputed activations it reads, so each ``z_ac`` adds its seconds there too once ``a``
  is evicted at ``p`` (``w >= z_ac + r_ap - 1``): a prefetch stall before ``p`` then delays them all.
  In first-reader order too: the chain of each evictee ``a`` runs before ``a``'s first reader, so
  the first point from it on starts no earlier than ``θ_p`` plus those chains and the compute
  between; shared, ``a`` counts ``Bounds.recompute_costs``'s seconds, apart (``u >= r_ap +
  sigma_a - 1``) its whole shortest chain and its reruns.
* *Chain deadlines.* A swapped ``d`` that the shortest chain of a recomputed ``c`` reads is
  prefetched before the first chain that reads it (``build_schedule``), which runs by ``c``'s
  first reader: so compute reaches that reader only after ``d``'s prefetch and the ops of ``c``'s
  chain from the one that reads ``d`` on, ``T >= G_d + after_dc + tail(fr_c)`` where ``c`` is
  recomputed (with ``G_d`` of *Streams*). Per point ``p``, where ``d`` is evicted and ``c``
  recomputed (``w >= s_dp + x_c^r - 1``), ``d``'s prefetch comes after those of the evictees
  first read by ``fr_c`` or earlier (all are back by then), so ``E' >= E_(last of those) + h_d w``
  and compute reaches ``fr_c`` (and the first point after it) only after ``E' + after_dc w``.
  The same holds one link further: where ``c``'s shortest chain reads a recomputed ``b`` first
  read after ``c``, and ``b``'s reads ``d``, a chain that rebuilds ``b`` by ``fr_c`` reads ``d``
  (``c``'s own, or an earlier one), so with ``w`` 1 where ``c`` and ``b`` are recomputed (and
  ``d`` evicted at ``p``) ``d`` is back before ``fr_c`` less the ops of that longer chain from
  the read of ``d`` on.
"""
from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from ..segments import chain_inputs, chain_ops
from .bounds import Bounds
from .chains import chain_readers, reach

if TYPE_CHECKING:
    from .lp import Model, _Point


def streams(bounds: Bounds, model: Model, x: dict, points: list[_Point], theta: list[int],
             prefix: list[float], suffix: list[float], d2h: list[float], h2d: list[float],
             deadlines: dict[int, list[tuple[int, tuple[int, ...], float]]]) -> tuple[dict, dict]:
    """Every swap's two copies, evicted at a point or not (the module docstring, *Streams*).
    Returns per swappable activation ``j`` its ``F_j`` variable and ``U_j``, and per swappable
    activation read in the backward its ``G_j`` variable (its prefetch's end where swapped)."""
    graph = bounds.ev.graph
    acts = graph.activations
    forward_end = max(stop for _, stop in graph.forward_range)
    swaps = [a for a in range(len(acts)) if d2h[a] < math.inf and model.hi[x[("s", a)]] > 0]
    if not swaps:
        return {}, {}
    phi = model.var()  # when the forward's last op ends
    model.ge([(phi, 1.0)], prefix[forward_end])
    for i, p in enumerate(points):
        if p.forward:
            model.ge([(phi, 1.0), (theta[i], -1.0)], prefix[forward_end] - prefix[p.op])
    reaches = compute_after(model, points, theta, prefix, suffix)

    # D2H in producer order (offloads are issued after their producers, in program order)
    prev, upper = None, 0.0
    ends, prefetched = {}, {}
    for a in sorted(swaps, key=lambda a: (max(acts[a].members), a)):
        release = prefix[max(acts[a].members) + 1]
        f = model.var()
        model.ge([(f, 1.0), (x[("s", a)], -d2h[a])], release)
        if prev is not None:
            model.ge([(f, 1.0), (prev, -1.0), (x[("s", a)], -d2h[a])], 0.0)
        upper = max(upper, release) + d2h[a]  # no minimal D2H time exceeds it
        prev = f
        ends[a] = (f, upper)
        k = bounds.first_reader[a]
        if k is None:
            continue
        # swapped: a's prefetch starts after its offload ended and compute waits for it before k
        g = prefetched[a] = model.var()  # a's prefetch's end if swapped (else 0 at least)
        model.ge([(g, 1.0), (f, -1.0), (x[("s", a)], -(upper + h2d[a]))], -upper)
        reaches(k, g, 0.0)
        for c, needs, after in deadlines.get(a, ()):  # T >= g + after + tail(fr c) where needs are recomputed
            w = recomputed_all(model, x, needs)
            model.ge([(0, 1.0), (g, -1.0), (w, -(after + suffix[bounds.first_reader[c]] - suffix[k]))], suffix[k])
    # H2D: every prefetch is issued after the forward; those first read by k or earlier end
    # before k runs, in whatever order they were copied
    prev = phi
    for a in sorted((a for a in swaps if bounds.first_reader[a] is not None), key=lambda a: (bounds.first_reader[a], a)):
        e = model.var()
        model.ge([(e, 1.0), (prev, -1.0), (x[("s", a)], -h2d[a])], 0.0)
        reaches(bounds.first_reader[a], e, 0.0)
        prev = e
    return ends, prefetched


def compute_after(model: Model, points: list[_Point], theta: list[int], prefix: list[float], suffix: list[float]):
    """``reaches(k, done, extra)``: compute runs backward op ``k`` no earlier than ``done + extra``,
    and so does every later op (the step's end and the first point from ``k`` on)."""
    keys = [p.key for p in points]

    def reaches(k: int, done: int, extra: float) -> None:
        model.ge([(0, 1.0), (done, -1.0)], extra + suffix[k])
        q = bisect.bisect_left(keys, (k, 1))  # the first point at or after k's RUN
        if q < len(points):
            model.ge([(theta[q], 1.0), (done, -1.0)], extra + prefix[points[q].op] - prefix[k])
    return reaches


def read_by_chains(bounds: Bounds, model: Model, x: dict, points: list[_Point],
                    evicted_swap: dict[tuple[int, int], int], rec: list[float]) -> None:
    """A swap read by a chain is on the device from that chain on (the module docstring,
    *Chain reads*): ``s_dp + q_bc <= 1`` for ``d`` read by ``c``'s shortest chain."""
    graph, owner = bounds.ev.graph, bounds.ev.owner
    fr = bounds.first_reader
    n = len(graph.activations)
    recomputable = [rec[a] < math.inf and model.hi[x[("r", a)]] > 0 for a in range(n)]
    inputs = {c: chain_inputs(graph, c, owner) for c in range(n) if recomputable[c]}
    backward = sorted((p.op, i) for i, p in enumerate(points) if not p.forward)
    ops_of = [op for op, _ in backward]
    for b in range(n):
        if not recomputable[b] or fr[b] is None:
            continue
        # q[c]: c's shortest chain ran by b's first reader (b recomputed, and every activation on
        # a path of chain inputs from b to c recomputed)
        q = {b: x[("r", b)]}
        queue = [b]
        read: dict[int, list[int]] = {}  # swappable d -> the q of the chains that read it
        while queue:
            c = queue.pop(0)
            for d in inputs[c]:
                if recomputable[d] and d != b:
                    if d not in q:
                        q[d] = model.var(1.0)
                        queue.append(d)
                    model.ge([(q[d], 1.0), (q[c], -1.0), (x[("r", d)], -1.0)], -1.0)
                if model.hi[x[("s", d)]] > 0 and fr[d] is not None and fr[d] > fr[b]:
                    read.setdefault(d, []).append(q[c])
        for d, qs in read.items():
            rho = qs[0]
            if len(qs) > 1:
                rho = model.var(1.0)
                for qc in qs:
                    model.ge([(rho, 1.0), (qc, -1.0)], 0.0)
            # every point from b's first reader's RUN (after its group) until d's first reader
            for _, i in backward[bisect.bisect_left(ops_of, fr[b]):bisect.bisect_left(ops_of, fr[d])]:
                p = points[i]
                if (i, d) in evicted_swap and (p.op > fr[b] or not p.group):
                    model.op = p.op  # the point's row: probing keeps it with the point's
                    model.ge([(evicted_swap[(i, d)], -1.0), (rho, -1.0)], -1.0)
    model.op = None


def chain_work(bounds: Bounds, model: Model, x: dict, points: list[_Point], theta: list[int],
               prefix: list[float], suffix: list[float], evicted: dict[tuple[int, int], int], sigma: dict[int, int],
               reruns: list[tuple[int, int, float]], rec: list[float]) -> None:
    """The recompute work of the whole step and after each point (the module docstring, *Chain
    work*). ``evicted``: ``(point, activation) -> r_ap``; ``sigma``: per activation, its chain is apart;
    ``reruns``: ``(a, z_ac, seconds)``."""
    graph, owner = bounds.ev.graph, bounds.ev.owner
    op_time, fr = bounds.ev.problem.costs.op_time, bounds.first_reader
    keys = [p.key for p in points]
    shortest = {a: chain_ops(graph, a, lambda _: False, owner, strict=False)
                for a in range(len(graph.activations))
                if rec[a] < math.inf and model.hi[x[("r", a)]] > 0 and bounds.first_reader[a] is not None}
    readers = chain_readers(bounds, model, x, rec)
    may_run = {a: reach(graph, owner, a) for a in shortest}
    # (a, b): a's chain never rebuilds b, so a chain that rebuilds both is not a's own
    never_in = {(a, b) for a in shortest for b in shortest
                if a != b and not set(graph.activations[b].members) & may_run[a]}

    def union(chosen: dict[int, int]) -> list[tuple[int, float]]:
        """``-t_o * u_o`` per op in the shortest chain of an activation of ``chosen`` (its
        variable), and ``-t_o * e_o`` for a second run in another chain (the module docstring,
        *Chain work*)."""
        holders: dict[int, list[int]] = {}
        for a in chosen:
            for o in shortest[a]:
                holders.setdefault(o, []).append(a)
        terms = []
        for o, held in sorted(holders.items()):
            seconds = op_time[o] / model.unit
            if seconds <= 0:
                continue
            u = chosen[held[0]]
            if len(held) > 1:
                u = model.var(1.0)
                for a in held:
                    model.ge([(u, 1.0), (chosen[a], -1.0)], 0.0)
                e = model.var(1.0)
                for a in held:
                    for b in held:
                        if (a, b) in never_in:  # one chain rebuilds both: not a's, so a reader of a is recomputed
                            model.ge([(e, 1.0), (chosen[a], -1.0), (chosen[b], -1.0),
                                      *((x[("r", c)], 1.0) for c in readers.get(a, ()))], -1.0)
                terms.append((e, -seconds))
            terms.append((u, -seconds))
        return terms

    model.ge([(0, 1.0), *union({a: x[("r", a)] for a in shortest}),
              *((z, -seconds) for _, z, seconds in reruns)], 1.0)
    rerun_of: dict[int, list[tuple[int, float]]] = {}
    for a, z, seconds in reruns:
        rerun_of.setdefault(a, []).append((z, seconds))
    at: dict[int, dict[int, int]] = {}
    for (i, a), j in evicted.items():
        if a in shortest:
            at.setdefault(i, {})[a] = j
    for i, chosen in sorted(at.items()):
        own: dict[int, list[tuple[int, float]]] = {}  # a -> the w of its reruns, with their seconds
        for a, j in chosen.items():
            for z, seconds in rerun_of.get(a, ()):
                w = model.var(1.0)
                model.ge([(w, 1.0), (z, -1.0), (j, -1.0)], -1.0)
                own.setdefault(a, []).append((w, seconds))
        model.ge([(0, 1.0), (theta[i], -1.0), *union(chosen),
                  *((w, -seconds) for ws in own.values() for w, seconds in ws)], suffix[points[i].op])
        # by each evictee's first reader its recompute ran, and those of the evictees read
        # earlier: ``rec`` each where shared; apart, its whole shortest chain and its reruns
        prev = None
        for a in sorted(chosen, key=lambda a: (fr[a], a)):
            r = model.var()
            terms = [(r, 1.0), (chosen[a], -rec[a]), *(((prev, -1.0),) if prev is not None else ())]
            more = sum(op_time[o] for o in shortest[a]) / model.unit - rec[a]
            if more > 0:
                u = model.var(1.0)
                model.ge([(u, 1.0), (chosen[a], -1.0), (sigma[a], -1.0)], -1.0)
                terms.append((u, -more))
            terms.extend((w, -seconds) for w, seconds in own.get(a, ()))
            model.ge(terms, 0.0)
            q = bisect.bisect_left(keys, (fr[a], 1))
            if i < q < len(points):
                model.ge([(theta[q], 1.0), (theta[i], -1.0), (r, -1.0)], prefix[points[q].op] - prefix[points[i].op])
            prev = r
        if prev is not None:
            model.ge([(0, 1.0), (theta[i], -1.0), (prev, -1.0)], suffix[points[i].op])


def chain_deadlines(bounds: Bounds, model: Model, x: dict, rec: list[float]) -> dict[int, list[tuple[int, tuple[int, ...], float]]]:
    """Per swappable ``d``: ``(c, needs, seconds)`` for each recomputable ``c`` first read before
    ``d`` whose chain reads ``d`` once the activations of ``needs`` (``c`` first) are recomputed
    (the module docstring, *Chain deadlines*): its shortest chain, or that chain through a
    recomputed ``b`` it reads that is first read after ``c`` (rebuilt by ``c``'s chain, or by an
    earlier one that then read ``d`` earlier still); ``seconds``: the ops of that chain that read
    ``d``, and those after them in it."""
    graph, owner = bounds.ev.graph, bounds.ev.owner
    op_time, fr = bounds.ev.problem.costs.op_time, bounds.first_reader

    def recomputable(a: int) -> bool:
        return rec[a] < math.inf and model.hi[x[("r", a)]] > 0 and fr[a] is not None

    def swappable(d: int, c: int) -> bool:
        return model.hi[x[("s", d)]] > 0 and fr[d] is not None and fr[d] > fr[c]

    out: dict[int, list[tuple[int, tuple[int, ...], float]]] = {}

    def add(d: int, c: int, needs: tuple[int, ...], ops: list[int]) -> None:
        reached = set(graph.activations[d].members)
        after = 0.0
        for o in ops:  # program order: a chain op's arguments come before it
            if reached.intersection(graph.ops[o].recompute_args):
                reached.add(o)
                after += op_time[o] / model.unit
        out.setdefault(d, []).append((c, needs, after))

    for c in filter(recomputable, range(len(graph.activations))):
        ops = chain_ops(graph, c, lambda _: False, owner, strict=False)
        inputs = chain_inputs(graph, c, owner)
        for d in inputs:
            if swappable(d, c):
                add(d, c, (c,), sorted(ops))
        for b in inputs:
            if recomputable(b) and fr[b] > fr[c]:
                through = sorted(ops | chain_ops(graph, b, lambda _: False, owner, strict=False))
                for d in chain_inputs(graph, b, owner):
                    if swappable(d, c) and d not in inputs:
                        add(d, c, (c, b), through)
    return out


def recomputed_all(model: Model, x: dict, needs: tuple[int, ...], also: int | None = None) -> int:
    """A variable that is 1 where every activation of ``needs`` is recomputed (and the binary
    variable ``also`` is 1): ``w >= sum - (count - 1)``; the variable ``x_c^r`` itself for one."""
    terms = [x[("r", b)] for b in needs] + ([] if also is None else [also])
    if len(terms) == 1:
        return terms[0]
    w = model.var(1.0)
    model.ge([(w, 1.0), *((t, -1.0) for t in terms)], 1.0 - len(terms))
    return w


def read_before_chains(bounds: Bounds, model: Model, x: dict, points: list[_Point], theta: list[int],
                       prefix: list[float], suffix: list[float], h2d: list[float],
                       chains: list[tuple[float, list[tuple[int, int, int, int]]]],
                       deadlines: dict[int, list[tuple[int, tuple[int, ...], float]]]) -> None:
    """Per point, a swap ``a`` evicted there and read by the shortest chain of a recomputed ``c``
    first read earlier: its prefetch ends, after those of the point's evictees first read by
    ``c``'s first reader or earlier, before that chain reads it (the module docstring, *Chain
    deadlines*). ``chains``: per point, the start of its H2D chain after ``θ_p`` and the chain's
    ``(first reader, activation, s_ap, E)`` in first-reader order."""
    fr = bounds.first_reader
    keys = [p.key for p in points]
    for i, (start, chain) in enumerate(chains):
        readers = [k for k, *_ in chain]
        for _, a, j, _ in chain:
            for c, needs, after in deadlines.get(a, ()):
                if (fr[c], 1) <= keys[i]:
                    continue  # c's chains ran before the point: a stays on the device after them
                n = bisect.bisect_right(readers, fr[c])  # the evictees first read by fr[c] or earlier
                w = recomputed_all(model, x, needs, j)  # a evicted here and needs recomputed
                e = model.var()
                if n:
                    model.ge([(e, 1.0), (chain[n - 1][3], -1.0), (w, -h2d[a])], 0.0)
                else:
                    model.ge([(e, 1.0), (theta[i], -1.0), (w, -h2d[a])], start)
                model.ge([(0, 1.0), (e, -1.0), (w, -after)], suffix[fr[c]])
                q = bisect.bisect_left(keys, (fr[c], 1))
                if q < len(points):
                    model.ge([(theta[q], 1.0), (e, -1.0), (w, -after)], prefix[points[q].op] - prefix[fr[c]])


def covers(model: Model, bounds: Bounds, evictions: list[tuple[int, int]], need: int,
            indicator: int | None, held: set[int] = frozenset()) -> None:
    """A point's evictions (``(activation, s_ap or r_ap)``) cover ``need`` bytes where
    ``indicator`` is 1 (always if None): an evictee is whole, so each candidate without which the
    rest fall short is evicted, and at least as many candidates as the largest ones that cover it
    (the LP's fractions of many do not)."""
    by = {}
    for a, j in evictions:
        if a not in held:
            by.setdefault(a, []).append(j)
    sizes = sorted((bounds.nbytes[a] for a in by), reverse=True)
    total = sum(sizes)
    if need <= 0 or total < need:
        return
    lhs = [(indicator, -1.0)] if indicator is not None else []
    rhs = 0.0 if indicator is not None else 1.0
    for a, js in by.items():
        if total - bounds.nbytes[a] < need:
            model.ge([*((j, 1.0) for j in js), *lhs], rhs)
    count, acc = 0, 0
    for size in sizes:
        count, acc = count + 1, acc + size
        if acc >= need:
            break
    if count > 1:
        model.ge([*((j, 1.0) for js in by.values() for j in js),
                  *(((indicator, -float(count)),) if indicator is not None else ())], 0.0 if indicator is not None else float(count))
