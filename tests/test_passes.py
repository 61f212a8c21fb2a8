"""Golden graphs: the exact code each pass produces for fixed decisions on a small MLP."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxpooch
from fxpooch.planners import Evaluator
from fxpooch.graph import copies_of, view_in_copy
from fxpooch.schedule import Decision
from measure import measured_step_peak
from zoo import MiB

FIXED: dict[str, str] = {}


def fixed(problem):
    """The decisions in FIXED (keep for the rest): a planner passed as a function, not registered."""
    ev = Evaluator(problem)
    return ev.evaluate([Decision(FIXED.get(a.name, "keep")) for a in problem.graph.activations])


def compile_mlp(decisions: dict[str, str]) -> fxpooch.CompiledModule:
    FIXED.clear()
    FIXED.update(decisions)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    return fxpooch.compile(m, torch.randn(4, 8), "1GiB", planner=fixed, profile="analytic",
                           hardware="v100-pcie3")


def code(gm) -> str:
    return gm.code.strip()


FORWARD = """\
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_1 = next(args_iter)
    primals_2 = next(args_iter)
    primals_3 = next(args_iter)
    primals_4 = next(args_iter)
    primals_5 = next(args_iter)
    primals_6 = next(args_iter)
    primals_7 = next(args_iter)
    args_list.clear()
    t = torch.ops.aten.t.default(primals_1)
    addmm = torch.ops.aten.addmm.default(primals_2, primals_3, t);  t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    detach = torch.ops.aten.detach.default(relu);  detach = None
    offload_relu = torch.ops.fxpooch.offload.default(relu, 0)
    t_1 = torch.ops.aten.t.default(primals_4)
    addmm_1 = torch.ops.aten.addmm.default(primals_5, relu, t_1);  relu = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    detach_1 = torch.ops.aten.detach.default(relu_1)
    drop_relu_1 = torch.ops.fxpooch.drop.default(relu_1)
    drop_detach_1 = torch.ops.fxpooch.drop.default(detach_1);  detach_1 = None
    t_2 = torch.ops.aten.t.default(primals_6)
    addmm_2 = torch.ops.aten.addmm.default(primals_7, relu_1, t_2);  relu_1 = None
    return (addmm_2, primals_3, offload_relu, offload_relu, t_1, drop_relu_1, drop_detach_1, t_2, primals_1, primals_2, primals_4, primals_5, primals_6, primals_7)
"""

BACKWARD = """\
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_3 = next(args_iter)
    relu = next(args_iter)
    detach = next(args_iter)
    t_1 = next(args_iter)
    relu_1 = next(args_iter)
    detach_1 = next(args_iter)
    t_2 = next(args_iter)
    primals_1 = next(args_iter)
    primals_2 = next(args_iter)
    primals_4 = next(args_iter)
    primals_5 = next(args_iter)
    primals_6 = next(args_iter)
    primals_7 = next(args_iter)
    tangents_1 = next(args_iter)
    args_list.clear()
    prefetch_relu = torch.ops.fxpooch.prefetch.default(relu, device(type='cpu'), 0);  relu = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm = torch.ops.aten.mm.default(tangents_1, t_3);  t_3 = None
    t_4 = torch.ops.aten.t.default(tangents_1)
    wait_relu = torch.ops.fxpooch.wait.default(prefetch_relu, 0);  prefetch_relu = None
    alias_detach = torch.ops.aten.alias.default(wait_relu)
    re_addmm_1 = torch.ops.aten.addmm.default(primals_5, wait_relu, t_1);  primals_5 = None
    re_relu_1 = torch.ops.aten.relu.default(re_addmm_1);  re_addmm_1 = None
    re_detach_1 = torch.ops.aten.detach.default(re_relu_1)
    mm_1 = torch.ops.aten.mm.default(t_4, re_relu_1);  t_4 = re_relu_1 = None
    t_5 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
    view = torch.ops.aten.view.default(sum_1, [8]);  sum_1 = None
    t_6 = torch.ops.aten.t.default(t_5);  t_5 = None
    detach_2 = torch.ops.aten.detach.default(re_detach_1);  re_detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_2, 0);  mm = detach_2 = None
    t_7 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_2 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(threshold_backward)
    mm_3 = torch.ops.aten.mm.default(t_8, wait_relu);  t_8 = wait_relu = None
    t_9 = torch.ops.aten.t.default(mm_3);  mm_3 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_1 = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
    t_10 = torch.ops.aten.t.default(t_9);  t_9 = None
    detach_3 = torch.ops.aten.detach.default(alias_detach);  alias_detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_2, detach_3, 0);  mm_2 = detach_3 = None
    t_11 = torch.ops.aten.t.default(threshold_backward_1)
    mm_4 = torch.ops.aten.mm.default(t_11, primals_3);  t_11 = primals_3 = None
    t_12 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_2 = torch.ops.aten.view.default(sum_3, [8]);  sum_3 = None
    t_13 = torch.ops.aten.t.default(t_12);  t_12 = None
    return (t_13, view_2, None, t_10, view_1, t_6, view)
