"""The one place fxpooch touches torch-private APIs (supported: torch 2.11 - 2.13): this package,
with its distributed and profiler parts in modules of their own.

Everything here is a thin adapter; callers see plain functions with stable signatures.
"""
from __future__ import annotations

import bisect
import contextlib
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

#: the torch releases fxpooch is tested with, first and last (pyproject.toml requires the same)
TESTED_TORCH = ((2, 11), (2, 13))


def _release(version: str) -> tuple[int, int] | None:
    """The (major, minor) release ``version`` names (``torch.__version__``), None if none."""
    parsed = re.match(r"(\d+)\.(\d+)", version)
    return (int(parsed[1]), int(parsed[2])) if parsed else None


def untested_torch(version: str) -> str | None:
    """What to do about torch ``version`` (``torch.__version__``) when it is not one of
    :data:`TESTED_TORCH`; None when it is (or names no release: nothing to compare).

    >>> untested_torch("2.13.0+cpu") is None
    True
    """
    release = _release(version)
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    if release is None or TESTED_TORCH[0] <= release <= TESTED_TORCH[1]:
        return None
    return (f"fxpooch is tested with torch {lo_major}.{lo_minor} to {hi_major}.{hi_minor}, not {version}: the "
            "private torch APIs it adapts (fxpooch/_torch_compat/) may differ there. Install a tested release: "
            f"pip install 'torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}'")


def missing_gradients_held(version: str = torch.__version__) -> bool:
    """Whether AOTAutograd holds the zeros it makes for a graph output that got no gradient (one
    the caller dropped before ``loss.backward()``) until the compiled backward returns: before
    torch 2.13 (measured on 2.11 and 2.12: 1 MiB over a plan that freed them after their last
    reader, ``tests/test_outputs_memory.py``); from 2.13 on they go after their last reader.

    >>> missing_gradients_held("2.12.1"), missing_gradients_held("2.13.0+cpu")
    (True, False)
    """
    return (_release(version) or TESTED_TORCH[1]) < (2, 13)


def aot_backend(fw_compiler: Callable, bw_compiler: Callable, partition_fn: Callable,
                decompositions: dict | None = None) -> Callable:
    """A ``torch.compile`` backend: dynamo -> AOTAutograd with our partitioner and compilers
    (``decompositions``: the ops AOTAutograd decomposes while tracing; None: its default)."""
    from torch._dynamo.backends.common import aot_autograd

    extra = {} if decompositions is None else {"decompositions": decompositions}
    aot = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn, **extra)

    def backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        with meta_kernels_decomposed(example_inputs):
            return aot(gm, example_inputs, **kwargs)

    return backend


def _meta_kernels_over_autograd() -> list[OpOverload]:
    """The aten ops that decompose for autograd (CompositeImplicitAutograd) and that torch also
    gives a Python meta kernel (``torch._meta_registrations.activate_meta``: every op of its
    decomposition tables; ``broadcast_tensors``). Under the Python dispatcher, as AOTAutograd
    traces, that kernel wins over the decomposition on meta tensors, and autograd has no formula
    for the op: its gradient is dropped (``cross_entropy``, ``relu6``, ``var``, ``torch.where(c,
    x, 0.0)``...)."""
    ops = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if isinstance(packet, torch._ops.OpOverloadPacket) else ():
            op = getattr(packet, overload)
            if torch._C.DispatchKey.Meta in op.py_kernels and has_composite_implicit_kernel(op):
                ops.append(op)
    return ops


@contextlib.contextmanager
def meta_kernels_decomposed(example_inputs: Sequence[Any]) -> Iterator[None]:
    """Where an input is a meta tensor: while in the block, the ops of
    :func:`_meta_kernels_over_autograd` decompose on meta as they do on every other device (their
    Python meta kernels set aside), so that a step traced on meta has the backward a real one has."""
    if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves(list(example_inputs))):
        yield
        return
    meta = torch._C.DispatchKey.Meta
    hidden = {op: op.py_kernels.pop(meta) for op in _meta_kernels_over_autograd()}
    for op in hidden:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in hidden.items():
            op.py_kernels[meta] = kernel
            op._dispatch_cache.clear()


