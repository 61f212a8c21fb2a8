"""Stage 1, capture: the training step as forward/backward FX graphs with explicit saved tensors.

Dynamo splits the model into graphs (at graph breaks); AOTAutograd turns each into a forward
and a backward GraphModule through :func:`partition`, which records them as a
:class:`GraphPair`. Each pair executes through a late-bound callable, so the planned (rewritten)
graphs replace the captured ones without retracing.

Capture only needs the forward to run (AOTAutograd's partition gives the backward), so while a
step is being captured each forward runs through :class:`FrugalForward`: values die after their
last use and every saved activation is handed to autograd as a zero-byte stand-in. Capture's
peak is then about the largest few live values of the forward, not the in-core step's.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import _torch_compat as compat
from .state import preserved_state

log = logging.getLogger("fxpooch.capture")

_PAIR_KEY = "fxpooch_pair"


@dataclass(eq=False)
class GraphPair:
    """One dynamo graph's forward and backward, as AOTAutograd partitioned them."""

    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    num_user_outputs: int
    #: what actually runs; replaced by the rewritten modules once a plan is bound
    run_forward: fx.GraphModule = field(init=False)
    run_backward: fx.GraphModule = field(init=False)
    #: called before each forward; may return a boxed callable that runs this forward instead
    on_run: Callable[[GraphPair, list[Any]], Callable[[list[Any]], Any] | None] | None = field(
        default=None, repr=False)
    #: how many times the backward has run (a step's backward has run once its first pair's has)
    backward_calls: int = field(default=0, init=False)
    #: entered around each forward and backward call: the runtime state its ops run on
    runtime: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext, repr=False)
    #: called after each backward call
    after_backward: Callable[[GraphPair], None] | None = field(default=None, repr=False)
    #: the returned views without a tangent and their bases, as positions among the user outputs
    #: (:func:`fxpooch._torch_compat.returned_views`); None: not known (set when the forward is compiled)
    returned_views: tuple[tuple[int, int | None, bool], ...] | None = field(default=None, init=False)
    #: the forward's inputs whose gradient autograd passes on to what made them (an earlier graph's
    #: output after a graph break: an input that requires grad and is no leaf); set when captured
    passed_on: frozenset[int] = field(default=frozenset(), init=False)
    #: the user outputs the caller gets from the model, as positions, once per time it gets each (dynamo
    #: may return one twice); set when captured
    to_caller: tuple[int, ...] = field(default=(), init=False)
    #: the user outputs a later graph of the step takes as its input, or a view of it (after a graph
    #: break); set when captured
    to_later: frozenset[int] = field(default=frozenset(), init=False)
    #: on the pair that ran last: the leaves (parameters, inputs) the model returns as they are, which
    #: no graph returns, as meta tensors; set when captured
    leaves_to_caller: tuple[torch.Tensor, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.bind(_boxed_copy(self.forward), _boxed_copy(self.backward))

    def bind(self, forward: fx.GraphModule, backward: fx.GraphModule,
             code: tuple[Callable[[list[Any]], Any], Callable[[list[Any]], Any]] | None = None) -> None:
        """Execute ``forward``/``backward`` from now on: the boxed GraphModules themselves, or
        ``code``, the boxed callables a code generator compiled from exactly these two modules."""
        self.run_forward, self.run_backward = forward, backward
        #: what runs: the (forward, backward) boxed callables
        self.code = code if code is not None else (forward, backward)

    def call_forward(self, args: list[Any]) -> Any:
        runner = self.on_run(self, args) if self.on_run is not None else None
        with self.runtime():
            return (runner or self.code[0])(args)

    def call_backward(self, args: list[Any]) -> Any:
        self.backward_calls += 1
        with self.runtime():
            out = self.code[1](args)
        if self.after_backward is not None:
            self.after_backward(self)
        return out

    @property
    def saved_nodes(self) -> list[fx.Node]:
        """Forward output nodes the backward reads (AOTAutograd's saved values), in order."""
        out = self.forward.graph.output_node().args[0]
        return [n for n in out[self.num_user_outputs:] if isinstance(n, fx.Node)]


def _boxed_copy(gm: fx.GraphModule) -> fx.GraphModule:
    copy = fx.GraphModule(gm, _copy_graph(gm.graph))
    compat.set_boxed_codegen(copy)
    return copy


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


class FrugalForward(fx.Interpreter):
    """Runs a pair's forward for capture without holding its saved activations.

    Each value is freed after its last use; a saved output that the forward allocated is
    replaced, once its last forward reader has run, by ``torch.empty(()).expand(shape)`` of its
    dtype and device (zero bytes). AOTAutograd's runtime wrapper only requires saved outputs to be
    tensors (it detaches views and stores them on the autograd context); the backward of a
    capture step never runs. User outputs, mutated inputs and saved inputs stay real.
    """

    def __init__(self, pair: GraphPair):
        super().__init__(pair.forward, garbage_collect_values=True)
        outs = pair.forward.graph.output_node().args[0]
        self.num_user_outputs = pair.num_user_outputs
        #: the user outputs of the last call, weakly (:func:`note_caller_outputs` finds them in the model's)
        self.returned: list[weakref.ref | None] = []
        real = {n for n in outs[:pair.num_user_outputs] if isinstance(n, fx.Node)}
        self.stand_in = {n for n in pair.saved_nodes if n not in real and n.op != "placeholder"
                         and isinstance(n.meta.get("val"), torch.Tensor)}
        # the node after which each stand-in's real value is no longer needed
        order = {n: i for i, n in enumerate(pair.forward.graph.nodes)}
        self.release_after: dict[fx.Node, list[fx.Node]] = {}
        for n in self.stand_in:
            readers = [u for u in n.users if u.op != "output"]
            last = max(readers, key=order.__getitem__) if readers else n
            self.release_after.setdefault(last, []).append(n)

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        out = self.run(*inputs)
        self.returned[:] = [weakref.ref(v) if isinstance(v, torch.Tensor) else None
                            for v in out[:self.num_user_outputs]]
        return out

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for saved in self.release_after.get(n, ()):
            value = out if saved is n else self.env[saved]
            stand_in = torch.empty((), dtype=value.dtype, device=value.device).expand(value.shape)
            if saved is n:
                out = stand_in
            else:
                self.env[saved] = stand_in
        return out


def _boxed(pair: GraphPair, backward: bool) -> Callable[[list[Any]], Any]:
    """AOTAutograd's boxed calling convention; looks the pair's method up at each call."""

    def call(args: list[Any]) -> Any:
        return pair.call_backward(args) if backward else pair.call_forward(args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def save_all_primals(fw: fx.GraphModule, bw: fx.GraphModule, num_user_outputs: int,
                     static: Sequence[int] | None = None) -> None:
    """Also hand every differentiable input of the forward that lives the whole step (the
    parameters: ``static``, AOTAutograd's static-lifetime input indices, where it gives them) to
    the backward.

    They are resident anyway, so this costs no memory, and it lets the backward recompute
    activations from them. Inputs without a gradient (BatchNorm's running statistics, which
    the step mutates) are left out: autograd would reject them as modified saved tensors; so are
    the other inputs, such as an earlier graph's output after a graph break, which the step may
    mutate in place too (``F.relu(h, inplace=True)``) and which would not be free to hold.
    Added after the saved tensors, before saved symints (AOTAutograd's order for both the
    forward's outputs and the backward's placeholders).
    """
    out_node = fw.graph.output_node()
    outs = list(out_node.args[0])
    saved = outs[num_user_outputs:]
    n_tensors = sum(1 for n in saved if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor))
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in saved[:n_tensors]):
        return  # not the layout we know: leave the pair as partitioned
    have = set(saved)
    grads = bw.graph.output_node().args[0]
    primals = fw.graph.find_nodes(op="placeholder")
    if len(grads) != len(primals):
        return
    resident = range(len(primals)) if static is None else set(static)
    extra = [p for i, (p, g) in enumerate(zip(primals, grads))
             if g is not None and i in resident and p not in have and isinstance(p.meta.get("val"), torch.Tensor)
             and p.users]
    if not extra:
        return
    cut = num_user_outputs + n_tensors
    out_node.args = (tuple(outs[:cut] + extra + outs[cut:]),)
    bw_placeholders = bw.graph.find_nodes(op="placeholder")
    anchor = bw_placeholders[n_tensors] if n_tensors < len(bw_placeholders) else None
    for p in extra:
        if anchor is None:
            with bw.graph.inserting_after(bw_placeholders[-1] if bw_placeholders else None):
                new = bw.graph.placeholder(p.name)
        else:
            with bw.graph.inserting_before(anchor):
                new = bw.graph.placeholder(p.name)
        new.meta = dict(p.meta)
        bw_placeholders = bw.graph.find_nodes(op="placeholder")
    fw.recompile()
    bw.recompile()


