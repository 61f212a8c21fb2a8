"""Recompute segments: which forward ops a recomputed activation's chain runs again, and where.

A chain rebuilds an activation from values the backward has (kept and swapped activations,
resident ones), running back through other recomputed activations. :func:`plan_recomputes` lays
the chains of a decision vector out as :func:`~fxpooch.schedule.build_schedule` runs them; the
schedule and :mod:`fxpooch.footprint` both read it, so the two cannot disagree.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from .graph import Phase, StepGraph
from .types import ActivationId, Decision, OpId


class NotRecomputable(Exception):
    """Internal: an activation's recompute chain reaches something unavailable or unsafe."""


def member_owner(graph: StepGraph) -> dict[int, ActivationId]:
    return {m: a for a, act in enumerate(graph.activations) for m in act.members}


def chain_inputs(graph: StepGraph, a: ActivationId, owner: dict[int, ActivationId]) -> list[ActivationId]:
    """The activations ``a``'s shortest recompute chain (every other activation available) reads
    from the device: every chain that rebuilds ``a`` runs those ops."""
    ops = chain_ops(graph, a, lambda _: False, owner, strict=False)
    return sorted({owner[v] for o in ops for v in graph.ops[o].recompute_args
                   if v in owner and v in graph.saved and v not in ops} - {a})


def recompute_chain(graph: StepGraph, a: ActivationId, decisions: Sequence[Decision],
                    owner: dict[int, ActivationId] | None = None) -> tuple[OpId, ...]:
    """Forward ops (program order) that rebuild activation ``a`` from values the backward has.

    Raises NotRecomputable if the chain needs an unsaved input or an op that is random or mutates.
    """
    owner = member_owner(graph) if owner is None else owner
    return tuple(sorted(chain_ops(graph, a, lambda b: decisions[b] is Decision.RECOMPUTE, owner)))


def chain_ops(graph: StepGraph, a: ActivationId, recomputed: Callable[[ActivationId], bool],
              owner: dict[int, ActivationId], strict: bool = True) -> set[OpId]:
    """The forward ops reached from ``a``'s members through saved values of activations for which
    ``recomputed(activation)`` holds. ``strict``: raise NotRecomputable at an unsaved input or a
    random or mutating op; otherwise stop there.

    It walks :class:`_Segment` s, not ops: from each value the chain runs through, the ops up to
    the next saved values, the same in every chain that reaches it (at GPT-2 48L's floor, half
    the time of an op-by-op walk). Where a strict chain meets several unsafe ops, the one named
    is its first segment's that has one."""
    return set().union(*(seg.ops for seg in _walk_segments(graph, a, recomputed, owner, strict)))


def _walk_segments(graph: StepGraph, a: ActivationId, recomputed: Callable[[ActivationId], bool],
                   owner: dict[int, ActivationId], strict: bool) -> list[_Segment]:
    """The segments of ``chain_ops(graph, a, recomputed, owner, strict)``."""
    segment = per_graph(graph, _segments).get
    members = graph.activations[a].members
    todo, through, parts = list(members), set(members), []
    while todo:
        x = todo.pop()
        seg = segment(x) or _add_segment(graph, x)
        if strict and seg.unsafe:
            raise NotRecomputable(f"{graph.activations[a].name}: {seg.unsafe}")
        parts.append(seg)
        for y in seg.stops:
            if y not in through and y in owner and recomputed(owner[y]):
                through.add(y)
                todo.append(y)
    return parts


class _Segment(NamedTuple):
    """The forward ops a recompute chain runs from one value it runs through, up to the saved
    values it reaches (``stops``: the chain runs on through those whose activations are
    recomputed), and why a strict chain cannot run them (an unsaved input, a random or mutating
    op; None: it can). The values of non-forward ops and placeholders are not walked through.
    ``owners``: the activations that own one of its ops; ``reads``: those that own a value one
    of them reads."""

    ops: frozenset[int]
    stops: tuple[int, ...]
    unsafe: str | None
    owners: frozenset[int]
    reads: frozenset[int]


def _segments(graph: StepGraph) -> dict[int, _Segment]:
    """Per value walked so far: its :class:`_Segment` (see :func:`_add_segment`)."""
    return {}


def _add_segment(graph: StepGraph, x: int) -> _Segment:
    """Walk ``x``'s :class:`_Segment` (the first unsafe op met names why it is unsafe) and
    remember it."""
    ops: set[int] = set()
    stops: dict[int, None] = {}
    unsafe = None
    stack = [x]
    while stack:
        v = stack.pop()
        if v in ops:
            continue
        if v != x and v in graph.saved:
            stops[v] = None
            continue
        op = graph.ops[v]
        if op.phase is not Phase.FORWARD or op.target == "placeholder":
            unsafe = unsafe or f"needs unsaved input {op.name}"
            continue
        if not op.recomputable:
            unsafe = unsafe or f"{op.name} ({op.target}) is random or mutating"
        ops.add(v)
        stack.extend(op.recompute_args)
    owner = per_graph(graph, member_owner)
    seg = per_graph(graph, _segments)[x] = _Segment(
        frozenset(ops), tuple(stops), unsafe, frozenset(owner[v] for v in ops if v in owner),
        frozenset(owner[r] for v in ops for r in graph.ops[v].recompute_args if r in owner))
    return seg


