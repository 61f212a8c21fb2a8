"""HuggingFace transformers models through fxpooch, next to an eager deep copy.

Models are built from small configs (nothing is downloaded), take keyword inputs (a dict
example input: ``input_ids``, ``labels``, ...) and return a ``ModelOutput`` dataclass whose
``.loss`` is computed inside the model. Dropout is on (``model.train()``); the same seed before
each step gives the same masks, so fxpooch must match eager exactly (the same CPU kernels run,
dropout is never recomputed).

GPT-2 uses the default SDPA attention (a fused attention op that draws dropout inside it, so it
must be kept or swapped, never recomputed); BERT uses ``attn_implementation="eager"`` (explicit
softmax and ``nn.Dropout`` on the probabilities). Each model is compiled at the in-core limit and
at its floor (the smallest feasible limit, computed once from the in-core plan's step graph by
the planner itself, so finding it costs no second capture). Install with ``pip install -e
.[thirdparty]``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

import fxpooch
from fxpooch.capture import GraphPair
from fxpooch.planners import Problem, get_planner

transformers = pytest.importorskip("transformers")

ANALYTIC = dict(profile="analytic", hardware="v100-pcie3")
VOCAB, SEQ, BATCH = 1000, 128, 8


def gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, {"input_ids": ids, "labels": ids}


def bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=512, max_position_embeddings=SEQ,
                                     attn_implementation="eager")
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.ones_like(ids)
    mask[::2, SEQ - 16:] = 0  # half the batch padded
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))  # MLM: 15% scored
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class Case:
    build: Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]
    output_type: str

    def make(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model, inputs = self.build()
        model.train()  # dropout on
        return model, inputs


CASES = {
    "gpt2": Case(gpt2, "CausalLMOutputWithCrossAttentions"),
    "bert": Case(bert, "MaskedLMOutput"),
}

_floors: dict[str, int] = {}


def floor_of(plan: fxpooch.Plan) -> int:
    """The smallest limit the planner meets on this step graph (what compile(..., 1) would report)."""
    with pytest.raises(fxpooch.InfeasibleMemoryLimit) as info:
        get_planner(plan.planner)(Problem(plan.graph, plan.profile.costs(plan.graph), 1))
    return info.value.min_feasible_bytes


def floor(name: str) -> int:
    if name not in _floors:
        model, inputs = CASES[name].make()
        _floors[name] = floor_of(fxpooch.compile(model, inputs, "1TiB", **ANALYTIC).plan)
    return _floors[name]


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected):
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def train_side_by_side(name: str, limit) -> fxpooch.CompiledModule:
    case = CASES[name]
    model, inputs = case.make()
    eager = copy.deepcopy(model)
    cm = fxpooch.compile(model, inputs, limit, **ANALYTIC)
    if name not in _floors:  # the in-core plan's graph gives the floor for the tight test
        _floors[name] = floor_of(cm.plan)
    assert cm.plan.peak_bytes <= cm.plan.mem_limit
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(eager.parameters(), lr=0.1)

    ran: list[GraphPair] = []
    call_forward = GraphPair.call_forward

    def recording(self, args):
        ran.append(self)
        return call_forward(self, args)

    for step in range(2):
        ran.clear()
        with mock.patch.object(GraphPair, "call_forward", recording):
            torch.manual_seed(step)
            out = cm(**inputs)
        torch.manual_seed(step)
        ref = eager(**inputs)
        # graph breaks: every dynamo graph of the step is one of the plan's, each once
        planned = [id(g) for g in cm.forward_graphs]
        assert [id(p.run_forward) for p in ran] == planned, "a graph ran that the plan does not cover"
        assert type(out).__name__ == case.output_type
        assert out.loss is not None and out.loss.requires_grad and out.loss.dim() == 0
        out.loss.backward()
        ref.loss.backward()
        assert_same(out.loss, ref.loss, f"step {step}: loss")
        assert_same(out.logits, ref.logits, f"step {step}: logits")
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None and q.grad is not None, n
            assert_same(p.grad, q.grad, f"step {step}: grad of {n}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state, ref_state = model.state_dict(), eager.state_dict()
    assert list(state) == list(ref_state)
    for k in ref_state:
        assert_same(state[k], ref_state[k], f"state_dict[{k!r}]")
    return cm


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_core_matches_eager(name: str):
    cm = train_side_by_side(name, "1TiB")
    counts = cm.plan.counts()
    assert counts["swap"] == counts["recompute"] == 0
    assert counts["keep"] > 0
    # GPT-2 computes its loss after a graph break in recent transformers; BERT is one graph
    assert 1 <= len(cm.forward_graphs) <= 3
    assert len(cm.backward_graphs) == len(cm.forward_graphs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_floor_matches_eager(name: str):
    limit = floor(name)
    cm = train_side_by_side(name, limit)
    counts = cm.plan.counts()
    assert counts["swap"] + counts["recompute"] > 0, counts
    assert cm.plan.peak_bytes <= limit < cm.plan.in_core_peak_bytes