"""


def test_swap_and_recompute_golden():
    cm = compile_mlp({"relu": "swap", "relu_1": "recompute"})
    assert cm.plan.decisions == {"relu": "swap", "relu_1": "recompute"}
    assert code(cm.forward_graphs[0]) == FORWARD.strip()
    assert code(cm.backward_graphs[0]) == BACKWARD.strip()


def test_keep_inserts_nothing():
    cm = compile_mlp({})
    text = code(cm.forward_graphs[0]) + code(cm.backward_graphs[0])
    assert "fxpooch" not in text and "re_" not in text


def test_decisions_live_in_node_meta():
    cm = compile_mlp({"relu": "swap", "relu_1": "recompute"})
    marked = {n.name: n.meta["fxpooch"] for gm in (*cm.forward_graphs, *cm.backward_graphs)
              for n in gm.graph.nodes if "fxpooch" in n.meta}
    assert marked["offload_relu"] == {"activation": "relu", "decision": "swap"}
    assert marked["prefetch_relu"]["decision"] == "swap"
    assert marked["re_relu_1"] == {"activation": "relu_1", "decision": "recompute", "recomputes": "relu_1"}


def test_recompute_placed_before_first_use_not_at_backward_start():
    cm = compile_mlp({"relu_1": "recompute"})
    names = [n.name for n in cm.backward_graphs[0].graph.nodes if n.op == "call_function"]
    first_use = names.index("mm_1")
    chain = [n for n in names if n.startswith("re_")]
    assert chain == ["re_addmm_1", "re_relu_1", "re_detach_1"]
    assert names.index("re_detach_1") == first_use - 1  # the chain ends just before its reader
    assert names.index("re_addmm_1") > names.index("mm")  # ... and starts after earlier backward work


def test_dropout_is_recomputed_from_its_mask_which_is_never_drawn_again():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 8))
    eager, x = copy.deepcopy(m), torch.randn(4, 8)
    FIXED.clear()
    FIXED.update(relu="recompute")
    cm = fxpooch.compile(m, x, "1GiB", planner=fixed, profile="analytic", hardware="v100-pcie3")
    ev = Evaluator(fxpooch.planners.Problem(cm.plan.graph, cm.plan.profile.costs(cm.plan.graph), 2**40))
    recomputable = {a.name: ev.can_recompute(i, ev.all_keep()) for i, a in enumerate(cm.plan.graph.activations)}
    # the mask is the random draw: never recomputed; relu is, through the dropout rebuilt from the saved mask
    assert recomputable == {"getitem_1": False, "relu": True}
    chain = [line.strip() for line in code(cm.backward_graphs[0]).splitlines() if line.strip().startswith("re_")]
    assert chain == [
        "re_t = torch.ops.aten.t.default(primals_1);  primals_1 = None",
        "re_addmm = torch.ops.aten.addmm.default(primals_2, primals_3, re_t);  primals_2 = re_t = None",
        "re_native_dropout = torch.ops.aten.native_dropout_backward.default(re_addmm, getitem_1, 2.0);  re_addmm = None",
        "re_getitem = torch.ops.aten.alias.default(re_native_dropout);  re_native_dropout = None",
        "re_relu = torch.ops.aten.relu.default(re_getitem);  re_getitem = None",
        "re_detach = torch.ops.aten.detach.default(re_relu)",
    ]
    for module in (cm, eager):  # the same draws: the masks agree
        torch.manual_seed(1)
        module(x).square().sum().backward()
    for p, q in zip(m.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_rewritten_graphs_print_readably():
    cm = compile_mlp({"relu": "swap"})
    text = cm.forward_graphs[0].print_readable(print_output=False)
    assert "torch.ops.fxpooch.offload.default(relu, 0)" in text


SHARED_TAIL = """\
    args_list.clear()
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm = torch.ops.aten.mm.default(tangents_1, t_3);  t_3 = None
    t_4 = torch.ops.aten.t.default(tangents_1)
    re_t = torch.ops.aten.t.default(primals_1);  primals_1 = None
    re_addmm = torch.ops.aten.addmm.default(primals_2, primals_3, re_t);  primals_2 = re_t = None
    re_relu = torch.ops.aten.relu.default(re_addmm);  re_addmm = None
    re_detach = torch.ops.aten.detach.default(re_relu)
    re_addmm_1 = torch.ops.aten.addmm.default(primals_5, re_relu, t_1);  primals_5 = None
    re_relu_1 = torch.ops.aten.relu.default(re_addmm_1);  re_addmm_1 = None
    re_detach_1 = torch.ops.aten.detach.default(re_relu_1)
    mm_1 = torch.ops.aten.mm.default(t_4, re_relu_1);  t_4 = re_relu_1 = None
    t_5 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
    view = torch.ops.aten.view.default(sum_1, [8]);  sum_1 = None
    t_6 = torch.ops.aten.t.default(t_5);  t_5 = None
    detach_2 = torch.ops.aten.detach.default(re_detach_1);  re_detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_2, 0);  mm = detach_2 = None
    t_7 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_2 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(threshold_backward)
    mm_3 = torch.ops.aten.mm.default(t_8, re_relu);  t_8 = re_relu = None
    t_9 = torch.ops.aten.t.default(mm_3);  mm_3 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_1 = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
    t_10 = torch.ops.aten.t.default(t_9);  t_9 = None
    detach_3 = torch.ops.aten.detach.default(re_detach);  re_detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_2, detach_3, 0);  mm_2 = detach_3 = None
    t_11 = torch.ops.aten.t.default(threshold_backward_1)
    mm_4 = torch.ops.aten.mm.default(t_11, primals_3);  t_11 = primals_3 = None
    t_12 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_2 = torch.ops.aten.view.default(sum_3, [8]);  sum_3 = None
    t_13 = torch.ops.aten.t.default(t_12);  t_12 = None
    return (t_13, view_2, None, t_10, view_1, t_6, view)
