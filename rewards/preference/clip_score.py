"""CLIP score with open_clip: ``scale × cos(image embedding, text embedding)``.

Images are quantised to 8 bits, turned into PIL images and passed through the model's own
validation transform from ``open_clip.create_model_and_transforms`` (resize of the shorter side,
bicubic; centre crop; normalisation with the checkpoint's mean/std), as the model was trained.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl_rewards.core._common import batches, check_batch_size, resolve_device, resolve_dtype, to_pil, unique
from flowrl_rewards.core.base import Reward


class OpenClipCosine(Reward):
    """Shared core of :class:`ClipScore` and :class:`flowrl_rewards.preference.hpsv2.HPSv2`: an open_clip model, its
    tokenizer and validation transform; score = ``scale × cosine`` (optionally clipped at 0)."""

    name = "open_clip_cosine"

    def _setup(
        self,
        model: Any,
        preprocess: Any,
        tokenizer: Any,
        device: torch.device,
        dtype: torch.dtype,
        scale: float,
        batch_size: int,
        nonnegative: bool = False,
    ) -> None:
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.device, self.dtype = device, dtype
        self.scale, self.batch_size, self.nonnegative = float(scale), batch_size, bool(nonnegative)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The model's input for images [B, 3, H, W] in [0, 1]: float32 [B, 3, S, S] on CPU."""
        return torch.stack([self.preprocess(im) for im in to_pil(images)])

    @torch.no_grad()
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings, float32 [B, D] on the reward's device."""
        out = []
        for sl in batches(images.shape[0], self.batch_size):
            pix = self.pixels(images[sl]).to(self.device, self.dtype)
            out.append(self.model.encode_image(pix).float())
        feats = torch.cat(out)
        return feats / feats.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised text embeddings, float32 [N, D] (each prompt padded to the context length)."""
        out = []
        for sl in batches(len(prompts), self.batch_size):
            tokens = self.tokenizer(prompts[sl]).to(self.device)
            out.append(self.model.encode_text(tokens).float())
        feats = torch.cat(out)
        return feats / feats.norm(dim=-1, keepdim=True)

    def score(self, images, prompts, meta):
        uniq, index = unique(prompts)
        text = self.text_features(uniq)[index.to(self.device)]
        cos = (self.image_features(images) * text).sum(dim=-1)
        if self.nonnegative:
            cos = cos.clamp_min(0)
        return (self.scale * cos).cpu()


def load_open_clip(
    model: str, pretrained: str | None, owner: str, cache_dir: str | None = None, device: torch.device | str = "cpu"
):
    """``(model, validation transform, tokenizer)`` from open_clip, built in fp32 on ``device``."""
    try:
        import open_clip
    except ImportError as e:
        raise ImportError(
            f"{owner} needs open_clip_torch: pip install 'flowrl-align[rewards]' (or pip install open_clip_torch)"
        ) from e
    # A tag trained with QuickGELU (e.g. "openai") on a plain config ("ViT-L-14") only warns in open_clip
    # and then runs the wrong activation: switch QuickGELU on as the tag requires.
    tag_cfg = open_clip.get_pretrained_cfg(model, pretrained) if pretrained and not os.path.isfile(pretrained) else {}
    try:
        net, _, preprocess = open_clip.create_model_and_transforms(
            model,
            pretrained=pretrained or None,
            cache_dir=cache_dir,
            force_quick_gelu=bool(tag_cfg.get("quick_gelu", False)),
            device=device,
        )
        tokenizer = open_clip.get_tokenizer(model)
    except Exception as e:
        detail = str(e) if len(str(e)) < 300 else str(e)[:300] + "..."
        raise ValueError(
            f"{owner}: cannot build open_clip model={model!r} with pretrained={pretrained!r} ({type(e).__name__}: "
            f"{detail}); model is an open_clip name (open_clip.list_models()), 'hf-hub:org/repo' or 'local-dir:/path'; "
            "pretrained is a tag (open_clip.list_pretrained()) or a checkpoint file"
        ) from e
    return net, preprocess, tokenizer


class ClipScore(OpenClipCosine):
    """CLIP score: ``scale × cos(image, prompt)`` with an open_clip model.

    kwargs:
      model: open_clip architecture name (default ``"ViT-L-14"``), or ``"hf-hub:org/repo"`` /
        ``"local-dir:/path"`` (a folder with ``open_clip_config.json`` and weights; ``pretrained``
        is then ignored).
      pretrained: pretrained tag (default ``"openai"``) or a local checkpoint file; None = random init.
        A tag trained with QuickGELU (``openai``) gets QuickGELU even on a plain config name.
      scale: multiplier of the cosine (default 1.0; the CLIPScore paper uses 2.5 with ``nonnegative``).
      nonnegative: clip the cosine at 0 first (default False).
      device: ``"auto"`` (cuda if available) or a torch device string.
      dtype: ``"auto"`` (fp16 on cuda, fp32 on cpu), ``"fp32"``, ``"fp16"`` or ``"bf16"``.
      batch_size: images per forward pass (default 32).
      cache_dir: open_clip download cache (default: its own).
    """

    name = "clip_score"

    def __init__(
        self,
        model: str = "ViT-L-14",
        pretrained: str | None = "openai",
        scale: float = 1.0,
        nonnegative: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        cache_dir: str | None = None,
    ):
        dev = resolve_device(device, self.name)
        dt = resolve_dtype(dtype, dev, self.name)
        check_batch_size(batch_size, self.name)
        net, preprocess, tokenizer = load_open_clip(model, pretrained, self.name, cache_dir, dev)
        self._setup(net, preprocess, tokenizer, dev, dt, scale, batch_size, nonnegative)
