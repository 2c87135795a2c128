"""clip_score and hpsv2 on a tiny random open_clip model saved to disk and loaded through the rewards."""

import json

import pytest
import torch

from flowrl_rewards import build_reward

open_clip = pytest.importorskip("open_clip")

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PROMPTS = ["a red cat", "a blue dog", "a red cat", "two green birds"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A ``local-dir:`` open_clip folder (config + safetensors weights) and an HPS-style checkpoint."""
    root = tmp_path_factory.mktemp("openclip")
    folder = root / "tiny"
    folder.mkdir()
    cfg = {
        "model_cfg": {
            "embed_dim": 16,
            "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
        },
        "preprocess_cfg": {},
    }
    (folder / "open_clip_config.json").write_text(json.dumps(cfg))
    config_only = root / "config_only"
    config_only.mkdir()
    (config_only / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = open_clip.create_model(f"local-dir:{config_only}")
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(folder / "open_clip_model.safetensors"))
    torch.manual_seed(1)
    hps = open_clip.create_model(f"local-dir:{config_only}")
    hps_ckpt = root / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in hps.state_dict().items()}}, hps_ckpt)
    return {"dir": folder, "config_only": config_only, "model": model.eval(), "hps": hps.eval(), "hps_ckpt": hps_ckpt}


def _images(b=4, h=32, w=64, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _reference_pixels(images):
    """The published open_clip / CLIP validation transform, built independently on PIL images."""
    import torchvision.transforms as T

    tf = T.Compose(
        [
            T.Resize(32, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(32),
            T.ToTensor(),
            T.Normalize(OPENAI_MEAN, OPENAI_STD),
        ]
    )
    from PIL import Image

    arr = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return torch.stack([tf(Image.fromarray(a)) for a in arr])


@pytest.fixture(scope="module")
def clip_reward(tiny):
    return build_reward("clip_score", model=f"local-dir:{tiny['dir']}", pretrained=None, device="cpu")


def test_clip_score_loads_weights_and_matches_manual_cosine(tiny, clip_reward):
    r = clip_reward
    assert r.name == "clip_score" and r.dtype == torch.float32 and r.device.type == "cpu"
    for a, b in zip(r.model.state_dict().values(), tiny["model"].state_dict().values()):
        assert torch.equal(a, b)
    x = _images()
    s = r(x, PROMPTS)
    assert s.shape == (4,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    with torch.no_grad():
        img = tiny["model"].encode_image(_reference_pixels(x), normalize=True)
        txt = tiny["model"].encode_text(open_clip.get_tokenizer(f"local-dir:{tiny['dir']}")(PROMPTS), normalize=True)
    assert torch.allclose(s, (img * txt).sum(-1), atol=1e-5)


def test_clip_score_deterministic_and_discriminative(clip_reward):
    x = _images()
    a, b = clip_reward(x, PROMPTS), clip_reward(x, PROMPTS)
    assert torch.equal(a, b)
    assert len(set(a.tolist())) == 4  # different images (and prompts) give different scores
    same_prompt = clip_reward(x, ["a red cat"] * 4)
    assert len(set(same_prompt.tolist())) == 4
    # the prompt matters: one image, two prompts
    one = x[:1].repeat(2, 1, 1, 1)
    s = clip_reward(one, ["a red cat", "two green birds"])
    assert s[0] != s[1]


def test_clip_score_preprocessing_is_the_published_transform(clip_reward):
    x = _images(b=2, h=40, w=48)  # non-square: resize of the short side then centre crop
    assert torch.allclose(clip_reward.pixels(x), _reference_pixels(x), atol=1e-6)
    gray = torch.full((1, 3, 32, 32), 128 / 255)
    expect = torch.tensor([(128 / 255 - m) / s for m, s in zip(OPENAI_MEAN, OPENAI_STD)])
    assert torch.allclose(clip_reward.pixels(gray)[0].mean(dim=(1, 2)), expect, atol=1e-5)
    # a 32x64 image is centre-cropped to columns 16..47: the borders do not count, the centre does
    x = _images(b=1)
    y = x.clone()
    y[..., :8] = 1 - y[..., :8]
    z = x.clone()
    z[..., 30:34] = 1 - z[..., 30:34]
    sx, sy, sz = clip_reward(torch.cat([x, y, z]), ["a red cat"] * 3)
    assert sx == sy and sx != sz


def test_clip_score_scale_and_nonnegative(tiny, clip_reward):
    x = _images()
    base = clip_reward(x, PROMPTS)
    r = build_reward("clip_score", model=f"local-dir:{tiny['dir']}", scale=2.5, nonnegative=True, batch_size=3)
    assert torch.allclose(r(x, PROMPTS), 2.5 * base.clamp_min(0), atol=1e-5)


def test_clip_score_checkpoint_file_and_bf16(tiny, clip_reward, tmp_path):
    """A plain open_clip name + a checkpoint file path, and the dtype kwarg."""
    cfg = json.loads((tiny["config_only"] / "open_clip_config.json").read_text())["model_cfg"]
    (tmp_path / "tiny-flowrl-test.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "tiny-flowrl-test.json")  # registers the name "tiny-flowrl-test"
    ckpt = tmp_path / "tiny.pt"
    torch.save(tiny["model"].state_dict(), ckpt)
    r = build_reward("clip_score", model="tiny-flowrl-test", pretrained=str(ckpt), dtype="bf16")
    assert next(r.model.parameters()).dtype == torch.bfloat16
    s = r(_images(), PROMPTS)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()
    ref = clip_reward(_images(), PROMPTS)
    assert torch.allclose(s, ref, atol=0.05)


def test_clip_score_bad_arguments(tiny):
    with pytest.raises(ValueError, match="dtype='int8'.*fp16"):
        build_reward("clip_score", model=f"local-dir:{tiny['dir']}", dtype="int8")
    with pytest.raises(ValueError, match="model='no-such-model'"):
        build_reward("clip_score", model="no-such-model", pretrained=None)
    with pytest.raises(ValueError, match="batch_size=0"):
        build_reward("clip_score", model=f"local-dir:{tiny['dir']}", batch_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            build_reward("clip_score", model=f"local-dir:{tiny['dir']}", device="cuda")


def test_hpsv2_loads_hps_checkpoint_and_scores_cosine(tiny):
    r = build_reward("hpsv2", model=f"local-dir:{tiny['config_only']}", checkpoint=str(tiny["hps_ckpt"]))
    for a, b in zip(r.model.state_dict().values(), tiny["hps"].state_dict().values()):
        assert torch.equal(a, b)
    x = _images()
    s = r(x, PROMPTS)
    with torch.no_grad():
        img = tiny["hps"].encode_image(_reference_pixels(x), normalize=True)
        txt = tiny["hps"].encode_text(open_clip.get_tokenizer("ViT-H-14")(PROMPTS), normalize=True)
    assert s.shape == (4,) and s.dtype == torch.float32
    assert torch.allclose(s, (img * txt).sum(-1), atol=1e-5)
    assert torch.equal(s, r(x, PROMPTS)) and len(set(s.tolist())) == 4
    assert torch.allclose(r.pixels(x), _reference_pixels(x), atol=1e-6)


def test_hpsv2_default_checkpoint_comes_from_the_hub(tiny, tmp_path, monkeypatch):
    """The default (version v2.1) resolves ``xswu/HPSv2:HPS_v2.1_compressed.pt`` through huggingface_hub."""
    import huggingface_hub.constants as hc

    snap = tmp_path / "models--xswu--HPSv2" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "HPS_v2.1_compressed.pt").write_bytes(tiny["hps_ckpt"].read_bytes())
    (tmp_path / "models--xswu--HPSv2" / "refs").mkdir()
    (tmp_path / "models--xswu--HPSv2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    r = build_reward("hpsv2", model=f"local-dir:{tiny['config_only']}")
    assert r.checkpoint.endswith("HPS_v2.1_compressed.pt")
    with pytest.raises(RuntimeError, match="HPS_v2_compressed.pt.*xswu/HPSv2.*checkpoint="):
        build_reward("hpsv2", version="v2.0", model=f"local-dir:{tiny['config_only']}")
    with pytest.raises(ValueError, match="version='v3'"):
        build_reward("hpsv2", version="v3")


def test_hpsv2_wrong_checkpoint_is_a_clear_error(tiny, tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": {"visual.conv1.weight": torch.zeros(1)}}, bad)
    with pytest.raises(RuntimeError, match="does not fit open_clip model"):
        build_reward("hpsv2", model=f"local-dir:{tiny['config_only']}", checkpoint=str(bad))
    with pytest.raises(FileNotFoundError, match="neither an existing file"):
        build_reward("hpsv2", checkpoint=str(tmp_path / "missing.pt"))


def test_quickgelu_tags_get_quickgelu(monkeypatch):
    """``ViT-L-14`` + ``openai`` (trained with QuickGELU) must build the QuickGELU variant, not just warn."""
    from flowrl_rewards.preference.clip_score import load_open_clip

    seen = {}

    def fake_create(model, pretrained=None, cache_dir=None, force_quick_gelu=False, device="cpu"):
        seen.update(model=model, pretrained=pretrained, force_quick_gelu=force_quick_gelu)
        raise RuntimeError("stop before downloading")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", fake_create)
    with pytest.raises(ValueError, match="stop before downloading"):
        load_open_clip("ViT-L-14", "openai", "clip_score")
    assert seen == dict(model="ViT-L-14", pretrained="openai", force_quick_gelu=True)
    with pytest.raises(ValueError):
        load_open_clip("ViT-H-14", "laion2b_s32b_b79k", "clip_score")
    assert seen["force_quick_gelu"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_device_and_dtype_on_cuda(tiny, clip_reward):
    r = build_reward("clip_score", model=f"local-dir:{tiny['dir']}")
    assert r.device.type == "cuda" and r.dtype == torch.float16
    x = _images()
    s = r(x, PROMPTS)
    assert s.device.type == "cpu" and s.dtype == torch.float32
    assert torch.allclose(s, clip_reward(x, PROMPTS), atol=1e-2) and torch.equal(s, r(x, PROMPTS))