def can_recompute(graph: StepGraph, a: ActivationId, decisions: Sequence[Decision], owner=None) -> bool:
    try:
        recompute_chain(graph, a, decisions, owner)
    except NotRecomputable:
        return False
    return True


class Recomputes(NamedTuple):
    """Where a decision vector's recompute chains run (see :func:`plan_recomputes`)."""

    #: swapped / recomputed activation -> first backward op that needs it (a swapped one read by a
    #: chain: that chain's, when earlier)
    first_use: dict[int, int]
    chains: dict[int, tuple[int, ...]]  # activation whose recompute is emitted -> its forward ops
    materialises: dict[int, tuple[int, ...]]  # the same -> the recomputed activations it makes available
    shared: bool  # did sharing change anything
    #: recomputed activations whose chains run alone, as without sharing (see :func:`plan_recomputes`)
    apart: frozenset[int] = frozenset()


def plan_recomputes(graph: StepGraph, decisions: Sequence[Decision], share: bool = True,
                    apart: Iterable[ActivationId] = ()) -> Recomputes:
    """The recompute chains of ``decisions``, each run just before its activation's first backward
    reader, in that order. With ``share`` (checkpointing's rule), a chain stops at recomputed
    activations already rebuilt, and every recomputed activation it rebuilds whole is kept from
    then on instead of being recomputed again at its own first reader; without it each recomputed
    activation reruns its whole chain alone.

    ``apart`` (with ``share``): recomputed activations that are shared with no chain, held no
    longer than their own readers need: each reruns its whole chain alone at its first reader,
    and no other chain keeps it. The set is closed over readers: every recomputed activation
    whose shortest chain reads one of them is apart too (:func:`apart_closure`), so a shared chain
    never runs through an activation that is apart."""
    acts = graph.activations
    owner = per_graph(graph, member_owner)
    first_reader = per_graph(graph, _first_readers)
    apart = apart_closure(graph, decisions, apart) if share else frozenset()

    # first backward op that needs each swapped / recomputed activation
    KEEP = Decision.KEEP
    first_use = {a: first_reader[a] for a, d in enumerate(decisions) if d is not KEEP and first_reader[a] >= 0}
    chains: dict[int, tuple[int, ...]] = {}
    materialises: dict[int, tuple[int, ...]] = {}
    reads: dict[int, frozenset[int]] = {}  # the same -> the activations its chain reads
    shared = False
    rebuilt: set[int] = set()
    walks = per_graph(graph, _chain_walks)
    RECOMPUTE = Decision.RECOMPUTE
    recompute = [d is RECOMPUTE for d in decisions]
    pending = recompute.copy()  # recomputed and not rebuilt yet: where a shared chain runs on

    def walk(b: int, runs_on: list[bool]) -> _Walk:
        """``chain_ops(graph, b, runs_on.__getitem__, owner)``: the leaf of ``walks[b]`` that
        ``runs_on``'s answers lead to, walked (and added) where none does yet. A chain that stops at
        an activation rebuilt already is shared."""
        nonlocal shared
        node = walks.get(b)
        while type(node) is list:  # the next activation the walk asks about: [it, if on, if not]
            c = node[0]
            if runs_on[c]:
                node = node[1]
            else:
                shared = shared or c in rebuilt
                node = node[2]
        if node is not None:
            return node
        asked: dict[int, bool] = {}

        def asking(c: int) -> bool:
            nonlocal shared
            answer = asked[c] = runs_on[c]
            shared = shared or (not answer and c in rebuilt)
            return answer
        segs = _walk_segments(graph, b, asking, owner, True)
        leaf = _Walk(tuple(sorted(set().union(*(s.ops for s in segs)))), frozenset().union(*(s.owners for s in segs)),
                     frozenset().union(*(s.reads for s in segs)))
        _remember(walks, b, tuple(asked.items()), leaf)
        return leaf

    recomputed = sorted((a for a, d in enumerate(decisions) if d is RECOMPUTE),
                        key=lambda a: (first_use.get(a, -1), a))
    for b in recomputed:
        if b in rebuilt:
            continue
        if not share or b not in first_use or b in apart:
            found = walk(b, recompute)
            chains[b], reads[b] = found.ordered, found.reads
            materialises[b] = (b,)
            continue
        found = walk(b, pending)
        chain: set[int] | None = None  # the walk's ops, made where first asked
        owners, reads[b] = found.owners, found.reads
        whole: set[int] = set()
        grown = True
        while grown:  # a pending activation whose storage the chain allocates is rebuilt whole
            grown = False
            for c in owners - whole - {b}:
                if c in first_use and pending[c] and c not in apart:
                    if chain is None:
                        chain = set(found.ordered)
                    if acts[c].producer not in chain:
                        continue
                    if not whole:  # the walk's sets are shared: grow copies
                        owners = set(owners)
                    whole.add(c)
                    more = walk(c, pending)
                    chain.update(more.ordered)
                    owners |= more.owners
                    reads[b] = reads[b] | more.reads
                    grown = True
        shared = shared or bool(whole)
        chains[b] = tuple(sorted(chain)) if whole and chain is not None else found.ordered
        materialises[b] = (b, *sorted(whole))
        rebuilt.update(materialises[b])
        for c in materialises[b]:
            pending[c] = False
    SWAP = Decision.SWAP
    for b, read in reads.items():  # a swapped activation a chain reads is needed by that chain
        if b not in first_use:
            continue
        for a in read:
            if a != b and decisions[a] is SWAP and a in first_use:
                first_use[a] = min(first_use[a], first_use[b])
    return Recomputes(first_use, chains, materialises, shared, apart)


