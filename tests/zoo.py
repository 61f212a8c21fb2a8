"""Small, fast, deterministic test models whose activations are whole MiB in fp32.

Every factory takes a ``seed`` and returns ``(model, example_input)``. The same seed
gives bit-identical parameters and input, and the global RNG state is left
untouched. Sizes are chosen so that each main activation is an exact multiple of
1 MiB in fp32 (``MiB = 512 * 512 * 4`` bytes), which makes hand-computed memory
budgets in tests exact. Every model trains one fwd+bwd step in well under 0.5 s on
2 CPU cores.

Models are plain ``torch.nn`` and do not depend on fxpooch.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MiB", "ZOO", "mlp", "cnn_bn", "resnet_small", "transformer_block",
    "BasicBlock", "SelfAttention", "TransformerBlock", "fwd_bwd",
]

MiB = 1 << 20  # bytes
FP32 = 4  # bytes per float32 element
WIDTH = 512  # MLP feature width: a (512, 512) fp32 activation is exactly 1 MiB

# Image models: (4, 16, 64, 64) fp32 = 4 * 16 * 64 * 64 * 4 B = 1 MiB per activation.
IMG_BATCH = 4
IMG_CHANNELS = 16
IMG_SIZE = 64
NUM_CLASSES = 10  # size of the classification heads (tiny, not a whole MiB)

# Transformer: (16, 128, 128) fp32 = 1 MiB; attention scores (16, 4, 128, 128) = 4 MiB;
# MLP hidden (16, 128, 512) = 4 MiB.
TF_BATCH = 16
TF_SEQ = 128
TF_DIM = 128
TF_HEADS = 4
TF_MLP_RATIO = 4
TF_DROPOUT = 0.1

Factory = Callable[[], tuple[nn.Module, torch.Tensor]]


def _seeded(build: Callable[[], nn.Module], input_shape: tuple[int, ...],
            seed: int) -> tuple[nn.Module, torch.Tensor]:
    """Build a model and a standard-normal input deterministically from ``seed``.

    Runs under :func:`torch.random.fork_rng` so the caller's global RNG state is
    not disturbed.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
        x = torch.randn(*input_shape)
    return model, x


# ----------------------------------------------------------------------------- MLP
def mlp(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """4-layer MLP ``Linear(512,512) -> ReLU`` x3 ``-> Linear``; input (2048, 512).

    Every activation (each Linear and ReLU output) is exactly 4 MiB; each weight
    is 1 MiB and each bias 2 KiB, so activations dominate as in real out-of-core cases.
    """
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH),
        )
    return _seeded(build, (4 * WIDTH, WIDTH), seed)


# ----------------------------------------------------------------------------- CNN + BN
def _conv_bn_relu(channels: int) -> list[nn.Module]:
    """3x3 same-padding conv (no bias), BatchNorm2d, in-place ReLU."""
    return [
        nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
    ]


class _GlobalAvgPool(nn.Module):
    """Mean over the spatial dimensions: (N, C, H, W) -> (N, C)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def cnn_bn(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """Three ``Conv2d(16,16,3) -> BatchNorm2d -> ReLU(inplace)`` blocks and a linear head.

    Input (4, 16, 64, 64); every conv/BN output is exactly 1 MiB (the in-place
    ReLU reuses the BN output). Head: global average pool -> Linear(16, 10).
    """
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += _conv_bn_relu(IMG_CHANNELS)
        layers += [_GlobalAvgPool(), nn.Linear(IMG_CHANNELS, NUM_CLASSES)]
        return nn.Sequential(*layers)
    return _seeded(build, (IMG_BATCH, IMG_CHANNELS, IMG_SIZE, IMG_SIZE), seed)


# ----------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn, identity add, relu (same shape)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


def resnet_small(seed: int = 0, num_blocks: int = 3) -> tuple[nn.Module, torch.Tensor]:
    """Stem conv-bn-relu, ``num_blocks`` :class:`BasicBlock` (16 channels, 64x64), head.

    Input (4, 16, 64, 64); every activation inside the trunk is exactly 1 MiB.
    Head: global average pool -> Linear(16, 10).
    """
    def build() -> nn.Module:
        return nn.Sequential(
            *_conv_bn_relu(IMG_CHANNELS),
            *[BasicBlock(IMG_CHANNELS) for _ in range(num_blocks)],
            _GlobalAvgPool(),
            nn.Linear(IMG_CHANNELS, NUM_CLASSES),
        )
    return _seeded(build, (IMG_BATCH, IMG_CHANNELS, IMG_SIZE, IMG_SIZE), seed)


# ----------------------------------------------------------------------------- Transformer
class SelfAttention(nn.Module):
    """Multi-head self-attention from Linear layers and an explicit softmax.

    (Not ``nn.MultiheadAttention``, so every intermediate is an ordinary op.)
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3, heads, head_dim) -> 3 x (b, heads, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        attn = scores.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.proj(out))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + Attn(LN(x))`` then ``x + MLP(LN(x))`` with GELU and dropout."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = TF_MLP_RATIO,
                 dropout: float = TF_DROPOUT) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def transformer_block(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """One pre-LN :class:`TransformerBlock` (dim 128, 4 heads, MLP 512, dropout 0.1).

    Input (16, 128, 128) = 1 MiB; attention scores/probabilities are 4 MiB, the
    MLP hidden activation 4 MiB. The model is in training mode, so dropout is
    random: seed the global RNG before a step to make it reproducible.
    """
    return _seeded(lambda: TransformerBlock(TF_DIM, TF_HEADS), (TF_BATCH, TF_SEQ, TF_DIM), seed)


# ----------------------------------------------------------------------------- registry
ZOO: dict[str, Factory] = {
    "mlp": mlp,
    "cnn_bn": cnn_bn,
    "resnet_small": resnet_small,
    "transformer_block": transformer_block,
}


def fwd_bwd(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One training step without an optimiser: ``loss = model(x).sum(); loss.backward()``.

    Returns the (detached) loss.
    """
    loss = model(x).sum()
    loss.backward()
    return loss.detach()


if __name__ == "__main__":  # time one fwd+bwd of every model (best of a few)
    import time

    REPEATS = 5  # timed steps per model, after one warm-up step
    for zoo_name, factory in ZOO.items():
        net, inp = factory()
        fwd_bwd(net, inp)  # warm-up (lazy kernel initialisation)
        times = []
        for _ in range(REPEATS):
            net.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fwd_bwd(net, inp)
            times.append(time.perf_counter() - start)
        print(f"{zoo_name:>18}: fwd+bwd {1e3 * min(times):7.1f} ms (best of {REPEATS}), "
              f"input {tuple(inp.shape)} = {inp.numel() * FP32 / MiB:g} MiB")