"""


def test_shared_segment_recomputes_once_and_matches_eager():
    """relu_1's chain rebuilds relu (and its alias) on the way: relu is not recomputed again at
    its own first reader, but kept from there until its last one, as checkpointing does."""
    cm = compile_mlp({"relu": "recompute", "relu_1": "recompute"})
    sched = cm.plan.schedule
    relu, relu_1 = (next(i for i, a in enumerate(cm.plan.graph.activations) if a.name == n) for n in ("relu", "relu_1"))
    assert sched.materialises == {relu_1: (relu_1, relu)} and sched.shared
    backward = code(cm.backward_graphs[0])
    assert backward[backward.index("    args_list.clear()"):] == SHARED_TAIL.strip("\n")
    eager = copy.deepcopy(cm.model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    cm(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (name, p), q in zip(cm.model.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


PROTOCOL = """\
    offload_relu = torch.ops.fxpooch.offload.default(relu, 0)
    offload_relu_1 = torch.ops.fxpooch.offload.default(relu_1, 1)
    prefetch_relu_1 = torch.ops.fxpooch.prefetch.default(relu_1, device(type='cpu'), 1);  relu_1 = None
    prefetch_relu = torch.ops.fxpooch.prefetch.default(relu, device(type='cpu'), 0);  relu = None
    wait_relu_1 = torch.ops.fxpooch.wait.default(prefetch_relu_1, 1);  prefetch_relu_1 = None
    wait_relu = torch.ops.fxpooch.wait.default(prefetch_relu, 0);  prefetch_relu = None