def inductor_decompositions() -> dict:
    """The decompositions inductor has AOTAutograd apply, so a captured graph is one inductor can lower
    (a dropout becomes ``rand_like(x) > p`` and products: its mask is not eager's for the same seed,
    as under ``torch.compile``)."""
    import torch._inductor.lowering  # noqa: F401  (some decompositions consult inductor's lowerings)
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def default_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's default partition: the forward saves what the backward reads."""
    from torch._functorch.partitioners import default_partition as _default

    return _default(joint, joint_inputs, **kwargs)


def static_input_indices(partition_kwargs: dict[str, Any]) -> Sequence[int] | None:
    """The forward's inputs that live the whole step (parameters, buffers), as AOTAutograd tells
    a partition function (``static_lifetime_input_indices``); None where it does not."""
    return partition_kwargs.get("static_lifetime_input_indices")


def returned_views(num_user_outputs: int) -> tuple[tuple[int, int | None, bool], ...] | None:
    """Inside an AOTAutograd forward compiler: the outputs the caller gets a gradient for that have no
    tangent (views AOTAutograd makes outside the graph, ``return y, y[:, :64]``; an input returned),
    each with its base (``y``; None: an input) and whether the caller sees that base too, as positions
    among the forward graph's ``num_user_outputs`` first outputs (mutated inputs, the caller's outputs,
    then the bases it does not see); None where AOTAutograd does not tell, or lays its outputs out
    otherwise."""
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    try:
        first, infos = meta.num_mutated_inp_runtime_indices, meta.output_info
        if first + len(infos) + meta.num_intermediate_bases != num_user_outputs:
            return None
    except AttributeError:
        return None
    base_at = {OutputType.alias_of_intermediate: first + len(infos),
               OutputType.alias_of_intermediate_save_as_output: first + len(infos),
               OutputType.alias_of_intermediate_base_is_user_output: first}
    traced = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
    return tuple((first + i, base_at[o.output_type] + o.base_idx if o.output_type in base_at else None,
                  base_at.get(o.output_type) == first)
                 for i, o in enumerate(infos) if o.requires_grad and o.output_type not in traced)


def inductor_compile(gm: fx.GraphModule, example_inputs: list[Any], is_backward: bool,
                     fixed_outputs: Sequence[int] | None = None) -> tuple[Callable[[list[Any]], Any], list[Any]]:
    """``gm`` (an AOTAutograd forward or backward graph, its placeholders' ``meta["val"]`` fake
    tensors as ``example_inputs``) compiled by inductor, as a boxed callable (it takes one list and
    clears it), and the strides each output has in the compiled code (None where not a tensor).

    The outputs in ``fixed_outputs`` (all if None) keep their traced strides; inductor lays out the
    others as it likes (it makes convolution outputs channels-last on CPU), as ``torch.compile``
    does with the activations a forward saves. The code runs in the graph's order: inductor's
    reordering for peak memory is off and no kernel fuses work from both sides of an extern call
    (:class:`_InOrderFusion`)."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    output = gm.graph.find_nodes(op="output")[0]
    outs = output.args[0] if not isinstance(output.args[0], fx.Node) else output.args
    fixed = range(len(outs)) if fixed_outputs is None else fixed_outputs
    visible = [i for i in fixed if isinstance(outs[i], fx.Node)]
    output.meta["user_visible_output_idxs"] = visible
    fake_mode = detect_fake_mode(example_inputs)
    # A buffer inductor frees early and hands to a later kernel stays allocated in between, where the
    # plan has it freed: no reuse. On CUDA an offload's copy may still read its input after the call
    # returns (a side stream), so no kernel may write its output into an input's memory either; on
    # CPU the copy is done when the call returns. A random op (a dropout's ``rand_like``) is called as
    # eager calls it (``fallback_random``), on the default generator: torch.compile rewrites such ops
    # in passes this compile does not run, and inductor cannot lower them otherwise.
    on_cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
    # inductor's graph cache keys on neither the fusion rule nor which outputs keep their strides
    tag = f"{torch.compiler.config.cache_key_tag}|fxpooch in-order fusion|fixed outputs {visible}"
    with (tracing(TracingContext(fake_mode)), TracingContext.report_output_strides() as strides,
          config.patch(reorder_for_peak_memory=False, allow_buffer_reuse=False, inplace_buffers=not on_cuda,
                       fallback_random=True),
          torch.compiler.config.patch(cache_key_tag=tag), V.set_choices_handler(_InOrderFusion())):
        compiled = compile_fx_inner(gm, example_inputs, is_backward=is_backward)
    if strides is None or len(strides) != len(outs):
        raise RuntimeError(f"inductor reported the strides of {None if strides is None else len(strides)} "
                           f"outputs of a graph with {len(outs)}")
    return compiled, [None if s is None else tuple(int(x) for x in s) for s in strides]


def _in_order_fusion_type() -> type:
    from torch._inductor.choices import InductorChoices
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    class InOrderFusion(InductorChoices):
        """Inductor's fusion choices, less any fusion of two kernels an extern call (a matmul, a
        convolution, an ``fxpooch::`` copy) runs between: such a kernel would run on one side of
        the call work the graph does on the other, allocating or freeing memory on the wrong side
        of a prefetch. Kernels between two extern calls fuse as inductor likes."""

        def __init__(self) -> None:
            super().__init__()
            self._externs: dict[int, list[int]] = {}

        def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            key = id(scheduler)
            if key not in self._externs:  # the order before fusion: fusing never reorders externs
                self._externs[key] = sorted(n.min_order for n in scheduler.nodes
                                            if isinstance(n, ExternKernelSchedulerNode))
            lo = min(node1.min_order, node2.min_order)
            hi = max(node1.max_order, node2.max_order)
            externs = self._externs[key]
            i = bisect.bisect_right(externs, lo)
            if i < len(externs) and externs[i] < hi:
                return False
            return super().can_fuse(scheduler, node1, node2, shared_data_score)

    return InOrderFusion


def _InOrderFusion() -> Any:  # noqa: N802  (a class built on first use: inductor imports late)
    global _IN_ORDER_FUSION
    if _IN_ORDER_FUSION is None:
        _IN_ORDER_FUSION = _in_order_fusion_type()
    return _IN_ORDER_FUSION()


_IN_ORDER_FUSION: type | None = None


def register_backend(name: str, compiler_fn: Callable) -> None:
    """Give ``compiler_fn`` a ``torch.compile(backend=name)`` name, unless dynamo has it already: as
    a registered function, or as a ``torch_dynamo_backends`` entry point that it loads itself
    (registering it here too would make dynamo's own registration fail as a duplicate)."""
    from torch._dynamo.backends import registry

    if name in registry._COMPILER_FNS or registry._BACKENDS.get(name) is not None:
        return
    registry.register_backend(compiler_fn, name=name)


def borrowed_storage(owner: torch.Tensor) -> torch.UntypedStorage:
    """A storage on ``owner``'s memory that does not own it: a storage of its own (its own identity,
    freed when its last view is), while the memory stays ``owner``'s to free."""
    storage = owner.untyped_storage()
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), owner.device, storage.nbytes())


