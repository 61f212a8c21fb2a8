"""Shape sanity checks of the benchmark models in ``fxpooch/models``, on the meta device.

Everything is built *and* run under ``with torch.device("meta")``: no memory is
allocated and no arithmetic is done, so even the full-size models check in
milliseconds.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

from fxpooch import models as bz

META = torch.device("meta")


def n_params(model: nn.Module) -> int:
    """Number of unique parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def run_meta(build, *inputs_fn):
    """Build the model and its input on meta, run forward, return (model, output)."""
    with torch.device(META):
        model = build()
        out = model(*(f() for f in inputs_fn))
    assert out.device.type == "meta"
    return model, out


# ------------------------------------------------------------------ tiny configurations
def test_resnet50_tiny():
    model, out = run_meta(lambda: bz.resnet50(num_classes=10), lambda: bz.image_input(2, 64))
    assert out.shape == (2, 10)


def test_resnet_one_block_per_stage():
    model, out = run_meta(lambda: bz.resnet((1, 1, 1, 1), num_classes=7), lambda: bz.image_input(2, 32))
    assert out.shape == (2, 7)
    assert sum(isinstance(m, bz.Bottleneck) for m in model.modules()) == 4


def test_alexnet_tiny():
    _, out = run_meta(lambda: bz.alexnet(num_classes=10), lambda: bz.image_input(2, 64))
    assert out.shape == (2, 10)


def test_vgg16_tiny():
    _, out = run_meta(lambda: bz.vgg16(num_classes=10), lambda: bz.image_input(2, 32))
    assert out.shape == (2, 10)
    _, out = run_meta(lambda: bz.vgg((8, "M", 16, "M"), num_classes=3, batch_norm=True),
                      lambda: bz.image_input(1, 32))
    assert out.shape == (1, 3)


def test_resnext3d_tiny():
    _, out = run_meta(lambda: bz.resnext_3d((1, 1, 1, 1), num_classes=5, cardinality=4, width=2),
                      lambda: bz.video_input(2, frames=8, image_size=32))
    assert out.shape == (2, 5)


def test_resnext101_3d_structure():
    with torch.device(META):
        model = bz.resnext101_3d()
        out = model(bz.video_input(2, frames=8, image_size=32))
    assert out.shape == (2, 400)
    blocks = [m for m in model.modules() if isinstance(m, bz.ResNeXtBottleneck3d)]
    assert len(blocks) == 3 + 4 + 23 + 3
    assert [b.conv2.groups for b in blocks[:1]] == [32]
    assert blocks[0].conv2.kernel_size == (3, 3, 3)
    assert model.fc.in_features == 2048


def test_gpt_decoder_tiny():
    vocab, seq = 97, 16
    for use_sdpa in (False, True):
        model, out = run_meta(
            lambda: bz.gpt_decoder(n_layer=2, d_model=32, n_head=4, seq=seq, vocab=vocab, use_sdpa=use_sdpa),
            lambda: bz.token_input(2, seq=seq, vocab=vocab))
        assert out.shape == (2, seq, vocab)
        assert model.lm_head.weight is model.wte.weight
    untied = bz.gpt_decoder(n_layer=1, d_model=32, n_head=4, seq=seq, vocab=vocab, tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight


def test_gpt_rejects_long_sequence():
    with torch.device(META):
        model = bz.gpt_decoder(n_layer=1, d_model=32, n_head=4, seq=8, vocab=11)
        with pytest.raises(ValueError):
            model(bz.token_input(1, seq=9, vocab=11))


# ------------------------------------------------------------------ torchvision parameter counts
@pytest.mark.parametrize("build, expected", [
    (bz.resnet50, 25_557_032),
    (bz.alexnet, 61_100_840),
    (bz.vgg16, 138_357_544),
    (bz.gpt_decoder, 124_439_808),  # GPT-2 small, tied embeddings
])
def test_reference_parameter_counts(build, expected):
    with torch.device(META):
        assert n_params(build()) == expected


# ------------------------------------------------------------------ registry
def test_registry_specs():
    assert set(bz.MODELS) == {"resnet50", "alexnet", "vgg16", "resnext101_3d", "gpt2"}
    for name, spec in bz.MODELS.items():
        assert spec.name == name
        assert spec.default_batch > 0
        with pytest.raises(TypeError):
            spec.input_params["x"] = 1  # read-only
    assert bz.MODELS["resnet50"].input_params["image_size"] == 224
    assert dict(bz.MODELS["resnext101_3d"].input_params) == {"frames": 16, "image_size": 112}


@pytest.mark.parametrize("name, overrides, expected", [
    ("resnet50", {"image_size": 64}, (2, 1000)),
    ("alexnet", {"image_size": 64}, (2, 1000)),
    ("vgg16", {"image_size": 32}, (2, 1000)),
    ("resnext101_3d", {"frames": 8, "image_size": 32}, (2, 400)),
    ("gpt2", {"seq": 16}, (2, 16, 50257)),
])
def test_registry_build_and_run_on_meta(name, overrides, expected):
    spec = bz.MODELS[name]
    with torch.device(META):
        model = spec.build()
        x = spec.make_input(2, **overrides)
        out = model(*x) if isinstance(x, tuple) else model(x)
    assert out.device.type == "meta"
    assert out.shape == expected


def test_default_inputs_shapes():
    with torch.device(META):
        assert bz.MODELS["resnet50"].make_input().shape == (64, 3, 224, 224)
        assert bz.MODELS["resnext101_3d"].make_input(1).shape == (1, 3, 16, 112, 112)
        tokens = bz.MODELS["gpt2"].make_input(1)
        assert tokens.shape == (1, 1024) and tokens.dtype == torch.int64


def test_cpu_inputs_are_deterministic():
    a = bz.image_input(1, 8, seed=3)
    b = bz.image_input(1, 8, seed=3)
    assert a.device.type == "cpu" and torch.equal(a, b)
    t = bz.token_input(2, seq=5, vocab=7, seed=1)
    assert torch.equal(t, bz.token_input(2, seq=5, vocab=7, seed=1))
    assert int(t.min()) >= 0 and int(t.max()) < 7