"""


def protocol(*gms) -> str:
    return "".join(line + "\n" for gm in gms for line in gm.code.splitlines() if "torch.ops.fxpooch." in line)


def test_slots_pair_each_offload_with_its_prefetch_and_wait():
    """Two swapped activations: slots in the schedule's offload order; the backward prefetches the
    later one first, and each prefetch and wait names the slot its offload wrote (relu_1 and its
    detach share one copy). The step then matches eager and leaves no host copy behind."""
    cm = compile_mlp({"relu": "swap", "relu_1": "swap"})
    assert protocol(cm.forward_graphs[0], cm.backward_graphs[0]) == PROTOCOL
    eager = copy.deepcopy(cm.model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step reuses the first one's blocks
        cm.model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        cm(x).square().sum().backward()
        eager(x).square().sum().backward()
        for p, q in zip(cm.model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert not cm.runtime.slots and not cm.host_pool.in_use
        assert cm.host_pool_bytes == cm.plan.host_bytes


RELEASE_FORWARD = """\
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    detach = torch.ops.aten.detach.default(relu);  detach = None
    offload_relu = torch.ops.fxpooch.offload.default(relu, 0, released = True)
    t_1 = torch.ops.aten.t.default(primals_4)
    addmm_1 = torch.ops.aten.addmm.default(primals_5, relu, t_1);  relu = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    release_relu = torch.ops.fxpooch.release.default(offload_relu, 0);  offload_relu = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  detach_1 = None
    offload_relu_1 = torch.ops.fxpooch.offload.default(relu_1, 1, released = True)
    t_2 = torch.ops.aten.t.default(primals_6)
    addmm_2 = torch.ops.aten.addmm.default(primals_7, relu_1, t_2);  relu_1 = None
    relu_2 = torch.ops.aten.relu.default(addmm_2);  addmm_2 = None
    release_relu_1 = torch.ops.fxpooch.release.default(offload_relu_1, 1);  offload_relu_1 = None
    detach_2 = torch.ops.aten.detach.default(relu_2)
    return (relu_2, primals_3, release_relu, release_relu, t_1, release_relu_1, release_relu_1, t_2, detach_2, \
primals_1, primals_2, primals_4, primals_5, primals_6, primals_7)"""


def test_release_frees_an_offloaded_buffer_where_the_plan_has_its_copy_done():
    """Over NVLink a 1 MiB copy (24 us) outlasts the next layer's matmul (22 us) but not its relu: each
    offloaded relu is released (the compute stream waits for its copy, and the runtime drops the copied
    tensor, held since its offload) after the next layer's relu, where the timeline has its copy done.
    On CPU the copy is done when offload returns, so nothing is held: the step matches eager, and the
    counter sees the planned peak."""
    FIXED.clear()
    FIXED.update({"relu": "swap", "relu_1": "swap"})
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(512, 512), nn.ReLU())])
    x = torch.randn(512, 512)
    cm = fxpooch.compile(copy.deepcopy(model), x, "1GiB", planner=fixed, profile="analytic", hardware="v100-nvlink2")
    ops = cm.plan.graph.ops
    assert {cm.plan.graph.activations[a].name: ops[o].name for a, o in cm.plan.releases.items()} == {
        "relu": "detach_1", "relu_1": "detach_2"}
    forward = code(cm.forward_graphs[0])
    assert forward[forward.index("    relu = "):] == RELEASE_FORWARD
    assert measured_step_peak(cm, (x,), cm.plan.graph.resident_bytes) == cm.plan.peak_bytes
    cm.model.zero_grad(set_to_none=True)
    cm(x).square().sum().backward()
    model(x).square().sum().backward()
    for p, q in zip(cm.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


RELEASE_BACKWARD = """\
    detach_3 = torch.ops.aten.detach.default(detach_2);  detach_2 = None
    release_relu = torch.ops.fxpooch.release.default(relu, 0);  relu = None
    threshold_backward = torch.ops.aten.threshold_backward.default(tangents_1, detach_3, 0);  tangents_1 = detach_3 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    release_relu_1 = torch.ops.fxpooch.release.default(relu_1, 1);  relu_1 = None
    mm = torch.ops.aten.mm.default(threshold_backward, t_3);  t_3 = None
    t_4 = torch.ops.aten.t.default(threshold_backward)
    prefetch_relu_1 = torch.ops.fxpooch.prefetch.default(release_relu_1, device(type='cpu'), 1);  release_relu_1 = None"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CPU variant runs the same graphs"))])