def storage_key(value: Any) -> int | None:
    """Identity of the (fake or real) storage behind a tensor, or None for non-tensors."""
    if not isinstance(value, torch.Tensor):
        return None
    return value.untyped_storage()._cdata


def set_boxed_codegen(gm: fx.GraphModule) -> None:
    """Make ``gm`` take one list argument and clear it, so inputs die at their last use."""
    boxed = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if boxed is None:  # older torch: same idea, written out
        boxed = _BoxedCodeGen
    gm.graph.set_codegen(boxed())
    gm.recompile()


class _BoxedCodeGen(fx.graph.CodeGen):
    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *args: Any, **kwargs: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        lines = [f"def {getattr(self, '_func_name', 'forward')}(self, args_list){maybe_return_annotation}:"]
        if names:
            lines.append("    args_iter = iter(args_list)")
            lines += [f"    {n} = next(args_iter)" for n in names]
            lines.append("    args_list.clear()")
        return "\n".join(lines)

    def process_inputs(self, *args: Any) -> Any:
        return list(args)


def is_random_op(target: Any) -> bool:
    """True for ops that draw from an RNG (their recomputation would draw new numbers)."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def is_mutating_op(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def is_cuda_graph_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: Each compiled module owns its entry function; inner frames (after graph breaks) are shared
#: by every compile of the same model class, so dynamo's per-code recompile cap is raised while
#: fxpooch code runs (otherwise the 9th compile of a class silently runs eagerly).
_RECOMPILE_LIMIT = 1 << 16


def dynamo_limits():
    """Context manager: dynamo's recompile caps raised for the duration of one fxpooch call, and its
    DDP graph split (DDPOptimizer) off: inside a DDP forward dynamo would cut the step into a graph per
    gradient bucket, and what crosses a cut (a graph's output) could not be swapped or recomputed."""
    import torch._dynamo.config as dcfg

    names = {n: _RECOMPILE_LIMIT for n in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                                             "accumulated_cache_size_limit") if hasattr(dcfg, n)}
    return dcfg.patch(**names, optimize_ddp=False)


