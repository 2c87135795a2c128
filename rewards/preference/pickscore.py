"""PickScore (Kirstain et al., 2023): a CLIP ViT-H-14 fine-tuned on Pick-a-Pic preferences.

Computed as the PickScore repository does: ``logit_scale.exp() × cos(image, prompt)`` with the
transformers ``CLIPModel`` and the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` processor (raw scores
≈ 18–24 for real images). Flow-GRPO divides this by 26 to get a reward near 1: ``divide_by=26``
reproduces that; the default (1.0) keeps the published scale.

Preprocessing is the processor's PIL path (bicubic resize of the shorter side, centre crop,
OpenAI mean/std) on 8-bit images, as the model was trained; prompts are padded to the full
context length (77) and truncated there, so a prompt's embedding never depends on its batch.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl_rewards.core._common import batches, check_batch_size, resolve_device, resolve_dtype, to_pil, unique
from flowrl_rewards.core.base import Reward


def load_image_processor(path: str, owner: str) -> Any:
    """The transformers image processor of ``path`` with its PIL backend (the published pipeline)."""
    import transformers
    from transformers import AutoImageProcessor

    major = int(transformers.__version__.split(".")[0])
    kwargs = {"backend": "pil"} if major >= 5 else {"use_fast": False}
    try:
        return AutoImageProcessor.from_pretrained(path, **kwargs)
    except Exception as e:
        raise ValueError(
            f"{owner}: cannot load an image processor from {path!r} ({type(e).__name__}: {e}); "
            "give a hub id or a local folder saved with processor.save_pretrained"
        ) from e


def load_clip_model(path: str, dtype: torch.dtype, device: torch.device, owner: str) -> Any:
    """A transformers ``CLIPModel`` in eval mode, no gradients, on ``device`` in ``dtype``."""
    from transformers import CLIPModel

    try:
        model = CLIPModel.from_pretrained(path, dtype=dtype)
    except Exception as e:
        raise ValueError(
            f"{owner}: cannot load a transformers CLIPModel from {path!r} ({type(e).__name__}: {e}); "
            "give a hub id or a local folder saved with model.save_pretrained"
        ) from e
    return model.to(device).eval().requires_grad_(False)


def pooled(out: Any) -> torch.Tensor:
    """Projected features from ``get_*_features`` (a tensor in transformers 4, an output in 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class PickScore(Reward):
    """PickScore: ``logit_scale.exp() × cos(image, prompt) / divide_by``.

    kwargs:
      model: CLIPModel weights, hub id or local folder (default ``"yuvalkirstain/PickScore_v1"``).
      processor: processor (image processor + tokenizer), hub id or local folder
        (default ``"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"``).
      divide_by: divisor of the score (default 1.0 = published PickScore; Flow-GRPO uses 26).
      device / dtype: ``"auto"`` (cuda + fp16, else cpu + fp32) or explicit (``"bf16"``, ...).
      batch_size: images per forward pass (default 32).
    """

    name = "pickscore"

    def __init__(
        self,
        model: str = "yuvalkirstain/PickScore_v1",
        processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        divide_by: float = 1.0,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ):
        if not isinstance(divide_by, (int, float)) or isinstance(divide_by, bool) or divide_by <= 0:
            raise ValueError(f"pickscore: divide_by={divide_by!r} must be a positive number (1 = raw, 26 = Flow-GRPO)")
        self.device = resolve_device(device, self.name)
        self.dtype = resolve_dtype(dtype, self.device, self.name)
        self.batch_size = check_batch_size(batch_size, self.name)
        self.divide_by = float(divide_by)
        from transformers import AutoTokenizer

        self.image_processor = load_image_processor(processor, self.name)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor)
        except Exception as e:
            raise ValueError(f"pickscore: cannot load a tokenizer from processor={processor!r} ({e})") from e
        self.model = load_clip_model(model, self.dtype, self.device, self.name)
        limits = [77, self.model.config.text_config.max_position_embeddings]
        if isinstance(self.tokenizer.model_max_length, int):
            limits.append(self.tokenizer.model_max_length)
        self.max_length = min(limits)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The model's input for images [B, 3, H, W] in [0, 1]: float32 [B, 3, S, S] on CPU."""
        return self.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def score(self, images, prompts, meta):
        uniq, index = unique(prompts)
        text = []
        for sl in batches(len(uniq), self.batch_size):
            tok = self.tokenizer(
                uniq[sl], padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            text.append(pooled(self.model.get_text_features(**tok)).float())
        txt = torch.cat(text)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        feats = []
        for sl in batches(images.shape[0], self.batch_size):
            pix = self.pixels(images[sl]).to(self.device, self.dtype)
            feats.append(pooled(self.model.get_image_features(pixel_values=pix)).float())
        img = torch.cat(feats)
        img = img / img.norm(dim=-1, keepdim=True)
        cos = (img * txt[index.to(self.device)]).sum(dim=-1)
        return (self.model.logit_scale.float().exp() * cos / self.divide_by).cpu()
