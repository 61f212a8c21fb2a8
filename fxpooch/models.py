"""Models for the planning benchmarks, built in code (no torchvision, no downloads).

* :func:`resnet50`, :func:`alexnet`, :func:`vgg16`: the torchvision architectures
  (same layers and parameter counts: 25,557,032 / 61,100,840 / 138,357,544 for
  1000 classes), written out here so the benchmarks need nothing but torch.
* :func:`resnext101_3d`: 3D ResNeXt-101 of Hara et al., "Can Spatiotemporal 3D
  CNNs Retrace the History of 2D CNNs and ImageNet?" (CVPR 2018): layers
  [3, 4, 23, 3], bottleneck with a grouped 3x3x3 conv (cardinality 32), input
  ``(N, 3, T, H, W)``.
* :func:`gpt_decoder`: a GPT-2 style decoder-only transformer.

:data:`MODELS` maps a name to a :class:`ModelSpec`, which knows how to build the
model and make an example input of a given batch size. Build on any device with
``with torch.device(dev): model = spec.build()``; the meta device is useful to
inspect shapes without using memory.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelSpec", "MODELS", "resnet50", "resnet", "alexnet", "vgg16", "vgg",
    "resnext101_3d", "resnext_3d", "gpt_decoder", "GPT", "image_input", "video_input",
    "token_input",
]

IMAGENET_CLASSES = 1000
KINETICS_CLASSES = 400  # Hara et al. train the 3D models on Kinetics-400
RGB = 3  # input channels of every vision model here

# GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 12 heads, context 1024.
GPT2_VOCAB = 50257
GPT2_SEQ = 1024
GPT2_LAYERS = 12
GPT2_DIM = 768
GPT2_HEADS = 12

InputLike = torch.Tensor | tuple[torch.Tensor, ...]


# ============================================================================ example inputs
def _generator(seed: int, device: torch.device) -> torch.Generator | None:
    """A seeded CPU generator, or ``None`` on devices where generators make no sense."""
    if device.type != "cpu":
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _device(device: torch.device | str | None) -> torch.device:
    """``device`` or, if ``None``, the current default device."""
    return torch.device(device) if device is not None else torch.get_default_device()


def image_input(batch: int, image_size: int = 224, *, channels: int = RGB,
                device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> torch.Tensor:
    """Standard-normal images ``(batch, channels, image_size, image_size)``."""
    dev = _device(device)
    shape = (batch, channels, image_size, image_size)
    g = _generator(seed, dev)
    if g is None:
        return torch.randn(shape, device=dev, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=dtype).to(dev)


def video_input(batch: int, frames: int = 16, image_size: int = 112, *, channels: int = RGB,
                device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> torch.Tensor:
    """Standard-normal clips ``(batch, channels, frames, image_size, image_size)``."""
    dev = _device(device)
    shape = (batch, channels, frames, image_size, image_size)
    g = _generator(seed, dev)
    if g is None:
        return torch.randn(shape, device=dev, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=dtype).to(dev)


def token_input(batch: int, seq: int = GPT2_SEQ, vocab: int = GPT2_VOCAB, *,
                device: torch.device | str | None = None, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids ``(batch, seq)`` in ``[0, vocab)`` (int64)."""
    dev = _device(device)
    g = _generator(seed, dev)
    if g is None:
        return torch.randint(vocab, (batch, seq), device=dev)
    return torch.randint(vocab, (batch, seq), generator=g).to(dev)