def test_a_release_in_the_backward_comes_before_its_op_and_feeds_the_prefetch(device: str):
    """Where an offload's copy ends after the forward, the plan may release its buffer in the
    backward (:func:`fxpooch.simulator.release_points`): the forward offloads it held and returns
    the host copy itself, and the backward releases it before the op, from the host copy the prefetch
    then reads. Run op by op, the graphs give eager's gradients and leave no slot or block behind."""
    from fxpooch import runtime
    from fxpooch.passes import rewrite_pair
    from fxpooch.planners import Problem
    from fxpooch.simulator import release_points

    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(512, 512), nn.ReLU())]).to(device)
    x = torch.randn(512, 512, device=device)
    step = fxpooch.trace_step(model, (x,))
    g = step.graph
    costs = fxpooch.profile_step(step, "analytic", hardware="v100-pcie3").costs(g)
    # under 9 MiB the prefetches wait for the backward's first ops (the peak, in the forward, is 11 MiB:
    # the schedule of these decisions, not a plan within 9 MiB); each 1 MiB copy (87 us) ends after the forward
    swapped = [Decision.SWAP if a.name in ("relu", "relu_1") else Decision.KEEP for a in g.activations]
    cand = Evaluator(Problem(g, costs, 9 * MiB)).evaluate(swapped)
    releases = release_points(g, cand.schedule, cand.timeline)
    assert {g.activations[a].name: g.ops[o].name for a, o in releases.items()} == {
        "relu": "threshold_backward", "relu_1": "mm"}
    rewritten = rewrite_pair(0, g, step.table, cand.schedule, releases)
    forward, backward = code(rewritten.forward), code(rewritten.backward)
    assert "fxpooch.release" not in forward and forward.count("released = True") == 2
    if device == "cpu":
        assert backward[backward.index("    detach_3 = "):backward.index("\n    wait_relu_1")] == RELEASE_BACKWARD

    params = [p.detach() for p in model.parameters()]
    primals = [params[0], params[1], x, *params[2:]]
    outs = torch.fx.Interpreter(rewritten.forward).run(*primals)
    grads = torch.fx.Interpreter(rewritten.backward).run(*outs[1:], torch.ones_like(outs[0]))
    assert not runtime.DEFAULT.slots and not runtime.DEFAULT.pool.in_use and not runtime.DEFAULT.incoming
    model(x).sum().backward()
    expected = [p.grad for p in model.parameters()]
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {}
    for got, want in zip((t for t in grads if t is not None), expected, strict=True):
        torch.testing.assert_close(got, want, **exact)


def test_rewritten_graphs_run_op_by_op_on_the_default_state():
    """The graphs are ordinary FX: an Interpreter runs them node by node, outside the compiled
    module, on ``fxpooch.runtime.DEFAULT``; the backward's gradients are the compiled module's."""
    from fxpooch import runtime

    cm = compile_mlp({"relu": "swap", "relu_1": "swap"})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    cm.model.zero_grad(set_to_none=True)
    out = cm(x)
    out.backward(torch.ones_like(out))
    expected = [p.grad for p in cm.model.parameters()]
    fw, bw = cm.forward_graphs[0], cm.backward_graphs[0]
    params = [p.detach() for p in cm.model.parameters()]
    primals = [params[0], params[1], x, *params[2:]]  # primals_1..7: the first layer's weight, bias, then x
    outs = torch.fx.Interpreter(fw).run(*primals)
    assert set(runtime.DEFAULT.slots) == {0, 1}  # the host copies wait in their slots
    saved = list(outs[1:])
    grads = torch.fx.Interpreter(bw).run(*saved, torch.ones_like(outs[0]))
    assert not runtime.DEFAULT.slots and not runtime.DEFAULT.pool.in_use
    for g, e in zip((g for g in grads if g is not None), expected, strict=True):  # x has no gradient
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_prefetch_of_an_empty_slot_is_an_error():
    from fxpooch import runtime

    state = runtime.Runtime(runtime.HostPool(limit_bytes=None, pin=False))
    x = torch.randn(512, 512)
    with state.entered():
        host = torch.ops.fxpooch.offload(x, 3)
        with pytest.raises(RuntimeError, match="slot 4 does not hold this host copy"):
            torch.ops.fxpooch.prefetch(host, x.device, 4)
        back = torch.ops.fxpooch.wait(torch.ops.fxpooch.prefetch(host, x.device, 3), 3)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    assert not state.slots and not state.pool.in_use and state.pool.total_bytes == 2**20


