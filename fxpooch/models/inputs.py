"""Example inputs of the benchmark models: seeded images, clips and token ids, on any device."""
from __future__ import annotations

import torch

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
