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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .gpt import GPT, CausalSelfAttention, GPTBlock, gpt_decoder
from .inputs import (GPT2_DIM, GPT2_HEADS, GPT2_LAYERS, GPT2_SEQ, GPT2_VOCAB, IMAGENET_CLASSES, KINETICS_CLASSES, RGB,
                     InputLike, image_input, token_input, video_input)
from .video import ResNeXt3d, ResNeXtBottleneck3d, resnext101_3d, resnext_3d
from .vision import VGG, VGG16_CFG, AlexNet, Bottleneck, ResNet, alexnet, resnet, resnet50, vgg, vgg16

__all__ = [
    "ModelSpec", "MODELS", "InputLike", "image_input", "video_input", "token_input",
    "resnet50", "resnet", "ResNet", "Bottleneck", "alexnet", "AlexNet", "vgg16", "vgg", "VGG", "VGG16_CFG",
    "resnext101_3d", "resnext_3d", "ResNeXt3d", "ResNeXtBottleneck3d",
    "gpt_decoder", "GPT", "GPTBlock", "CausalSelfAttention",
    "IMAGENET_CLASSES", "KINETICS_CLASSES", "RGB", "GPT2_VOCAB", "GPT2_SEQ", "GPT2_LAYERS", "GPT2_DIM", "GPT2_HEADS",
]


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