# ============================================================================ ModelSpec
@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model and its input.

    Attributes:
        name: registry key.
        build: builds the model (parameters on the current default device).
        example_input: ``example_input(batch, **input_params, device=None)`` makes an
            input for ``batch`` samples (a tensor, or a tuple of positional args).
        default_batch: batch size the benchmarks use by default.
        input_params: default keyword parameters of ``example_input`` describing the
            input shape (e.g. ``{"image_size": 224}``); read-only.
        description: one line for reports.
    """

    name: str
    build: Callable[[], nn.Module]
    example_input: Callable[..., InputLike]
    default_batch: int
    input_params: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    description: str = ""

    def make_input(self, batch: int | None = None, *, device: torch.device | str | None = None,
                   **overrides: Any) -> InputLike:
        """Example input with ``input_params`` updated by ``overrides``.

        ``batch`` defaults to :attr:`default_batch`.
        """
        params = {**self.input_params, **overrides}
        return self.example_input(self.default_batch if batch is None else batch,
                                  device=device, **params)


# ============================================================================ ResNet (2D)
class Bottleneck(nn.Module):
    """torchvision ResNet v1.5 bottleneck (stride on the 3x3 conv), expansion 4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1,
                 base_width: int = 64) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups  # torchvision's formula
        self.conv1 = nn.Conv2d(inplanes, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1,
                               groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision-equivalent ResNet with :class:`Bottleneck` blocks."""

    STAGE_PLANES = (64, 128, 256, 512)  # bottleneck widths of the four stages
    STEM_CHANNELS = 64

    def __init__(self, layers: Sequence[int], num_classes: int = IMAGENET_CLASSES,
                 groups: int = 1, width_per_group: int = 64) -> None:
        super().__init__()
        self.inplanes = self.STEM_CHANNELS
        self.groups = groups
        self.base_width = width_per_group
        self.conv1 = nn.Conv2d(RGB, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        strides = (1, 2, 2, 2)  # first stage keeps the resolution, the others halve it
        self.layer1, self.layer2, self.layer3, self.layer4 = (
            self._make_layer(p, n, s) for p, n, s in zip(self.STAGE_PLANES, layers, strides))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.STAGE_PLANES[-1] * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        out_channels = planes * Bottleneck.expansion
        if stride != 1 or self.inplanes != out_channels:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = out_channels
        layers += [Bottleneck(self.inplanes, planes, groups=self.groups, base_width=self.base_width)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(layers: Sequence[int] = (3, 4, 6, 3), num_classes: int = IMAGENET_CLASSES) -> ResNet:
    """Bottleneck ResNet with the given blocks per stage (``(1, 1, 1, 1)`` for a tiny one)."""
    return ResNet(layers, num_classes)


def resnet50(num_classes: int = IMAGENET_CLASSES) -> ResNet:
    """ResNet-50 (He et al. 2016; torchvision v1.5 layout): layers [3, 4, 6, 3]."""
    return ResNet((3, 4, 6, 3), num_classes)


# ============================================================================ AlexNet
class AlexNet(nn.Module):
    """torchvision AlexNet (the one-GPU variant of Krizhevsky et al. 2012)."""

    POOL = 6  # adaptive pool output side before the classifier

    def __init__(self, num_classes: int = IMAGENET_CLASSES, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(RGB, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((self.POOL, self.POOL))
        hidden = 4096  # classifier width
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * self.POOL * self.POOL, hidden), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet(num_classes: int = IMAGENET_CLASSES) -> AlexNet:
    """AlexNet; inputs of at least 63x63 pixels (three stride-2 pools after a stride-4 conv)."""
    return AlexNet(num_classes)


# ============================================================================ VGG
VGG16_CFG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                                    512, 512, 512, "M", 512, 512, 512, "M")  # configuration "D"


class VGG(nn.Module):
    """torchvision VGG: conv stack from ``cfg`` ("M" = 2x2 max pool), 7x7 pool, 3 FC layers."""

    POOL = 7  # adaptive pool output side before the classifier

    def __init__(self, cfg: Sequence[int | str], num_classes: int = IMAGENET_CLASSES,
                 batch_norm: bool = False, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = RGB
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                continue
            assert isinstance(v, int)
            layers.append(nn.Conv2d(in_ch, v, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(v))
            layers.append(nn.ReLU(inplace=True))
            in_ch = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((self.POOL, self.POOL))
        hidden = 4096  # classifier width
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * self.POOL * self.POOL, hidden), nn.ReLU(inplace=True), nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg(cfg: Sequence[int | str] = VGG16_CFG, num_classes: int = IMAGENET_CLASSES,
        batch_norm: bool = False) -> VGG:
    """VGG with a custom conv configuration (for tiny test variants)."""
    return VGG(cfg, num_classes, batch_norm)


def vgg16(num_classes: int = IMAGENET_CLASSES, batch_norm: bool = False) -> VGG:
    """VGG-16 (Simonyan & Zisserman 2015, configuration D); inputs of at least 32x32."""
    return VGG(VGG16_CFG, num_classes, batch_norm)


# ============================================================================ 3D ResNeXt
class ResNeXtBottleneck3d(nn.Module):
    """Hara et al. 3D ResNeXt bottleneck: 1x1x1 -> grouped 3x3x3 -> 1x1x1, expansion 2.

    ``mid = cardinality * width``; the output has ``planes * 2`` channels.
    """

    expansion = 2

    def __init__(self, inplanes: int, planes: int, mid: int, cardinality: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(inplanes, mid, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm3d(mid)
        self.conv2 = nn.Conv3d(mid, mid, kernel_size=3, stride=stride, padding=1,
                               groups=cardinality, bias=False)
        self.bn2 = nn.BatchNorm3d(mid)
        self.conv3 = nn.Conv3d(mid, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm3d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNeXt3d(nn.Module):
    """3D ResNeXt (Hara et al. 2018), shortcut type B (1x1x1 conv + BN when shapes change).

    Stem: Conv3d(3, 64, 7x7x7, stride (1, 2, 2)), BN, ReLU, MaxPool3d(3, stride 2).
    Stages of planes 128/256/512/1024 (outputs twice that), strides 1/2/2/2, with a
    grouped conv of ``cardinality`` groups of ``width * 2**stage`` channels each.
    Head: global average pool, Linear(2048, num_classes).
    """

    STAGE_PLANES = (128, 256, 512, 1024)
    STEM_CHANNELS = 64

    def __init__(self, layers: Sequence[int], num_classes: int = KINETICS_CLASSES,
                 cardinality: int = 32, width: int = 4) -> None:
        super().__init__()
        self.inplanes = self.STEM_CHANNELS
        self.conv1 = nn.Conv3d(RGB, self.inplanes, kernel_size=7, stride=(1, 2, 2), padding=3, bias=False)
        self.bn1 = nn.BatchNorm3d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool3d(kernel_size=3, stride=2, padding=1)
        strides = (1, 2, 2, 2)
        stages = []
        for i, (planes, blocks, stride) in enumerate(zip(self.STAGE_PLANES, layers, strides)):
            mid = cardinality * width * 2 ** i  # 128, 256, 512, 1024 for 32x4
            stages.append(self._make_layer(planes, mid, cardinality, blocks, stride))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm3d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, planes: int, mid: int, cardinality: int, blocks: int,
                    stride: int) -> nn.Sequential:
        out_channels = planes * ResNeXtBottleneck3d.expansion
        downsample = None
        if stride != 1 or self.inplanes != out_channels:
            downsample = nn.Sequential(
                nn.Conv3d(self.inplanes, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm3d(out_channels))
        layers = [ResNeXtBottleneck3d(self.inplanes, planes, mid, cardinality, stride, downsample)]
        self.inplanes = out_channels
        layers += [ResNeXtBottleneck3d(self.inplanes, planes, mid, cardinality) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnext_3d(layers: Sequence[int], num_classes: int = KINETICS_CLASSES, cardinality: int = 32,
               width: int = 4) -> ResNeXt3d:
    """3D ResNeXt with the given blocks per stage (``(1, 1, 1, 1)`` for a tiny one)."""
    return ResNeXt3d(layers, num_classes, cardinality, width)


def resnext101_3d(cardinality: int = 32, width: int = 4,
                  num_classes: int = KINETICS_CLASSES) -> ResNeXt3d:
    """3D ResNeXt-101 (32x4d by default): layers [3, 4, 23, 3]; input ``(N, 3, T, H, W)``."""
    return ResNeXt3d((3, 4, 23, 3), num_classes, cardinality, width)


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


# ============================================================================ registry
def _spec(name: str, build: Callable[[], nn.Module], example_input: Callable[..., InputLike],
          default_batch: int, description: str, **input_params: int) -> ModelSpec:
    """A :class:`ModelSpec` whose ``input_params`` are the keyword arguments (read-only)."""
    return ModelSpec(name, build, example_input, default_batch,
                     MappingProxyType(dict(input_params)), description)


# Default batch sizes are the usual single-GPU training sizes of each model family.
MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    _spec("resnet50", resnet50, image_input, 64, "ResNet-50, ImageNet 224x224", image_size=224),
    _spec("alexnet", alexnet, image_input, 256, "AlexNet, ImageNet 224x224", image_size=224),
    _spec("vgg16", vgg16, image_input, 32, "VGG-16, ImageNet 224x224", image_size=224),
    _spec("resnext101_3d", resnext101_3d, video_input, 8,
          "3D ResNeXt-101 32x4d, Kinetics 16x112x112", frames=16, image_size=112),
    _spec("gpt2", gpt_decoder, token_input, 8, "GPT-2 small, context 1024",
          seq=GPT2_SEQ, vocab=GPT2_VOCAB),
)}
