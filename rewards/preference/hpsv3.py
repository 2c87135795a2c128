"""HPSv3 (Ma et al., 2025): a Qwen2-VL-7B-Instruct fine-tuned with a reward head on human preferences (HPDv3).

The published checkpoint (``MizzenAI/HPSv3:HPSv3.safetensors``) is the whole reward model of the ``hpsv3`` package
(``Qwen2VLRewardModelBT``, saved with transformers 4.45) as one state dict:

- ``visual.*`` (the vision tower), ``model.*`` (the language model) and ``lm_head.weight`` (unused for scoring),
  with the embedding resized to the base tokenizer plus one special token ``<|Reward|>``;
- ``rm_head.{0,3,5}.{weight,bias}``: ``Linear(3584, 1024) → ReLU → Dropout → Linear(1024, 16) → ReLU → Linear(16,
  2)`` (the package's "ranknet" head), run in fp32 on the hidden state of the ``<|Reward|>`` token.

Its two outputs are μ and log σ of a Gaussian preference score (trained with a probabilistic Bradley-Terry loss);
the package's scorer reads μ, as this reward does (σ = exp(log σ) goes to ``meta["hpsv3/sigma"]``).

Scoring follows ``hpsv3.inference.HPSv3RewardInferencer``: each image, rounded to 8 bits, is resized (PIL bicubic)
to ``smart_resize(h, w)`` at exactly ``pixels`` pixels (256·28·28 = 200,704: 448×448 for a square image), placed
in one user turn of the base model's chat template with the package's instruction around the prompt, which ends in
``<|Reward|>``; texts are right-padded. The package calls the language model without position ids, so every token
— image tokens included — is at its plain index on all three mRoPE axes (not Qwen2-VL's 2-D image positions): this
port passes those positions, so its scores equal the package's (measured: docs/rewards/hpsv3.md). A score never
depends on the batch (right padding: the reward token attends only to its own row's earlier tokens).

Two backends: ``"transformers"`` (default) runs that forward here with transformers' ``Qwen2VLModel`` (no
``hpsv3`` package needed; transformers 5 works), ``"hpsv3"`` calls the package's own scorer (its environment pins
transformers 4.45: serve it from there, ``python -m flowrl_rewards.serving.serve hpsv3 --kwargs '{"backend":
"hpsv3"}'``, and use the ``remote`` reward).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

import torch

from flowrl_rewards.core._common import (
    batches,
    check_batch_size,
    hub_or_local_file,
    load_state_dict,
    resolve_device,
    resolve_dtype,
    to_pil,
    unique,
)
from flowrl_rewards.core.base import Reward

OWNER = "hpsv3"
CHECKPOINT = "MizzenAI/HPSv3:HPSv3.safetensors"
"""The published HPSv3 checkpoint (``org/repo:file`` on the hub)."""
BASE = "Qwen/Qwen2-VL-7B-Instruct"
"""The base model whose config and processor the checkpoint was trained with."""
PIXELS = 256 * 28 * 28
"""Pixels each image is resized to (the package's ``min_pixels`` = ``max_pixels``)."""
REWARD_TOKEN = "<|Reward|>"
BACKENDS = ("transformers", "hpsv3")
HEAD_LINEARS = (0, 3, 5)
"""Indices of the head's linear layers in ``rm_head`` (ReLU at 1 and 4, dropout at 2)."""

# The package's text around the prompt (hpsv3/dataset/data_collator_qwen.py: INSTRUCTION + prompt_with_special_token),
# reproduced character for character: the model was trained on exactly this text.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 "
    "being the best. \n\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements "
    "(e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of "
    "harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or "
    "adult material. If such content is present, the image quality and satisfaction score should be the lowest "
    "possible. \n\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) "
    "align with the textual description. The subject should match the description in terms of number, appearance, "
    "and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the "
    "image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image "
    "logically fit the scenario described in the prompt. The environment should support and enhance the subject "
    "without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, "
    "accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, "
    "but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the "
    "image. The generated content should not introduce elements that conflict with or distort the original "
    "description.\n"
    "Textual prompt - {text_prompt}\n\n\n"
)
RATING = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def hpsv3_text(prompt: str) -> str:
    """The user turn's text for ``prompt``: the package's instruction, the prompt, then the rating request that ends
    in ``<|Reward|>``."""
    return INSTRUCTION.replace("{text_prompt}", prompt) + RATING


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The reward model's state dict from a ``.safetensors`` file or a torch file (``weights_only``); a ``{"model":
    ...}`` wrapper (the package's ``.pth`` files) is removed as the package's loader does."""
    if str(path).endswith(".safetensors"):
        return load_state_dict(path, OWNER)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"{OWNER}: cannot read checkpoint {path!r} as a tensor state dict ({e})") from e
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RuntimeError(f"{OWNER}: checkpoint {path!r} does not hold a state dict of tensors")
    return state


def split_checkpoint(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The published state dict → (backbone weights named as transformers' ``Qwen2VLModel``, head weights named as
    :func:`build_head`'s). Reads the package's layout (``visual.*``, ``model.*``, ``lm_head.*``, ``rm_head.*``) and
    the layout transformers ≥ 4.52 saves (``model.visual.*``, ``model.language_model.*``); ``lm_head`` is dropped."""
    backbone, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key[len("rm_head.") :]] = value
        elif key.startswith("lm_head."):
            continue
        elif key.startswith(("visual.", "language_model.")):
            backbone[key] = value
        elif key.startswith(("model.visual.", "model.language_model.")):
            backbone[key[len("model.") :]] = value
        elif key.startswith("model."):
            backbone["language_model." + key[len("model.") :]] = value
        else:
            raise ValueError(
                f"{OWNER}: checkpoint key {key!r} is not part of an HPSv3 reward model (expected visual.*, model.*, "
                "lm_head.*, rm_head.*)"
            )
    if not head:
        raise ValueError(f"{OWNER}: the checkpoint has no reward head (rm_head.*): is it an HPSv3 checkpoint?")
    return backbone, head