class UnplannedGraph(Exception):
    """Raised inside a planned step when a graph pair that the bound plan does not hold is about
    to run (dynamo compiled a new graph: a guard failed). Nothing of that pair has run yet; the
    caller undoes the step so far and runs it again under a plan that holds the pair."""

    def __init__(self, ran: list[GraphPair], cause: str):
        super().__init__(cause)
        self.ran, self.cause = ran, cause


class Recorder:
    """The dynamo backend: records each graph pair and checks that a step runs only planned pairs."""

    def __init__(self, decompositions: dict | None = None,
                 on_run: Callable[[GraphPair, list[Any]], Callable[[list[Any]], Any] | None] | None = None,
                 after_backward: Callable[[GraphPair], None] | None = None) -> None:
        #: ``on_run`` / ``after_backward``: given to each pair (see :class:`GraphPair`); by default the
        #: recorder's own check that a step runs only planned pairs
        self.on_run, self.after_backward = on_run or self._note_run, after_backward
        #: compiles an inference graph (grad disabled: nothing to plan); None: it runs as it is
        self.inference: Callable[[fx.GraphModule, list[Any]], Callable] | None = None
        #: entered (``runtime.entered()``) around each call of a pair's forward or backward; None: nothing
        self.runtime: Any = None
        self.pairs: list[GraphPair] = []
        self.ran: list[GraphPair] | None = None
        self.args: list[list[Any]] = []  # inputs of each pair in ``ran`` (kept for profiling)
        self.returned: list[list[weakref.ref | None]] = []  # per pair in ``ran``: its user outputs, weakly
        self.expected: list[GraphPair] | None = None  # the bound plan's pairs, while a step runs
        self.seen: list[GraphPair] = []  # pairs of the running step so far
        self.causes: dict[GraphPair, str] = {}  # why dynamo compiled each pair (its recompile reasons)
        self._known_reasons = set(compat.recompile_reasons())
        #: ``decompositions``: what AOTAutograd decomposes while tracing (None: its default; inductor's
        #: table when the rewritten graphs are compiled by inductor, which lowers only decomposed ops)
        self.backend = compat.aot_backend(self._fw_compiler, self._bw_compiler, self._partition, decompositions)

    def _partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        fw, bw = compat.default_partition(joint, joint_inputs, **kwargs)
        compat.match_kernel_dtypes(fw)
        save_all_primals(fw, bw, kwargs["num_fwd_outputs"], compat.static_input_indices(kwargs))
        pair = GraphPair(len(self.pairs), fw, bw, kwargs["num_fwd_outputs"], on_run=self.on_run,
                         runtime=self._runtime, after_backward=self.after_backward)
        # the index, not the pair: AOTAutograd deep-copies the backward module (meta included)
        # before compiling it lazily, and the pair must stay the one object that runs
        fw.meta[_PAIR_KEY] = bw.meta[_PAIR_KEY] = pair.index
        self.pairs.append(pair)
        reasons = [r for r in compat.recompile_reasons() if r not in self._known_reasons]
        self._known_reasons.update(reasons)
        self.causes[pair] = "; ".join(r.splitlines()[0] for r in reasons) or "a frame dynamo had not compiled"
        log.debug("captured graph pair %d: %d forward nodes, %d backward nodes, %d saved (%s)",
                  pair.index, len(fw.graph.nodes), len(bw.graph.nodes), len(pair.saved_nodes), self.causes[pair])
        return fw, bw

    def _runtime(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.runtime is None else self.runtime.entered()

    def _fw_compiler(self, gm: fx.GraphModule, example_inputs: Any):
        index = gm.meta.get(_PAIR_KEY)
        if index is None:
            # grad disabled (no_grad / inference_mode): AOTAutograd compiled an inference graph
            # without a partition. Nothing is saved for a backward, so there is nothing to plan.
            return gm if self.inference is None else self.inference(gm, list(example_inputs))
        pair = self.pairs[index]
        pair.returned_views = compat.returned_views(pair.num_user_outputs)
        return _boxed(self.pairs[index], backward=False)

    def _bw_compiler(self, gm: fx.GraphModule, example_inputs: Any):
        return _boxed(self.pairs[gm.meta[_PAIR_KEY]], backward=True)

    def _note_run(self, pair: GraphPair, args: list[Any]) -> Callable[[list[Any]], Any] | None:
        if self.ran is None:
            if self.expected is not None:
                self._check_planned(pair)
            return None
        if pair in self.ran:
            raise _repeated_graph_error(pair)
        self.ran.append(pair)
        self.args.append(list(args))
        pair.passed_on = frozenset(i for i, a in enumerate(args)
                                   if isinstance(a, torch.Tensor) and a.requires_grad and not a.is_leaf)
        taken = {compat.storage_key(a) for a in args if isinstance(a, torch.Tensor)}  # the storages, views too
        for earlier, refs in zip(self.ran, self.returned):
            earlier.to_later |= {i for i, r in enumerate(refs)
                                 if r is not None and r() is not None and compat.storage_key(r()) in taken}
        pair.to_later = frozenset()
        runner = FrugalForward(pair)
        self.returned.append(runner.returned)
        return runner

    def _check_planned(self, pair: GraphPair) -> None:
        position = len(self.seen)
        if position < len(self.expected) and self.expected[position] is pair:
            self.seen.append(pair)
            return
        if pair in self.seen:
            raise _repeated_graph_error(pair)
        ran = [*self.seen, pair]
        cause = (f"dynamo compiled graph {pair.index} ({self.causes.get(pair, 'no recompile reason recorded')})"
                 if pair not in self.expected else f"graph {pair.index} runs where the plan has another graph")
        raise UnplannedGraph(ran, cause)

    @contextlib.contextmanager
    def recording_step(self) -> Iterator[list[GraphPair]]:
        """Collect, in order, the pairs whose forward runs inside the block (and their inputs)."""
        ran: list[GraphPair] = []
        self.ran, self.args, self.returned = ran, [], []
        try:
            yield ran
        except BaseException:
            self.args = []  # a failed capture must not keep its inputs alive
            raise
        finally:
            self.ran = None

    @contextlib.contextmanager
    def running_plan(self, pairs: list[GraphPair]) -> Iterator[list[GraphPair]]:
        """Inside the block, a pair not in ``pairs`` (at its position) raises :class:`UnplannedGraph`
        before it runs; yields the pairs run so far."""
        self.expected, self.seen = list(pairs), []
        try:
            yield self.seen
        finally:
            self.expected = None


def _repeated_graph_error(pair: GraphPair) -> Exception:
    from .errors import UnsupportedModel

    return UnsupportedModel(
        f"dynamo graph {pair.index} runs twice in one forward (a compiled region called in a loop, or "
        "a graph break inside a module called more than once: the code after the break is one graph "
        "for every call); fxpooch plans each graph once per step. Remove the graph break from the "
        "loop or the repeated module (torch._dynamo.explain(model)(x) lists the breaks)")


def capture_step(compiled: Callable[..., Any], recorder: Recorder, model: nn.Module,
                 args: tuple[Any, ...], kwargs: dict[str, Any],
                 changed_buffers: list[tuple[nn.Module, str]] | None = None) -> tuple[list[GraphPair], list[list[Any]]]:
    """Trace one forward of ``compiled`` (side-effect free): its graph pairs in order, and their inputs.

    The forwards run through :class:`FrugalForward` (saved activations are not held), so a step
    that does not fit in memory can still be captured; nothing is bound to the pairs. The
    buffers the forward changes (and puts back) are appended to ``changed_buffers`` if given.
    """
    with preserved_state(model, (args, kwargs)) as changed, recorder.recording_step() as ran:
        with torch.enable_grad():
            out = compiled(*args, **kwargs)
    if changed_buffers is not None:
        changed_buffers.extend(changed)
    if not ran:
        raise _no_graph_error(out)
    note_caller_outputs(ran, recorder.returned, out)
    inputs, recorder.args = recorder.args, []
    return list(ran), inputs


def note_caller_outputs(ran: Sequence[GraphPair], returned: Sequence[Sequence[weakref.ref | None]], out: Any) -> None:
    """Set each pair's :attr:`~GraphPair.to_caller` and the last one's
    :attr:`~GraphPair.leaves_to_caller` from the model's output ``out`` (its tensors that require
    grad) and what each pair's forward returned (``returned``, weakly, in ``ran``'s order)."""
    at = {id(r()): (pair, i) for pair, refs in zip(ran, returned) for i, r in enumerate(refs)
          if r is not None and r() is not None}
    gets: dict[GraphPair, list[int]] = {pair: [] for pair in ran}
    leaves = []
    for t in compat.tree_leaves(out):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        if id(t) in at:
            pair, i = at[id(t)]
            gets[pair].append(i)
        elif t.is_leaf:
            leaves.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    for pair in ran:
        pair.to_caller, pair.leaves_to_caller = tuple(gets[pair]), ()
    ran[-1].leaves_to_caller = tuple(leaves)


def _no_graph_error(out: Any) -> Exception:
    from .errors import UnsupportedModel

    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in compat.tree_leaves(out)):
        breaks = compat.graph_break_reasons()
        why = f" Dynamo reported: {'; '.join(breaks[-3:])}." if breaks else ""
        return UnsupportedModel(
            "dynamo compiled no graph of this forward although its output needs gradients: it ran the model "
            "eagerly, so there is nothing to plan. This happens with a wrapper whose forward dynamo skips (a "
            "forward under torch.compiler.disable) and with a graph break that makes dynamo skip the frame (e.g. "
            f"inside a loop over a custom autograd.Function).{why} Compile the inner module (before wrapping it), or remove "
            "the graph break (torch._dynamo.explain(model)(x) lists them)")
    return UnsupportedModel(
        "dynamo captured no graph that needs gradients: check that the model has parameters with "
        "requires_grad=True (or inputs that require grad) and that its forward uses them"
    )
