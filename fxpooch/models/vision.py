"""The torchvision image classifiers written out: ResNet (v1.5 bottleneck), AlexNet, VGG."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .inputs import IMAGENET_CLASSES, RGB


# ============================================================================ ResNet (2D)
def bottleneck_layers(block: nn.Module, conv: type[nn.Module], norm: type[nn.Module], inplanes: int, width: int,
                      out: int, stride: int, groups: int, downsample: nn.Module | None) -> None:
    """A bottleneck's layers on ``block``: 1x1 ``conv`` to ``width``, grouped 3x3 (``stride``), 1x1 to
    ``out``, each followed by ``norm``; the 2D and the 3D blocks differ only in ``conv`` and ``norm``."""
    block.conv1 = conv(inplanes, width, kernel_size=1, bias=False)
    block.bn1 = norm(width)
    block.conv2 = conv(width, width, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False)
    block.bn2 = norm(width)
    block.conv3 = conv(width, out, kernel_size=1, bias=False)
    block.bn3 = norm(out)
    block.relu = nn.ReLU(inplace=True)
    block.downsample = downsample


def init_residual(model: nn.Module) -> None:
    """The residual networks' initialisation: He-normal convolutions (fan out), batch norms at
    weight 1 and bias 0, in module order."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def bottleneck_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """conv-norm-relu twice, conv-norm, plus the (downsampled) input, relu."""
    identity = x if block.downsample is None else block.downsample(x)
    out = block.relu(block.bn1(block.conv1(x)))
    out = block.relu(block.bn2(block.conv2(out)))
    out = block.bn3(block.conv3(out))
    return block.relu(out + identity)


class Bottleneck(nn.Module):
    """torchvision ResNet v1.5 bottleneck (stride on the 3x3 conv), expansion 4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1,
                 base_width: int = 64) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups  # torchvision's formula
        bottleneck_layers(self, nn.Conv2d, nn.BatchNorm2d, inplanes, width, planes * self.expansion, stride, groups,
                          downsample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bottleneck_forward(self, x)


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
        init_residual(self)

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