def build_head(head: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """The package's "ranknet" head, sized from its weights: Linear → ReLU → Dropout → Linear → ReLU → Linear, fp32,
    hidden [N, D] → [N, 2] (μ, log σ)."""
    expected = {f"{i}.{p}" for i in HEAD_LINEARS for p in ("weight", "bias")}
    if set(head) != expected:
        raise ValueError(
            f"{OWNER}: the reward head's weights are {sorted('rm_head.' + k for k in head)}; HPSv3's head has "
            f"{sorted('rm_head.' + k for k in expected)}"
        )
    w = [head[f"{i}.weight"] for i in HEAD_LINEARS]
    if w[2].shape[0] != 2 or w[1].shape[1] != w[0].shape[0] or w[2].shape[1] != w[1].shape[0]:
        raise ValueError(f"{OWNER}: reward head shapes {[tuple(x.shape) for x in w]} are not D→h→k→2")
    nn = torch.nn
    layers = nn.Sequential(
        nn.Linear(w[0].shape[1], w[0].shape[0]),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(w[1].shape[1], w[1].shape[0]),
        nn.ReLU(),
        nn.Linear(w[2].shape[1], 2),
    )
    layers.load_state_dict({k: v.float() for k, v in head.items()}, strict=True)
    return layers.float().eval().requires_grad_(False)


def resolve_hpsv3_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """``"auto"`` → bf16 on CUDA (HPSv3's training and inference dtype; Qwen2's activations can overflow fp16),
    fp32 elsewhere; else :func:`resolve_dtype`."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype, device, OWNER)


def resize_for_hpsv3(image: Any, factor: int, pixels: int) -> Any:
    """A PIL image resized (bicubic) to ``smart_resize`` of its size with ``min_pixels = max_pixels = pixels``:
    sides multiples of ``factor`` (patch × merge, 28), about ``pixels`` pixels, the aspect ratio kept."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    height, width = smart_resize(image.height, image.width, factor=factor, min_pixels=pixels, max_pixels=pixels)
    return image.resize((width, height), Image.BICUBIC)


def load_base(base: str, rows: int) -> tuple[Any, Any, int]:
    """The base model's processor (``<|Reward|>`` added as a special token, right padding, the PIL image processor)
    and config (its vocabulary set to the checkpoint's ``rows``), and the reward token's id."""
    from transformers import AutoConfig, AutoProcessor

    from flowrl_rewards.preference.pickscore import load_image_processor

    try:
        processor = AutoProcessor.from_pretrained(base)
        config = AutoConfig.from_pretrained(base)
    except Exception as e:
        raise ValueError(
            f"{OWNER}: cannot load the base model's processor and config from base={base!r} ({type(e).__name__}: "
            f"{e}); give a hub id (default {BASE!r}) or a local folder holding its config.json and processor files"
        ) from e
    if config.model_type != "qwen2_vl" or not hasattr(processor, "tokenizer"):
        raise ValueError(
            f"{OWNER}: base={base!r} is a {config.model_type!r} model; HPSv3 is a Qwen2-VL ({BASE!r}) reward model"
        )
    processor.image_processor = load_image_processor(base, OWNER)
    tokenizer = processor.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    tokenizer.padding_side = "right"
    reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    if reward_id >= rows:
        raise ValueError(
            f"{OWNER}: the checkpoint's embedding has {rows} rows but {REWARD_TOKEN} is token {reward_id} of "
            f"base={base!r}'s tokenizer: the checkpoint was not trained from this base"
        )
    text = getattr(config, "text_config", config)
    text.vocab_size = rows
    return processor, config, reward_id


class HPSv3(Reward):
    """HPSv3 score μ (unbounded; higher = preferred) float32 [B]; its σ in ``meta["hpsv3/sigma"]`` [B].

    kwargs:
      checkpoint: the reward model's weights, a local ``.safetensors`` / ``.pt`` file or ``"org/repo:file"`` (default
        ``"MizzenAI/HPSv3:HPSv3.safetensors"``).
      base: the base model's config and processor, hub id or local folder (default ``"Qwen/Qwen2-VL-7B-Instruct"``;
        its weights are not read).
      pixels: pixels each image is resized to (default 200704 = 256·28·28, the package's).
      backend: ``"transformers"`` (default: this module's forward) or ``"hpsv3"`` (the ``hpsv3`` package's scorer).
      device / dtype: ``"auto"`` (cuda + bf16, else cpu + fp32) or explicit; the head runs in fp32.
      batch_size: images per forward pass (default 16).
    """

    name = "hpsv3"

    def __init__(
        self,
        checkpoint: str = CHECKPOINT,
        base: str = BASE,
        pixels: int = PIXELS,
        backend: str = "transformers",
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 16,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"{OWNER}: backend={backend!r} is not one of {list(BACKENDS)}")
        if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels < 28 * 28:
            raise ValueError(f"{OWNER}: pixels={pixels!r} must be an integer >= 784 (default {PIXELS} = 256·28·28)")
        if backend == "hpsv3" and pixels != PIXELS:
            raise ValueError(
                f"{OWNER}: backend='hpsv3' resizes to {PIXELS} pixels (fixed in the package); got {pixels}"
            )
        self.device = resolve_device(device, OWNER)
        self.dtype = resolve_hpsv3_dtype(dtype, self.device)
        self.batch_size = check_batch_size(batch_size, OWNER)
        self.pixels, self.backend = pixels, backend
        self.checkpoint = hub_or_local_file(checkpoint, "checkpoint", OWNER)
        if backend == "hpsv3":
            self.inferencer = load_package_scorer(self.checkpoint, base, self.device, self.dtype)
            return
        backbone, head = split_checkpoint(load_checkpoint(self.checkpoint))
        rows = backbone.get("language_model.embed_tokens.weight")
        if rows is None:
            raise ValueError(f"{OWNER}: the checkpoint has no model.embed_tokens.weight")
        self.processor, config, self.reward_id = load_base(base, rows.shape[0])
        self.model = load_backbone(config, backbone, self.device, self.dtype)
        self.head = build_head(head).to(self.device)
        ip = self.processor.image_processor
        self.factor = ip.patch_size * ip.merge_size

    def texts(self, prompts: Sequence[str]) -> list[str]:
        """The chat-template text of each prompt (one user turn: the image, then :func:`hpsv3_text`)."""
        return [
            self.processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(p)}]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in prompts
        ]

    def inputs(self, images: torch.Tensor, texts: Sequence[str]) -> Any:
        """The processor's batch for images [b, 3, H, W] in [0, 1] and their texts: right-padded ``input_ids`` /
        ``attention_mask`` [b, L], ``pixel_values`` [Σ patches, 3·2·14·14], ``image_grid_thw`` [b, 3], on the device."""
        pils = [resize_for_hpsv3(im, self.factor, self.pixels) for im in to_pil(images)]
        batch = self.processor(text=list(texts), images=pils, padding=True, return_tensors="pt")
        return batch.to(self.device)

    @torch.no_grad()
    def mu_log_sigma(self, batch: Any) -> torch.Tensor:
        """The head's output float32 [b, 2] (μ, log σ) at each row's ``<|Reward|>`` token."""
        ids = batch["input_ids"]
        found = (ids == self.reward_id).sum(1)
        if not (found == 1).all():
            raise ValueError(f"{OWNER}: each text must hold {REWARD_TOKEN} once; counts {found.tolist()}")
        lm = self.model.language_model
        embeds = lm.get_input_embeddings()(ids)
        feats = self.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        feats = getattr(feats, "pooler_output", feats)
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        mask = (ids == self.model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
        b, length = ids.shape
        positions = torch.arange(length, device=ids.device).view(1, 1, length).expand(3, b, length)
        hidden = lm(inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=positions)
        token = hidden.last_hidden_state[ids == self.reward_id]  # [b, D], row order kept
        return self.head(token.float())

    @torch.no_grad()
    def score(self, images, prompts, meta):
        if self.backend == "hpsv3":
            out = package_scores(self.inferencer, images, prompts, self.batch_size)
        else:
            uniq, index = unique(prompts)
            text = self.texts(uniq)
            out = torch.cat(
                [
                    self.mu_log_sigma(self.inputs(images[sl], [text[i] for i in index[sl].tolist()])).cpu()
                    for sl in batches(images.shape[0], self.batch_size)
                ]
            )
        meta[f"{self.name}/sigma"] = out[:, 1].exp()
        return out[:, 0]


def load_backbone(config: Any, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' ``Qwen2VLModel`` (vision tower + language model, no LM head) holding ``weights`` (all of them,
    no more), in eval mode on ``device`` in ``dtype``. Built without allocating random weights first."""
    from accelerate import init_empty_weights
    from transformers import Qwen2VLModel

    with init_empty_weights(include_buffers=False):
        model = Qwen2VLModel(config)
    missing = sorted(set(model.state_dict()) - set(weights))
    extra = sorted(set(weights) - set(model.state_dict()))
    if missing or extra:
        raise ValueError(
            f"{OWNER}: the checkpoint does not fit the base model's architecture: {len(missing)} weights missing "
            f"{missing[:4]}, {len(extra)} not in the model {extra[:4]}"
        )
    for key, param in model.state_dict().items():
        if tuple(weights[key].shape) != tuple(param.shape):
            raise ValueError(
                f"{OWNER}: checkpoint weight {key!r} has shape {tuple(weights[key].shape)}, the base model's "
                f"{tuple(param.shape)}: the checkpoint was not trained from this base"
            )
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ---- the hpsv3 package's own scorer (backend="hpsv3") -------------------------------------------------------------
def load_package_scorer(checkpoint: str, base: str, device: torch.device, dtype: torch.dtype) -> Any:
    """``hpsv3.inference.HPSv3RewardInferencer`` over ``checkpoint``, built from the package's own config
    (``HPSv3_7B.yaml``) with its base model set to ``base`` and its dtype to ``dtype``."""
    try:
        import hpsv3.inference as package
        from omegaconf import OmegaConf
    except ImportError as e:
        raise ImportError(
            f"{OWNER}: backend='hpsv3' needs the hpsv3 package (pip install hpsv3; it pins transformers 4.45, so use "
            "its own environment and serve it with `python -m flowrl_rewards.serving.serve hpsv3 --kwargs "
            "'{\"backend\": \"hpsv3\"}'`), or use backend='transformers'. "
            f"Import failed with: {type(e).__name__}: {e}"
        ) from e
    cfg = OmegaConf.load(os.path.join(os.path.dirname(package.__file__), "config", "HPSv3_7B.yaml"))
    cfg.model_name_or_path = base
    cfg.bf16 = dtype == torch.bfloat16
    cfg.fp16 = dtype == torch.float16
    cfg.torch_dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "HPSv3.yaml")
        OmegaConf.save(cfg, path)
        return package.HPSv3RewardInferencer(config_path=path, checkpoint_path=checkpoint, device=str(device))


def package_scores(inferencer: Any, images: torch.Tensor, prompts: Sequence[str], batch_size: int) -> torch.Tensor:
    """(μ, log σ) float32 [B, 2] from the package's ``reward(images, prompts)``, in chunks of ``batch_size``."""
    pils = to_pil(images)
    return torch.cat(
        [inferencer.reward(pils[sl], list(prompts[sl])).float().cpu() for sl in batches(len(pils), batch_size)]
    )