def test_a_host_copy_never_prefetched_returns_its_block():
    from fxpooch import runtime

    state = runtime.Runtime(runtime.HostPool(limit_bytes=None, pin=False))
    with state.entered():
        host = torch.ops.fxpooch.offload(torch.randn(512, 512), 0)
    assert state.pool.in_use_bytes == 2**20 and set(state.slots) == {0}
    del host  # a forward whose backward never runs
    assert not state.slots and not state.pool.in_use and state.pool.total_bytes == 2**20


class Scores(nn.Module):
    """Attention's core: softmax(q q^T) @ q with q = Linear(x) and (1, 4, 256, 256) scores = 1 MiB.
    Autograd saves the softmax output twice, as is (softmax's backward) and reshaped to
    (4, 256, 256) (the matmul's): two layouts of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        return (q @ q.transpose(-1, -2)).softmax(-1) @ q


def test_a_storage_saved_in_two_layouts_is_copied_once():
    """Swapping the softmax output moves 1 MiB, not 2: one host copy (one slot), and its other
    layout is an ``as_strided`` view of that copy, on the host in the forward and on the device in
    the backward. The step matches eager, and the counter sees the planned peak."""
    torch.manual_seed(0)
    model, x = Scores(), torch.randn(1, 4, 256, 64)
    FIXED.clear()
    ref = fxpooch.compile(copy.deepcopy(model), x, "1GiB", planner=fixed, profile="analytic", hardware="v100-pcie3")
    scores = next(a for a in ref.plan.graph.activations if len(a.members) == 2)
    assert scores.member_bytes == (MiB, 0) and scores.transfer_bytes == MiB and scores.view_of == (0, 0)
    FIXED.update({scores.name: "swap"})
    cm = fxpooch.compile(copy.deepcopy(model), x, "1GiB", planner=fixed, profile="analytic", hardware="v100-pcie3")
    assert protocol(cm.forward_graphs[0], cm.backward_graphs[0]) == SCORES_PROTOCOL
    views = [line.strip() for gm in (cm.forward_graphs[0], cm.backward_graphs[0])
             for line in gm.code.splitlines() if "as_strided" in line]
    assert views == SCORES_VIEWS
    # the backward's first op reads the scores: back as one 1 MiB storage, the peak is in-core's
    # (a copy per layout would come back as 2 MiB)
    assert cm.plan.static_peak_bytes == ref.plan.static_peak_bytes
    assert measured_step_peak(cm, (x,), cm.plan.graph.resident_bytes) == cm.plan.static_peak_bytes
    model(x).backward(torch.ones(1, 4, 256, 64))
    for (name, p), q in zip(cm.model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


SCORES_PROTOCOL = """\
    offload_detach = torch.ops.fxpooch.offload.default(detach, 0);  detach = None
    prefetch_detach = torch.ops.fxpooch.prefetch.default(detach, device(type='cpu'), 0);  detach = None
    wait_detach = torch.ops.fxpooch.wait.default(prefetch_detach, 0);  prefetch_detach = None
"""
SCORES_VIEWS = [
    "host_view_5 = torch.ops.aten.as_strided.default(offload_detach, [4, 256, 256], [65536, 256, 1], 0)",
    "device_view_5 = torch.ops.aten.as_strided.default(wait_detach, [4, 256, 256], [65536, 256, 1], 0)",
]


_BASE = torch.arange(24.0).reshape(4, 6)


@pytest.mark.parametrize("views, expected", [
    ([_BASE, _BASE.view(4, 6)], (0, 0)),  # the same layout: one copy
    ([_BASE.view(2, 12), _BASE], (0, 0)),  # reshaped
    ([_BASE.t(), _BASE], (0, 0)),  # transposed: a dense copy of either holds the other
    ([_BASE, _BASE[1:3]], (0, 0)),  # a slice inside the copied span
    ([_BASE[:2], _BASE[2:]], (0, 1)),  # disjoint halves: a copy each
    ([_BASE[:, ::2], _BASE[:, :1]], (0, 1)),  # the larger view is not dense: its copy has gaps
    ([_BASE, _BASE.view(torch.int32)], (0, 1)),  # another dtype
])
def test_which_views_of_a_storage_are_copied(views, expected):
    assert copies_of(views) == expected
    for i, j in enumerate(expected):  # a view rebuilt from a copy reads the same elements
        if i != j:
            copied = torch.empty_strided(views[j].shape, views[j].stride()).copy_(views[j])
            shape, stride, offset = view_in_copy(views[i], views[j])
            assert torch.equal(copied.as_strided(shape, stride, offset), views[i])
