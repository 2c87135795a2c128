"""imagereward: the clear error when the extra is missing, and the batched scoring against a stand-in
``ImageReward`` package whose model has the real package's attributes and per-image ``score()``."""

import sys
import textwrap

import pytest
import torch

from flowrl_rewards import build_reward

# A stand-in for the image-reward package (it cannot be installed beside transformers 5): same load()
# signature, same model attributes (blip.tokenizer / visual_encoder / text_encoder, mlp, mean, std,
# preprocess) and the package's per-image score() formula, on a tiny random BLIP-like network.
FAKE_PACKAGE = textwrap.dedent("""
    import os
    import torch
    from torch import nn
    from types import SimpleNamespace
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    CALLS = []

    def _transform(n_px):
        return Compose([Resize(n_px, interpolation=InterpolationMode.BICUBIC), CenterCrop(n_px),
                        lambda im: im.convert("RGB"), ToTensor(),
                        Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    class Vision(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.patch = nn.Conv2d(3, d, 8, 8)
        def forward(self, x):
            return self.patch(x).flatten(2).transpose(1, 2)

    class Text(nn.Module):
        def __init__(self, vocab, d):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.self_attn = nn.MultiheadAttention(d, 2, batch_first=True)
            self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, return_dict):
            h = self.emb(input_ids)
            h = h + self.self_attn(h, h, h, key_padding_mask=attention_mask == 0)[0]
            h = h + self.attn(h, encoder_hidden_states, encoder_hidden_states)[0]
            return SimpleNamespace(last_hidden_state=h)

    class MLP(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(d, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
        def forward(self, x):
            return self.layers(x)

    class BLIP(nn.Module):
        def __init__(self, tokenizer, d):
            super().__init__()
            self.tokenizer = tokenizer
            self.visual_encoder = Vision(d)
            self.text_encoder = Text(len(tokenizer), d)

    class ImageReward(nn.Module):
        def __init__(self, tokenizer, device="cpu", d=16):
            super().__init__()
            self.device = device
            self.blip = BLIP(tokenizer, d)
            self.preprocess = _transform(32)
            self.mlp = MLP(d)
            self.mean, self.std = 0.16717362830052426, 1.0333394966054072

        def score(self, prompt, pil_image):  # the package's per-image formula
            text_input = self.blip.tokenizer(prompt, padding="max_length", truncation=True, max_length=35,
                                             return_tensors="pt").to(self.device)
            image = self.preprocess(pil_image).unsqueeze(0).to(self.device)
            image_embeds = self.blip.visual_encoder(image)
            image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long).to(self.device)
            out = self.blip.text_encoder(text_input.input_ids, attention_mask=text_input.attention_mask,
                                         encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                         return_dict=True)
            rewards = self.mlp(out.last_hidden_state[:, 0, :].float())
            return ((rewards - self.mean) / self.std).item()

    def load(name="ImageReward-v1.0", device="cpu", download_root=None, med_config=None):
        CALLS.append(dict(name=name, device=device, download_root=download_root, med_config=med_config))
        from flowrl.models.tokenizers import build_clip_tokenizer
        tok = build_clip_tokenizer(["a", "red", "cat", "blue", "dog", "two", "birds"], model_max_length=35)
        torch.manual_seed(0)
        model = ImageReward(tok, device=device)
        if os.path.isfile(name):
            model.load_state_dict(torch.load(name, map_location="cpu", weights_only=True), strict=False)
        elif name != "ImageReward-v1.0":
            raise RuntimeError(f"Model {name} not found")
        return model.to(device).eval()
""")

PROMPTS = ["a red cat", "a blue dog", "a red cat", "two birds", "a cat"]


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    pkg = tmp_path / "ImageReward"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ImageReward", raising=False)
    import ImageReward

    yield ImageReward
    sys.modules.pop("ImageReward", None)


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ImageReward", None)  # import fails as if not installed
    with pytest.raises(
        ImportError, match=r"optional extra 'imagereward'.*flowrl-align\[imagereward\].*flowrl_rewards.serving.serve"
    ):
        build_reward("imagereward")


def test_batched_scores_equal_the_package_per_image_score(fake_package, tmp_path):
    r = build_reward("imagereward", batch_size=2, med_config="med.json", download_root=str(tmp_path))
    assert fake_package.CALLS[-1] == dict(
        name="ImageReward-v1.0", device="cpu", download_root=str(tmp_path), med_config="med.json"
    )
    x = torch.rand(5, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    s = r(x, PROMPTS)
    assert s.shape == (5,) and s.dtype == torch.float32
    from flowrl_rewards.core._common import to_pil

    expected = torch.tensor([r.model.score(p, im) for p, im in zip(PROMPTS, to_pil(x))])
    assert torch.allclose(s, expected, atol=1e-5)
    assert torch.equal(s, r(x, PROMPTS))
    assert len(set(s.tolist())) == 5
    one = x[:1].repeat(2, 1, 1, 1)
    t = r(one, ["a red cat", "two birds"])
    assert t[0] != t[1]


def test_local_checkpoint_and_dtype(fake_package, tmp_path):
    ref = fake_package.load()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1)
    torch.save(ref.state_dict(), tmp_path / "ImageReward.pt")
    r = build_reward("imagereward", model=str(tmp_path / "ImageReward.pt"), dtype="bf16")
    assert fake_package.CALLS[-1]["name"] == str(tmp_path / "ImageReward.pt")
    assert torch.equal(r.model.mlp.layers[0].weight, ref.mlp.layers[0].weight)  # the MLP stays fp32
    assert r.model.blip.visual_encoder.patch.weight.dtype == torch.bfloat16
    s = r(torch.rand(2, 3, 32, 32), ["a cat", "a dog"])
    assert s.dtype == torch.float32 and torch.isfinite(s).all()
