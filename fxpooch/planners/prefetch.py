"""Section 4.3 of the paper: each swap-in issued as early as memory allows.

:func:`place_prefetches` moves a just-in-time schedule's prefetches earlier, one at a time in
their FIFO order on the H2D stream, each as far as the program-order memory curve stays under the
budget; the evaluator judges the plan with them there (``schedule.move_prefetches``).
"""
from __future__ import annotations

import bisect

import numpy as np

from ..graph import StepGraph
from ..schedule import KIND_CODE, Kind, Schedule


def place_prefetches(graph: StepGraph, jit: Schedule, budget: int, memory: np.ndarray) -> list[int]:
    """Section 4.3: issue each swap-in as early as memory allows (FIFO on the H2D stream).

    ``jit`` is the just-in-time schedule of the decisions; ``budget`` the device bytes available
    beyond resident ones; ``memory`` its program-order memory curve (``static_memory(jit)``, not
    changed): a copy is raised as each prefetch moves earlier.
    """
    mem = memory.copy()
    instrs, kinds = jit.instrs, jit.kinds
    # op -> first instruction of its group (what runs just for it): the one after the last run
    # or offload before its run (an offload follows its producer's run, in no later op's group)
    is_run = kinds == KIND_CODE[Kind.RUN]
    runs = np.flatnonzero(is_run)
    closes = np.flatnonzero(is_run | (kinds == KIND_CODE[Kind.OFFLOAD]))
    after_close = np.concatenate(([0], closes[:-1] + 1)) if len(closes) else closes
    starts_of_runs = after_close[np.searchsorted(closes, runs)]
    run_ops = jit.ops[runs]
    # swapped activation -> its prefetch in ``jit``
    prefetch_index = {instrs[i][2]: i for i in np.flatnonzero(kinds == KIND_CODE[Kind.PREFETCH]).tolist()}
    placed = list(jit.prefetch_before)
    floor_index: dict[int, int] = {}  # per backward graph: prefetches stay in FIFO order
    # graph -> (group starts, ops) of its backward ops, ascending (the schedule runs them in order)
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for a in sorted(prefetch_index, key=prefetch_index.get):
        g = graph.activations[a].graph
        if g not in groups:
            start, stop = graph.backward_range[g]
            here = (run_ops >= start) & (run_ops < stop)
            groups[g] = (starts_of_runs[here].tolist(), run_ops[here].tolist())
        starts, ops = groups[g]
        jit_i = prefetch_index[a]
        nbytes = jit.instance_bytes[jit.instrs[jit_i].allocs[0]]
        lo = max(starts[0], floor_index.get(g, 0))
        # walking back from jit_i, the running max of memory only grows: count the steps that fit
        running = np.maximum.accumulate(mem[lo:jit_i][::-1])
        best = jit_i - int(np.searchsorted(running, budget - nbytes, side="right"))
        # snap to the start of a backward op's group (not later than the just-in-time one)
        k = bisect.bisect_left(starts, best)
        late = jit.prefetch_before[a]
        if not (k < len(ops) and ops[k] <= late):
            k = bisect.bisect_left(ops, late)  # the just-in-time op's group
            assert ops[k] == late, "a prefetch placed before no backward op of its own graph"
        choice, gi = ops[k], starts[k]
        mem[gi:jit_i] += nbytes
        floor_index[g] = gi
        placed[a] = choice
    return placed
