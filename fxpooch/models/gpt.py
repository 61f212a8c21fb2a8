"""A GPT-2 style decoder-only transformer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .inputs import GPT2_DIM, GPT2_HEADS, GPT2_LAYERS, GPT2_SEQ, GPT2_VOCAB


# ============================================================================ GPT decoder
class CausalSelfAttention(nn.Module):
    """GPT-2 attention: fused qkv Linear, causal softmax attention, output Linear."""

    def __init__(self, d_model: int, n_head: int, seq: int, dropout: float, use_sdpa: bool) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.dropout = dropout
        self.use_sdpa = use_sdpa
        if not use_sdpa:
            # lower-triangular mask; not persistent: it is derived, not learnt
            self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = self.attn_drop(att.softmax(dim=-1)) @ v
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    """Pre-LN GPT-2 block: ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))`` with a 4x GELU MLP."""

    MLP_RATIO = 4

    def __init__(self, d_model: int, n_head: int, seq: int, dropout: float, use_sdpa: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, seq, dropout, use_sdpa)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, self.MLP_RATIO * d_model)
        self.c_proj = nn.Linear(self.MLP_RATIO * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        # GPT-2 uses the tanh approximation of GELU
        return x + self.drop(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    """GPT-2 style decoder: token + learnt position embeddings, blocks, final LN, LM head.

    ``forward(idx)`` maps token ids ``(B, T)`` with ``T <= seq`` to logits ``(B, T, vocab)``.
    """

    INIT_STD = 0.02  # GPT-2 initialisation

    def __init__(self, n_layer: int, d_model: int, n_head: int, seq: int, vocab: int,
                 dropout: float = 0.1, tie_weights: bool = True, use_sdpa: bool = False) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(d_model, n_head, seq, dropout, use_sdpa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.INIT_STD)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.seq:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.seq}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_decoder(n_layer: int = GPT2_LAYERS, d_model: int = GPT2_DIM, n_head: int = GPT2_HEADS,
                seq: int = GPT2_SEQ, vocab: int = GPT2_VOCAB, *, dropout: float = 0.1,
                tie_weights: bool = True, use_sdpa: bool = False) -> GPT:
    """GPT-2 style decoder (defaults: GPT-2 small, 124,439,808 parameters when tied).

    ``use_sdpa=False`` (default) writes attention as matmul + masked softmax, so the
    ``(B, heads, T, T)`` attention matrix is an ordinary activation; ``True`` uses
    ``F.scaled_dot_product_attention(is_causal=True)``.
    """
    return GPT(n_layer, d_model, n_head, seq, vocab, dropout, tie_weights, use_sdpa)
