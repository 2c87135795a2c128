"""hpsv3: the in-process HPSv3 scorer on a tiny random Qwen2-VL with HPSv3's head, saved in the published checkpoint's
layout (the package's ``visual.*`` / ``model.*`` / ``lm_head.*`` / ``rm_head.*``): its scores follow the package's
recipe (plain token positions, the ``<|Reward|>`` token's hidden state through the fp32 head), do not depend on the
batch, resize as the package does; bad checkpoints and settings are refused. The slow test scores the same tiny
model with the ``hpsv3`` package itself, in its own environment (transformers 4.45), and compares."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl_rewards import build_reward
from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.preference.hpsv3 import (
    INSTRUCTION,
    PIXELS,
    REWARD_TOKEN,
    build_head,
    hpsv3_text,
    resize_for_hpsv3,
    split_checkpoint,
)

SMALL = 4 * 28 * 28  # 56×56 px for a square image: 4 merged vision tokens (fast); the published 200,704 is tested too
PROMPTS = ["a red circle", "two cat", "a cat with a red circle and two red circle", "cat"]  # lengths differ: padding
CHAT_TEMPLATE = (  # Qwen2-VL-Instruct's layout: a default system turn, the image as its vision tokens, then the text
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = sorted({*re.findall(r"[A-Za-z]+", INSTRUCTION + " ".join(PROMPTS)), "You", "are", "helpful", "assistant"})
TINY = dict(hidden=32, layers=2, heads=2, kv_heads=1, mrope=[2, 3, 3])  # head dim 16: mRoPE sections sum to 8
VISION = dict(depth=1, embed_dim=16, mlp_ratio=1, num_heads=2, patch_size=14, temporal_patch_size=2)


def images(b=4, h=40, w=56, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def to_package_layout(state: dict) -> dict:
    """transformers 5's Qwen2VLForConditionalGeneration keys → the hpsv3 package's (transformers 4.45's)."""
    out = {}
    for k, v in state.items():
        if k.startswith("model.visual."):
            out[k[len("model.") :]] = v
        elif k.startswith("model.language_model."):
            out["model." + k[len("model.language_model.") :]] = v
        else:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A base folder (a tiny Qwen2-VL's config and processor: patch 14, temporal patch 2, merge 2 as the real one;
    flowrl's offline byte-level BPE tokenizer), a checkpoint in HPSv3's published layout (the embedding resized to
    the tokenizer plus ``<|Reward|>``, a random ranknet head 32 → 1024 → 16 → 2), and the full model those weights
    make (for the reference forward)."""
    from safetensors.torch import save_file
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    from flowrl.models.testing.qwen_image import tiny_qwen_tokenizer, vision_token_ids

    tokenizer = tiny_qwen_tokenizer(WORDS, edit=True)
    vision = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )

    def config(vocab):
        return Qwen2VLConfig(
            text_config=dict(
                vocab_size=vocab,
                hidden_size=TINY["hidden"],
                intermediate_size=64,
                num_hidden_layers=TINY["layers"],
                num_attention_heads=TINY["heads"],
                num_key_value_heads=TINY["kv_heads"],
                max_position_embeddings=4096,
                bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": TINY["mrope"]},
            ),
            vision_config=dict(**VISION, hidden_size=TINY["hidden"], spatial_merge_size=2),
            **vision_token_ids(tokenizer),
        )

    base = tmp_path_factory.mktemp("hpsv3_base")
    config(len(tokenizer)).save_pretrained(base)  # the base's weights are never read: its config and processor are
    processor.save_pretrained(base)
    torch.manual_seed(0)
    full = Qwen2VLForConditionalGeneration(config(len(tokenizer) + 1)).eval()  # + <|Reward|>, as the package resizes
    head = torch.nn.Sequential(
        torch.nn.Linear(TINY["hidden"], 1024),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.05),
        torch.nn.Linear(1024, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    ).eval()
    for p in head.parameters():  # large enough that the tiny model's scores spread
        torch.nn.init.normal_(p, std=0.5)
    state = to_package_layout(full.state_dict())
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    checkpoint = tmp_path_factory.mktemp("hpsv3_ckpt") / "HPSv3.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint))
    return dict(base=str(base), checkpoint=str(checkpoint), full=full, head=head, state=state)


@pytest.fixture(scope="module")
def reward(tiny):
    return build_reward("hpsv3", checkpoint=tiny["checkpoint"], base=tiny["base"], pixels=SMALL, device="cpu")


def reference(tiny, reward, image, prompt, mrope=False):
    """(μ, log σ) of one image by the package's recipe, through transformers' whole Qwen2VLForConditionalGeneration
    (its own embedding and image merge) holding the same weights: positions 0..L-1 on all three mRoPE axes (the
    package passes none to the language model) — or, ``mrope``, Qwen2-VL's own 2-D image positions."""
    batch = reward.inputs(image[None], reward.texts([prompt]))
    length = batch["input_ids"].shape[1]
    extra = {} if mrope else {"position_ids": torch.arange(length).view(1, 1, length).expand(3, 1, length)}
    with torch.no_grad():
        out = tiny["full"](**batch, **extra, output_hidden_states=True)
        at = (batch["input_ids"][0] == reward.reward_id).nonzero().item()
        return tiny["head"](out.hidden_states[-1][0, at])


def test_scores_follow_the_package_recipe_and_not_qwen2_vl_positions(tiny, reward):
    x = images()
    meta = {}
    scores = reward(x, PROMPTS, meta)
    assert scores.dtype == torch.float32 and scores.shape == (4,) and scores.std() > 0.01
    want = torch.stack([reference(tiny, reward, x[i], p) for i, p in enumerate(PROMPTS)])
    assert torch.allclose(scores, want[:, 0], atol=1e-5), (scores, want[:, 0])
    assert torch.allclose(meta["hpsv3/sigma"], want[:, 1].exp(), rtol=1e-5)
    qwen = torch.stack([reference(tiny, reward, x[i], p, mrope=True) for i, p in enumerate(PROMPTS)])
    assert (scores - qwen[:, 0]).abs().max() > 1e-3  # the positions matter: HPSv3 was trained without mRoPE's


def test_a_score_does_not_depend_on_the_batch(reward):
    x = images(seed=1)
    batched = reward(x, PROMPTS)
    alone = torch.cat([reward(x[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)])
    assert torch.allclose(batched, alone, atol=1e-5)
    assert torch.allclose(reward(x.flip(0), PROMPTS[::-1]).flip(0), batched, atol=1e-5)
    assert (reward(x, [PROMPTS[0]] * 4) - batched).abs().max() > 1e-4  # the prompt is read


def test_text_is_the_package_instruction_ending_in_the_reward_token(reward):
    (text,) = reward.texts(["a cat"])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>" + hpsv3_text("a cat") + "<|im_end|>" in text
    assert "Textual prompt - a cat\n" in text and text.count(REWARD_TOKEN) == 1
    ids = reward.inputs(images(1), [text])["input_ids"][0]
    assert (ids == reward.reward_id).sum() == 1 and reward.reward_id == len(reward.processor.tokenizer) - 1


def test_images_are_resized_to_the_published_pixel_count(tiny, reward):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    published = build_reward("hpsv3", checkpoint=tiny["checkpoint"], base=tiny["base"], device="cpu")
    assert published.pixels == PIXELS == 200704 and published.factor == 28
    square = published.inputs(images(1, 64, 64), published.texts(["cat"]))
    assert square["image_grid_thw"].tolist() == [[1, 32, 32]]  # 448×448 px, 14 px patches
    assert (square["input_ids"] == tiny["full"].config.image_token_id).sum() == 256  # merged 2×2
    wide = published.inputs(images(1, 40, 100), published.texts(["cat"]))
    h, w = smart_resize(40, 100, factor=28, min_pixels=PIXELS, max_pixels=PIXELS)
    assert wide["image_grid_thw"].tolist() == [[1, h // 14, w // 14]] and w > 2 * h  # aspect kept
    from PIL import Image

    pil = Image.fromarray(to_uint8(images(1, 40, 100))[0])
    assert resize_for_hpsv3(pil, 28, PIXELS).size == (w, h)
    assert published(images(2, 64, 64), ["cat", "two cat"]).shape == (2,)


def test_a_pth_checkpoint_wrapped_as_the_package_saves_it_scores_the_same(tiny, reward, tmp_path):
    path = tmp_path / "HPSv3_7B.pth"
    torch.save({"model": tiny["state"]}, path)
    pth = build_reward("hpsv3", checkpoint=str(path), base=tiny["base"], pixels=SMALL, device="cpu")
    x = images(2, seed=4)
    assert torch.equal(pth(x, PROMPTS[:2]), reward(x, PROMPTS[:2]))
    torch.save({"model": {"rm_head.0.weight": "not a tensor"}}, path)
    with pytest.raises(RuntimeError, match="does not hold a state dict of tensors"):
        build_reward("hpsv3", checkpoint=str(path), base=tiny["base"], device="cpu")


def test_checkpoint_layouts_and_refusals(tiny, tmp_path):
    state = tiny["state"]
    backbone, head = split_checkpoint(state)
    assert "lm_head.weight" not in backbone and set(head) == {f"{i}.{p}" for i in (0, 3, 5) for p in ("weight", "bias")}
    assert "visual.patch_embed.proj.weight" in backbone and "language_model.embed_tokens.weight" in backbone
    newer = {f"model.{k}": v for k, v in backbone.items()} | {f"rm_head.{k}": v for k, v in head.items()}
    assert split_checkpoint(newer)[0].keys() == backbone.keys()  # transformers ≥ 4.52's layout reads the same
    with pytest.raises(ValueError, match="'vision_tower.x' is not part of an HPSv3"):
        split_checkpoint({**state, "vision_tower.x": torch.zeros(1)})
    with pytest.raises(ValueError, match="no reward head"):
        split_checkpoint({k: v for k, v in state.items() if not k.startswith("rm_head.")})
    with pytest.raises(ValueError, match="HPSv3's head has"):
        build_head({**head, "7.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not D→h→k→2"):
        build_head({**head, "5.weight": torch.zeros(3, 16), "5.bias": torch.zeros(3)})
    from safetensors.torch import save_file

    def saved(name, weights):
        path = tmp_path / name
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
        return str(path)

    missing = saved("missing.safetensors", {k: v for k, v in state.items() if not k.startswith("model.norm")})
    with pytest.raises(ValueError, match=r"1 weights missing \['language_model.norm.weight'\]"):
        build_reward("hpsv3", checkpoint=missing, base=tiny["base"], device="cpu")
    rows = state["model.embed_tokens.weight"].shape[0]
    fewer = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"][: rows - 1]}
    with pytest.raises(ValueError, match="embedding has .* rows but <\\|Reward\\|> is token"):
        build_reward("hpsv3", checkpoint=saved("fewer.safetensors", fewer), base=tiny["base"], device="cpu")


def test_settings_are_checked(tiny):
    with pytest.raises(ConfigError, match="pixel=100 is not a key of reward 'hpsv3'.*did you mean 'pixels'"):
        build_reward("hpsv3", pixel=100)
    with pytest.raises(ValueError, match="backend='vllm' is not one of"):
        build_reward("hpsv3", backend="vllm")
    with pytest.raises(ValueError, match="pixels=100 must be an integer >= 784"):
        build_reward("hpsv3", pixels=100)
    with pytest.raises(ValueError, match="backend='hpsv3' resizes to 200704 pixels"):
        build_reward("hpsv3", backend="hpsv3", pixels=SMALL)
    with pytest.raises(FileNotFoundError, match="checkpoint='nope' is neither an existing file"):
        build_reward("hpsv3", checkpoint="nope")
    if importlib.util.find_spec("hpsv3") is None:
        with pytest.raises(ImportError, match="backend='hpsv3' needs the hpsv3 package"):
            build_reward("hpsv3", backend="hpsv3", checkpoint=tiny["checkpoint"], device="cpu")


# ---- equality with the hpsv3 package, in its own environment -----------------------------------------------------
HPSV3_PYTHON = os.environ.get("FLOWRL_HPSV3_PYTHON", "/work/hpsv3-venv/bin/python")
"""The python of an environment with the ``hpsv3`` package (it pins transformers 4.45): docs/rewards/hpsv3.md."""


def _package_importable(python: str) -> bool:
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", "import hpsv3.inference"], capture_output=True, timeout=300)
    return probe.returncode == 0


PACKAGE_SCRIPT = r'''
"""Run with the python of an environment holding the hpsv3 package (transformers 4.45). In WORK (spec.json, images.npy
uint8 [B, H, W, 3], tokenizer/): saves a tiny Qwen2-VL base (base/, by transformers 4.45 as the hub's is), builds the
package's reward model from it with the package's own create_model_and_processor (its <|Reward|> token and embedding
resize), gives it a seeded random head, saves its state dict (HPSv3.safetensors: the published layout), then scores
the images with the package's HPSv3RewardInferencer (and, when flowrl imports, flowrl's backend='hpsv3') into
package.json."""
import json
import os
import sys

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor
from transformers import Qwen2VLProcessor

import hpsv3.inference as package
from hpsv3.train import create_model_and_processor
from hpsv3.utils.parser import DataConfig, ModelConfig, PEFTLoraConfig, TrainingConfig, parse_args_with_yaml

work = sys.argv[1]
spec = json.load(open(os.path.join(work, "spec.json")))
base, ckpt, yaml = (os.path.join(work, n) for n in ("base", "HPSv3.safetensors", "HPSv3_tiny.yaml"))
tok = AutoTokenizer.from_pretrained(os.path.join(work, "tokenizer"))
vision = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**vision), tokenizer=tok,
                             chat_template=spec["chat_template"])
names = {"image": "image_pad", "video": "video_pad", "vision_start": "vision_start", "vision_end": "vision_end"}
ids = {f"{n}_token_id": tok.convert_tokens_to_ids(f"<|{t}|>") for n, t in names.items()}
t = spec["tiny"]
config = Qwen2VLConfig(
    vocab_size=len(tok), hidden_size=t["hidden"], intermediate_size=64, num_hidden_layers=t["layers"],
    num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"], max_position_embeddings=4096,
    rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": t["mrope"]},
    vision_config=dict(**spec["vision"], hidden_size=t["hidden"], spatial_merge_size=2),
    bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0, **ids,
)
torch.manual_seed(0)
Qwen2VLForConditionalGeneration(config).save_pretrained(base)
processor.save_pretrained(base)
cfg = OmegaConf.load(os.path.join(os.path.dirname(package.__file__), "config", "HPSv3_7B.yaml"))
cfg.model_name_or_path, cfg.bf16, cfg.torch_dtype = base, False, "float32"  # fp32 on the CPU
OmegaConf.save(cfg, yaml)
(_, training, model_config, lora), _ = parse_args_with_yaml(
    (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), yaml, is_train=False
)
model, _, _ = create_model_and_processor(model_config=model_config, peft_lora_config=lora, training_args=training)
torch.manual_seed(1)
for p in model.rm_head.parameters():  # large enough that the tiny model's scores spread
    torch.nn.init.normal_(p, std=0.5)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt)

inferencer = package.HPSv3RewardInferencer(config_path=yaml, checkpoint_path=ckpt, device="cpu")
arrays = np.load(os.path.join(work, "images.npy"))
pils = [Image.fromarray(a) for a in arrays]
prompts = spec["prompts"]
with torch.no_grad():
    out = inferencer.reward(pils, prompts).float()
batch = inferencer.prepare_batch(pils, prompts)
rows = [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
result = {"mu": out[:, 0].tolist(), "log_sigma": out[:, 1].tolist(), "input_ids": rows,
          "grid": batch["image_grid_thw"].tolist(), "keys": sorted(model.state_dict())}
try:
    from flowrl_rewards import build_reward
except ImportError:
    pass
else:  # flowrl's backend='hpsv3': the package's scorer behind flowrl's reward, as `serve hpsv3` runs it
    flowrl = build_reward("hpsv3", backend="hpsv3", checkpoint=ckpt, base=base, device="cpu", dtype="fp32",
                          batch_size=3)
    meta = {}
    mu = flowrl(torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255, prompts, meta)
    result["flowrl_backend_hpsv3"] = {"mu": mu.tolist(), "sigma": meta["hpsv3/sigma"].tolist()}
json.dump(result, open(os.path.join(work, "package.json"), "w"))
'''


@pytest.mark.slow
def test_equals_the_hpsv3_package_in_its_own_environment(tmp_path):
    """The same tiny checkpoint scored by the package (transformers 4.45, its base folder saved by 4.45 as the hub's
    is) and here (transformers 5): the same token ids, the same μ and σ; and the package's scorer behind flowrl's
    ``backend='hpsv3'`` (what ``serve hpsv3`` runs in that environment) gives the package's numbers. Skipped only
    where no environment with the package is found (``FLOWRL_HPSV3_PYTHON``, default /work/hpsv3-venv)."""
    if not _package_importable(HPSV3_PYTHON):
        pytest.skip(f"no environment with the hpsv3 package at FLOWRL_HPSV3_PYTHON={HPSV3_PYTHON}")
    from flowrl.models.testing.qwen_image import tiny_qwen_tokenizer

    root = Path(__file__).resolve().parents[1]
    tiny_qwen_tokenizer(WORDS, edit=True).save_pretrained(tmp_path / "tokenizer")
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(2, 3, 64, 64, generator=g), torch.rand(2, 3, 64, 64, generator=g).clamp(0.2, 0.5)])
    prompts = PROMPTS
    np.save(tmp_path / "images.npy", to_uint8(x))
    spec = dict(chat_template=CHAT_TEMPLATE, tiny=TINY, vision=VISION, prompts=prompts)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "package.py").write_text(PACKAGE_SCRIPT)
    path = tmp_path / "path"  # flowrl importable there without installing it (its pins clash with the package's)
    path.mkdir()
    (path / "flowrl").symlink_to(root / "flowrl")
    (path / "flowrl_rewards").symlink_to(root / "rewards")
    env = {**os.environ, "PYTHONPATH": str(path), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [HPSV3_PYTHON, str(tmp_path / "package.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    package = json.loads((tmp_path / "package.json").read_text())
    assert {"rm_head.0.weight", "rm_head.5.bias", "visual.patch_embed.proj.weight", "model.embed_tokens.weight"} <= set(
        package["keys"]
    ) and "lm_head.weight" in package["keys"]  # the published layout

    reward = build_reward("hpsv3", checkpoint=str(tmp_path / "HPSv3.safetensors"), base=str(tmp_path / "base"))
    batch = reward.inputs(x, reward.texts(prompts))
    ours_ids = [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert ours_ids == package["input_ids"] and batch["image_grid_thw"].tolist() == package["grid"]
    meta = {}
    mu = reward(x, prompts, meta)
    want_mu, want_sigma = torch.tensor(package["mu"]), torch.tensor(package["log_sigma"]).exp()
    assert want_mu.std() > 0.01
    print(
        f"hpsv3 vs package: mu {mu.tolist()} vs {want_mu.tolist()}: max |diff| {(mu - want_mu).abs().max():.3g}; "
        f"sigma max |diff| {(meta['hpsv3/sigma'] - want_sigma).abs().max():.3g}"
    )
    assert torch.allclose(mu, want_mu, atol=1e-5, rtol=0)
    assert torch.allclose(meta["hpsv3/sigma"], want_sigma, atol=1e-5, rtol=1e-5)
    served = package["flowrl_backend_hpsv3"]
    assert torch.allclose(torch.tensor(served["mu"]), want_mu, atol=1e-6)
    assert torch.allclose(torch.tensor(served["sigma"]), want_sigma, atol=1e-6)
