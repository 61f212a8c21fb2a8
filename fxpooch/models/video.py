"""3D ResNeXt of Hara et al. (CVPR 2018) for video clips ``(N, 3, T, H, W)``."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .inputs import KINETICS_CLASSES, RGB
from .vision import bottleneck_forward, bottleneck_layers, init_residual


# ============================================================================ 3D ResNeXt
class ResNeXtBottleneck3d(nn.Module):
    """Hara et al. 3D ResNeXt bottleneck: 1x1x1 -> grouped 3x3x3 -> 1x1x1, expansion 2.

    ``mid = cardinality * width``; the output has ``planes * 2`` channels.
    """

    expansion = 2

    def __init__(self, inplanes: int, planes: int, mid: int, cardinality: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        bottleneck_layers(self, nn.Conv3d, nn.BatchNorm3d, inplanes, mid, planes * self.expansion, stride, cardinality,
                          downsample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bottleneck_forward(self, x)


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
        init_residual(self)

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
