"""Model-free rewards: JPEG size, brightness, saturation, redness."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl_rewards import build_reward


def _imgs(seed=0, b=3, h=24, w=20):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_jpeg_size_matches_ddpo_computation():
    x = _imgs()
    inc = build_reward("jpeg_incompressibility")(x, ["p"] * 3)
    comp = build_reward("jpeg_compressibility")(x, ["p"] * 3)
    expected = []
    for a in (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=95)
        expected.append(buf.tell() / 1000)
    assert inc.dtype == torch.float32 and inc.shape == (3,)
    assert torch.allclose(inc, torch.tensor(expected, dtype=torch.float32))
    assert torch.equal(comp, -inc)


def test_jpeg_noise_is_less_compressible_than_flat():
    flat = torch.full((1, 3, 32, 32), 0.4)
    noise = _imgs(b=1, h=32, w=32)
    r = build_reward("jpeg_compressibility")
    assert r(flat, ["a"]) > r(noise, ["a"])
    assert build_reward("jpeg_incompressibility", quality=50)(noise, ["a"]) < build_reward("jpeg_incompressibility")(
        noise, ["a"]
    )


def test_jpeg_quality_is_validated():
    with pytest.raises(ValueError, match="quality=0"):
        build_reward("jpeg_compressibility", quality=0)


def test_brightness_saturation_redness_values():
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0
    gray = torch.full((1, 3, 4, 4), 0.5)
    black = torch.zeros(1, 3, 4, 4)
    x = torch.cat([red, gray, black])
    assert torch.allclose(build_reward("brightness")(x, ["a"] * 3), torch.tensor([1 / 3, 0.5, 0.0]))
    assert torch.allclose(build_reward("saturation")(x, ["a"] * 3), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(build_reward("redness")(x, ["a"] * 3), torch.tensor([1.0, 0.0, 0.0]))


def test_saturation_matches_pil_hsv():
    x = _imgs(seed=3, b=2, h=8, w=8)
    ours = build_reward("saturation")(x, ["a", "b"])
    ref = []
    for a in (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
        ref.append(np.asarray(Image.fromarray(a).convert("HSV"))[..., 1].mean() / 255)
    assert np.allclose(ours.numpy(), ref, atol=0.01)


def test_stats_are_deterministic_and_batched():
    x = _imgs(b=5)
    for name in ("jpeg_incompressibility", "brightness", "saturation", "redness"):
        r = build_reward(name)
        a, b = r(x, ["p"] * 5), r(x, ["p"] * 5)
        assert a.shape == (5,) and a.dtype == torch.float32 and torch.equal(a, b)
        assert len(set(a.tolist())) > 1, name