def fresh_entry(model: Callable, tag: str) -> Callable:
    """A function calling ``model`` whose code object is new, so dynamo caches it separately."""

    def step(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    step.__code__ = step.__code__.replace(co_name=tag)
    step.__name__ = step.__qualname__ = tag
    return step


def dispatch_mode_active() -> bool:
    """True under a TorchDispatchMode that makes dynamo run the model eagerly, without our graphs
    (a mode whose ``ignore_compile_internals()`` is True leaves compiled code alone)."""
    import torch.utils._python_dispatch as pd

    if pd._get_current_dispatch_mode() is None:
        return False
    check = getattr(pd, "is_in_any_mode_without_ignore_compile_internals", None)
    return True if check is None else check()


def recompile_reasons() -> list[str]:
    """Every guard failure dynamo recorded in this process (why it compiled a frame again),
    oldest first per code object; each reason names its compile id, so they are unique."""
    from torch._dynamo.utils import guard_failures

    return [r for reasons in list(guard_failures.values()) for r in reasons]


def graph_break_reasons() -> list[str]:
    """Why dynamo broke graphs or skipped frames in this process (for error messages)."""
    from torch._dynamo.utils import counters

    return [str(r).strip().splitlines()[0] for r in counters.get("graph_break", {}) if str(r).strip()]


def cuda_sleep(cycles: int) -> None:
    """Enqueue a busy-wait of ``cycles`` GPU clock cycles on the current CUDA stream (tests delay streams)."""
    torch.cuda._sleep(cycles)


def activation_memory_budget(budget: float):
    """Context manager: torch.compile's partitioner keeps about ``budget`` (0..1) of its activation
    memory, recomputing the rest (read when a graph compiles, so compile inside the block)."""
    import torch._functorch.config as fcfg

    return fcfg.patch(activation_memory_budget=budget)


def reset_compile_caches() -> None:
    """Forget every frame torch.compile has compiled, so the next call compiles with current settings.

    This also drops fxpooch's captured graphs: only call it when no CompiledModule is used again.
    """
    torch._dynamo.reset()


def empty_host_cache() -> None:
    """Give cached pinned host blocks back to the driver (no-op where torch lacks the hook)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


# -- pytree, op and dispatcher helpers (private modules of torch) ------------------------
from torch._ops import OpOverload  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map  # noqa: E402,F401


def has_composite_implicit_kernel(op: OpOverload) -> bool:
    """Whether ``op`` decomposes (CompositeImplicitAutograd) into other ops."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def outside_fake_mode():
    """Context manager that leaves an ambient FakeTensorMode (if any)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def match_kernel_dtypes(gm: fx.GraphModule) -> None:
    """Set the values (``node.meta["val"]``) of ``gm``'s nodes whose kernel returns another dtype than
    its fake tensor says to what the kernel returns, so that their storages are sized as allocated.
    One case is known: on CPU, ``native_layer_norm`` of a reduced-precision input with a weight or
    bias of another dtype (bf16 activations, fp32 parameters) returns its mean and rstd in fp32
    (ATen's ``layer_norm_cpu``), where ``torch._refs`` casts them to the input's dtype. Elsewhere
    (CUDA, meta) the reference keeps them in fp32, as the kernel does."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.native_layer_norm.default):
        val, args = node.meta.get("val"), [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
        x, params = args[0], [p for p in args[2:4] if isinstance(p, torch.Tensor)]
        if not (isinstance(val, tuple) and isinstance(x, torch.Tensor) and x.device.type == "cpu"
                and any(p.dtype != x.dtype for p in params) and val[1].dtype != torch.float32):
            continue
        with val[1].fake_mode:
            stats = tuple(torch.empty_strided(v.shape, v.stride(), dtype=torch.float32, device=v.device)
                          for v in val[1:])
        node.meta["val"] = (val[0], *stats)
        for user in node.users:
            if user.target is operator.getitem and user.args[1] in (1, 2):
                user.meta["val"] = stats[user.args[1] - 1]


# -- the parts in modules of their own, as parts of this one ---------------------------------
from .distributed import ShardedGroup, active_ddp_module, collective_temporaries, fsdp_sharded_group  # noqa: E402,F401
from .profiler import MEMORY_EVENT, ProfilerEvent, profiler_active, profiler_events  # noqa: E402,F401
