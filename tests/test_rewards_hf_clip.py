"""pickscore and aesthetic on a tiny random transformers CLIP saved to disk and loaded through the rewards."""

import pytest
import torch

from flowrl_rewards import build_reward

transformers = pytest.importorskip("transformers")

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
WORDS = ["a", "red", "blue", "green", "cat", "dog", "two", "birds"]
PROMPTS = ["a red cat", "a blue dog", "a red cat", "two green birds"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A CLIPModel folder and a processor folder (image processor 32 px + word-level CLIP tokenizer)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowrl.models.tokenizers import build_clip_tokenizer

    root = tmp_path_factory.mktemp("hfclip")
    tok = build_clip_tokenizer(WORDS, model_max_length=16)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
        logit_scale_init_value=3.0,
    )
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    model.save_pretrained(root / "model")
    proc = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tok,
    )
    proc.save_pretrained(root / "processor")
    proc.save_pretrained(root / "model")  # the aesthetic reward reads the processor beside the model by default
    for w in WORDS:  # each word one token, so different prompts encode differently
        assert len(tok(w, add_special_tokens=False)["input_ids"]) == 1
    return {"root": root, "model": model, "tok": tok}


def _images(b=4, h=32, w=64, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _reference_pixels(images):
    """CLIP's published preprocessing, built independently: PIL bicubic resize, centre crop, normalise."""
    import torchvision.transforms as T
    from PIL import Image

    tf = T.Compose(
        [
            T.Resize(32, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(32),
            T.ToTensor(),
            T.Normalize(OPENAI_MEAN, OPENAI_STD),
        ]
    )
    arr = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return torch.stack([tf(Image.fromarray(a)) for a in arr])


def _feats(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@pytest.fixture(scope="module")
def pick(tiny):
    return build_reward(
        "pickscore",
        model=str(tiny["root"] / "model"),
        processor=str(tiny["root"] / "processor"),
        device="cpu",
        dtype="auto",
    )


def test_pickscore_is_logit_scale_times_cosine(tiny, pick):
    assert pick.name == "pickscore" and pick.dtype == torch.float32
    for a, b in zip(pick.model.state_dict().values(), tiny["model"].state_dict().values()):
        assert torch.equal(a, b)
    x = _images()
    s = pick(x, PROMPTS)
    assert s.shape == (4,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    m = tiny["model"]
    with torch.no_grad():
        img = _feats(m.get_image_features(pixel_values=_reference_pixels(x)))
        t = tiny["tok"](PROMPTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        txt = _feats(m.get_text_features(**t))
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    expected = m.logit_scale.exp() * (img * txt).sum(-1)
    assert torch.allclose(s, expected, atol=1e-4)
    assert torch.equal(s, pick(x, PROMPTS))  # deterministic
    assert len(set(s.tolist())) == 4


def test_pickscore_prompt_and_image_matter(pick):
    x = _images()
    same_prompt = pick(x, ["a red cat"] * 4)
    assert len(set(same_prompt.tolist())) == 4
    one = x[:1].repeat(2, 1, 1, 1)
    s = pick(one, ["a red cat", "two green birds"])
    assert s[0] != s[1]
    # a prompt's score does not depend on the other prompts in the batch (padding to the full length)
    assert torch.allclose(pick(x[:1], ["a red cat"]), pick(x[:2], ["a red cat", "two green birds"])[:1], atol=1e-6)


def test_pickscore_preprocessing_is_published(pick):
    x = _images(b=2, h=40, w=48)
    assert torch.allclose(pick.pixels(x), _reference_pixels(x), atol=1e-6)
    gray = torch.full((1, 3, 32, 32), 128 / 255)
    expect = torch.tensor([(128 / 255 - m) / s for m, s in zip(OPENAI_MEAN, OPENAI_STD)])
    assert torch.allclose(pick.pixels(gray)[0].mean(dim=(1, 2)), expect, atol=1e-5)
    x = _images(b=1)
    y, z = x.clone(), x.clone()
    y[..., :8] = 1 - y[..., :8]  # outside the centre crop
    z[..., 30:34] = 1 - z[..., 30:34]  # inside
    sx, sy, sz = pick(torch.cat([x, y, z]), ["a red cat"] * 3)
    assert sx == sy and sx != sz


def test_pickscore_divide_by_and_batching(tiny, pick):
    x = _images(b=5)
    prompts = PROMPTS + ["a dog"]
    raw = pick(x, prompts)
    r = build_reward(
        "pickscore",
        model=str(tiny["root"] / "model"),
        processor=str(tiny["root"] / "processor"),
        divide_by=26,
        batch_size=2,
    )
    assert torch.allclose(r(x, prompts), raw / 26, atol=1e-5)
    with pytest.raises(ValueError, match="divide_by=0"):
        build_reward("pickscore", divide_by=0)
    with pytest.raises(ValueError, match="cannot load a transformers CLIPModel from"):
        build_reward("pickscore", model=str(tiny["root"] / "nothing"), processor=str(tiny["root"] / "processor"))


def test_pickscore_bf16(tiny):
    r = build_reward(
        "pickscore", model=str(tiny["root"] / "model"), processor=str(tiny["root"] / "processor"), dtype="bf16"
    )
    assert r.model.dtype == torch.bfloat16
    s = r(_images(), PROMPTS)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()


@pytest.fixture(scope="module")
def mlp_weights(tiny):
    from flowrl_rewards.preference.aesthetic import AestheticMLP

    torch.manual_seed(2)
    mlp = AestheticMLP(16).eval()
    path = tiny["root"] / "aesthetic.pth"
    torch.save(mlp.state_dict(), path)
    return mlp, path


def test_aesthetic_is_mlp_of_normalised_clip_embedding(tiny, mlp_weights):
    mlp, path = mlp_weights
    r = build_reward("aesthetic", weights=str(path), clip_model=str(tiny["root"] / "model"), batch_size=3)
    x = _images(b=5)
    s = r(x, ["ignored"] * 5)
    assert s.shape == (5,) and s.dtype == torch.float32
    with torch.no_grad():
        emb = _feats(tiny["model"].get_image_features(pixel_values=_reference_pixels(x)))
        expected = mlp(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)
    assert torch.allclose(s, expected, atol=1e-5)
    assert torch.equal(s, r(x, ["other"] * 5))  # deterministic, prompts ignored
    assert len(set(s.tolist())) == 5
    assert torch.allclose(r.pixels(x), _reference_pixels(x), atol=1e-6)
    assert [type(m).__name__ for m in r.mlp.layers] == [
        "Linear",
        "Dropout",
        "Linear",
        "Dropout",
        "Linear",
        "Dropout",
        "Linear",
        "Linear",
    ]


def test_aesthetic_weights_from_hub_cache_and_errors(tiny, mlp_weights, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    _, path = mlp_weights
    repo = tmp_path / "models--trl-lib--ddpo-aesthetic-predictor"
    (repo / "snapshots" / ("1" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("1" * 40) / "aesthetic-model.pth").write_bytes(path.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    r = build_reward("aesthetic", clip_model=str(tiny["root"] / "model"))  # default weights: the hub file
    assert torch.isfinite(r(_images(b=2), ["a", "b"])).all()
    bad = tmp_path / "bad.pth"
    torch.save({"fc.weight": torch.zeros(1, 16)}, bad)
    with pytest.raises(ValueError, match="not an aesthetic-predictor MLP"):
        build_reward("aesthetic", weights=str(bad), clip_model=str(tiny["root"] / "model"))
    from flowrl_rewards.preference.aesthetic import AestheticMLP

    torch.save(AestheticMLP(768).state_dict(), tmp_path / "l14.pth")
    with pytest.raises(ValueError, match="768-d embeddings"):
        build_reward("aesthetic", weights=str(tmp_path / "l14.pth"), clip_model=str(tiny["root"] / "model"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_device_and_dtype_on_cuda(tiny, pick, mlp_weights):
    r = build_reward("pickscore", model=str(tiny["root"] / "model"), processor=str(tiny["root"] / "processor"))
    assert r.device.type == "cuda" and r.model.dtype == torch.float16
    x = _images()
    s = r(x, PROMPTS)
    assert s.device.type == "cpu" and s.dtype == torch.float32
    assert torch.allclose(s, pick(x, PROMPTS), atol=0.05)
    a = build_reward("aesthetic", weights=str(mlp_weights[1]), clip_model=str(tiny["root"] / "model"))
    assert a.device.type == "cuda" and torch.isfinite(a(x, PROMPTS)).all()
