"""Recompute segments shared in part: the plan between sharing every segment and none.

A shared schedule runs each recomputed segment once and keeps what its chain rebuilds until its own
readers come (checkpointing's rule); an unshared one reruns every chain alone and holds each copy
no longer than its readers need. Near the floor the shared schedule is often over the limit at a
few instructions only, where copies are held for sharing, while the unshared one fits and pays
every rerun. :func:`partly_shared` keeps sharing everywhere but where it costs the peak: it sets
apart (``plan_recomputes(apart=...)``) the copies held for sharing at the program-order peak
(trying the least sets that takes: :func:`least_closures`), and again at the next peak, until
the plan fits, no copy is held there or :data:`MAX_TRIALS` memories were computed.
``Evaluator.evaluate`` tries it where the unshared schedule fits and the shared one does not.

Example: copies of activations 4 and 7, held from instructions 10 and 20 (rebuilt by earlier
chains) though their readers need them from 25 and 35 on:

>>> import numpy as np
>>> from fxpooch.footprint import Copies
>>> from fxpooch.planners.sharing import held_at_peak
>>> copies = Copies(np.array([4, 7]), np.array([10, 20]), np.array([30, 40]), np.array([25, 35]), np.array([30, 40]))
>>> held_at_peak(np.array([0, 5, 9]), copies).tolist()  # the peak, instruction 2, holds neither
[]
>>> held_at_peak(np.array([0] * 22 + [9] + [0] * 20), copies).tolist()  # at 22 both are held early
[4, 7]
>>> held_at_peak(np.array([0] * 27 + [9] + [0] * 20), copies).tolist()  # at 27, 4 is needed
[7]
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ..footprint import Copies, Footprint, program_memory
from ..graph import StepGraph
from ..schedule import Decision
from ..segments import Recomputes, apart_closure, plan_recomputes

log = logging.getLogger("fxpooch.planner.sharing")


def held_at_peak(memory: np.ndarray, copies: Copies) -> np.ndarray:
    """The activations whose recomputed copies are held for sharing at ``memory``'s peak."""
    return copies.held_at(int(memory.argmax())) if len(memory) else copies.acts[:0]


#: program-order memories :func:`partly_shared` computes for one plan at most (each counted as a
#: plan rejected, an eighth of a simulation, though on GPT-2 one costs about a fifth: the chains
#: are laid out again). Without a cap, tried on every plan over the limit, one seed of GPT-2 12L's
#: plan over NVLink2 a quarter of the way took 150 (9.8 of 12 CPU s of planning). With 16,
#: ResNet-50's PCIe5 floor plans 1.750x in-core, with 4 1.904x (GPT-2 12L's PCIe3 floor 1.618x
#: either way)
MAX_TRIALS = 16


def partly_shared(graph: StepGraph, decisions: Sequence[Decision], shared: Footprint,
                  fits: Callable[[np.ndarray], bool], max_trials: int = MAX_TRIALS) -> tuple[Recomputes | None, int]:
    """The recompute chains of ``decisions`` with copies held for sharing set apart until
    ``fits(memory)`` holds (None: no set found within ``max_trials`` program-order memories
    fits), and how many program-order memories that took beyond ``shared``, the footprint of
    the shared schedule.

    Each step tries each copy held for sharing at the current peak alone, but for those whose
    closure over readers holds another's (:func:`least_closures`): the first set that fits with
    the fewest activations apart ends the search, else the one with the lowest peak goes on, the
    fewest apart among equals (setting two apart at once can miss: their closure over readers
    holds more). Where the trials left are fewer than the sets, it sets them all apart at once."""
    decisions = tuple(decisions)
    footprint, tried = shared, 0
    while footprint is not None and footprint.copies is not None:
        if fits(footprint.memory):
            log.debug("partly shared: %d of %d recomputed activations apart", len(footprint.recomputes.apart),
                      decisions.count(Decision.RECOMPUTE))
            return footprint.recomputes, tried
        apart = footprint.recomputes.apart
        held = sorted(set(held_at_peak(footprint.memory, footprint.copies).tolist()) - apart)
        if not held or tried >= max_trials:
            break
        sets = least_closures(graph, decisions, apart, held)
        sets = sets if tried + len(sets) <= max_trials else [apart_closure(graph, decisions, apart | set(held))]
        trials = []
        for more in sets:
            trial = program_memory(graph, decisions, True, plan_recomputes(graph, decisions, True, more))
            tried += 1
            if trial is not None:
                trials.append(trial)
        fitting = [t for t in trials if fits(t.memory)]
        footprint = (min(fitting, key=lambda t: len(t.recomputes.apart)) if fitting
                     else min(trials, key=lambda t: (int(t.memory.max()), len(t.recomputes.apart)), default=None))
    return None, tried


def least_closures(graph: StepGraph, decisions: Sequence[Decision], apart: frozenset[int],
                   held: Sequence[int]) -> list[frozenset[int]]:
    """The distinct sets ``apart`` grows to with one of ``held`` set apart (closed over readers:
    :func:`~fxpooch.segments.apart_closure`), but for those that hold another of them.

    Setting a copy apart sets apart every recomputed activation whose chain reads it, so the copies
    of a run of recomputed activations, each read by the next one's chain, give nested sets: the
    last one's is the least change (the fewest chains rerun alone), and the next peak decides
    whether more must go. Trying only those costs a memory per run of copies instead of one per
    copy: at ResNet-50's PCIe3 floor (batch 256) the plan of ``local`` with 64x its work held 4
    copies of one run at its peak; it fits with 11 set apart in 6 memories (1.665x in-core;
    trying every copy, 21 apart in 16, 1.684x), and ``local``'s own plan with 17 apart in 10
    (1.814x; none within 16 before, so unshared, 1.849x). Not always the fewest in the end: where
    the last copy's set still misses the limit and an earlier one's alone would fit, the next
    peak may take a larger set than that one (``tests/test_footprint.py``'s 4-link chain at
    3 MiB; putting such heads back once a set fits finds the fewer set, but on 36 sweep rows it
    moved ``local``'s plans only through the trials it costs: benchmarks/PLANNERS.md).
    """
    closures = list(dict.fromkeys(apart_closure(graph, decisions, apart | {a}) for a in held))
    return [c for c in closures if not any(other < c for other in closures)]