def apart_closure(graph: StepGraph, decisions: Sequence[Decision], apart: Iterable[ActivationId]) -> frozenset[int]:
    """The recomputed activations of ``apart`` and, in turn, every recomputed activation whose
    shortest chain reads one of them (``chain_inputs``)."""
    readers = per_graph(graph, _chain_readers)
    RECOMPUTE = Decision.RECOMPUTE
    closed = {a for a in apart if decisions[a] is RECOMPUTE}
    todo = list(closed)
    while todo:
        for r in readers[todo.pop()]:
            if r not in closed and decisions[r] is RECOMPUTE:
                closed.add(r)
                todo.append(r)
    return frozenset(closed)


def _chain_readers(graph: StepGraph) -> tuple[tuple[int, ...], ...]:
    """Per activation ``c``: the activations whose shortest chain reads it (``chain_inputs``)."""
    owner = per_graph(graph, member_owner)
    readers: list[list[int]] = [[] for _ in graph.activations]
    for a in range(len(graph.activations)):
        for c in chain_inputs(graph, a, owner):
            readers[c].append(a)
    return tuple(map(tuple, readers))


def _first_readers(graph: StepGraph) -> tuple[int, ...]:
    """Per activation: its first backward reader (-1: none)."""
    return tuple(r[0] if (r := graph.backward_readers(act)) else -1 for act in graph.activations)


_PER_GRAPH: dict[int, tuple[weakref.ref, dict[Callable, object]]] = {}


def per_graph(graph: StepGraph, make: Callable[[StepGraph], object]):
    """``make(graph)``, computed once per graph: what every schedule of ``graph`` shares."""
    cached = _PER_GRAPH.get(id(graph))
    if cached is None or cached[0]() is not graph:
        cached = _PER_GRAPH[id(graph)] = (weakref.ref(graph, lambda _, key=id(graph): _PER_GRAPH.pop(key, None)), {})
    values = cached[1]
    if make not in values:
        values[make] = make(graph)
    return values[make]


class _Walk(NamedTuple):
    """A walk of an activation's recompute chain: its ops, in program order, the activations that
    own one of them, and those that own a value one of them reads."""

    ordered: tuple[int, ...]
    owners: frozenset[int]
    reads: frozenset[int]


class _Walks(dict):
    """Per activation: the walks of its recompute chain met so far, as a tree of what they asked.

    A walk is the same whenever the activations it asks about (does the chain run on through
    this one?) answer alike, and the next one it asks depends only on the answers before: a node
    ``[c, if it does, if not]`` is the next activation asked, a leaf a :class:`_Walk`. Following
    the answers down the tree asks what a fresh walk would ask, without walking the ops."""

    ops = 0  # ops held, over every leaf
    restarts = 0  # times it was full and started again


#: ops the walks of :class:`_Walks` hold per graph before it starts again (a leaf holds its chain as
#: a tuple, 8 bytes an op: 64 MB, and two small sets of activations). Planning GPT-2 at 12 layers
#: at its floor walks 0.18M (1,300 walks), at 48 layers 3.5M (7,600 walks of 457 ops on average)
MAX_WALK_OPS = 8_000_000


def _chain_walks(graph: StepGraph) -> _Walks:
    return _Walks()


def _remember(walks: _Walks, b: int, asked: tuple[tuple[int, bool], ...], leaf: _Walk) -> None:
    """Add the walk from ``b`` that asked ``asked`` (in order) to ``walks``."""
    if walks.ops + len(leaf.ordered) > MAX_WALK_OPS:
        walks.clear()
        walks.ops = 0
        walks.restarts += 1
    walks.ops += len(leaf.ordered)
    if not asked:
        walks[b] = leaf
        return
    if b not in walks:
        walks[b] = [asked[0][0], None, None]
    node = walks[b]
    for k, (c, answer) in enumerate(asked):
        assert node[0] == c, "a chain walk asked out of order"
        branch = 1 if answer else 2
        if k + 1 == len(asked):
            node[branch] = leaf
        else:
            if node[branch] is None:
                node[branch] = [asked[k + 1][0], None, None]
            node = node[branch]
