"""LAION improved aesthetic predictor: a linear MLP over L2-normalised CLIP ViT-L/14 image embeddings.

As in christophschuhmann/improved-aesthetic-predictor (and DDPO / Flow-GRPO): the image embedding of
``openai/clip-vit-large-patch14`` (processor's PIL path: bicubic resize of the shorter side to 224,
centre crop, OpenAI mean/std, on 8-bit images) is divided by its L2 norm and fed to the MLP
``768 → 1024 → 128 → 64 → 16 → 1`` (dropout between layers, no activations). Scores are on the
AVA 1–10 scale (≈ 4–7 for real images). The default weights are ``sac+logos+ava1-l14-linearMSE``,
as republished by TRL on the hub (``trl-lib/ddpo-aesthetic-predictor``).
"""

from __future__ import annotations

import torch

from flowrl_rewards.core._common import (
    batches,
    check_batch_size,
    hub_or_local_file,
    load_state_dict,
    resolve_device,
    resolve_dtype,
    to_pil,
)
from flowrl_rewards.core.base import Reward
from flowrl_rewards.preference.pickscore import load_clip_model, load_image_processor, pooled

DEFAULT_WEIGHTS = "trl-lib/ddpo-aesthetic-predictor:aesthetic-model.pth"


class AestheticMLP(torch.nn.Module):
    """The predictor's MLP; state-dict keys ``layers.{0,2,4,6,7}.{weight,bias}``. Input: [B, in_dim]."""

    def __init__(self, in_dim: int = 768):
        super().__init__()
        from torch import nn

        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Aesthetic(Reward):
    """LAION aesthetic score (1–10 scale) of each image; prompts are ignored.

    kwargs:
      weights: MLP state dict, a local ``.pth``/``.safetensors`` file or ``"org/repo:file"`` on the hub
        (default ``"trl-lib/ddpo-aesthetic-predictor:aesthetic-model.pth"``).
      clip_model: transformers CLIPModel, hub id or local folder (default ``"openai/clip-vit-large-patch14"``).
      processor: image processor, hub id or local folder (default: same as ``clip_model``).
      device / dtype: ``"auto"`` (cuda + fp16, else cpu + fp32) or explicit; the MLP always runs in fp32.
      batch_size: images per forward pass (default 32).
    """

    name = "aesthetic"

    def __init__(
        self,
        weights: str = DEFAULT_WEIGHTS,
        clip_model: str = "openai/clip-vit-large-patch14",
        processor: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ):
        self.device = resolve_device(device, self.name)
        self.dtype = resolve_dtype(dtype, self.device, self.name)
        self.batch_size = check_batch_size(batch_size, self.name)
        state = load_state_dict(hub_or_local_file(weights, "weights", self.name), self.name)
        if "layers.0.weight" not in state:
            raise ValueError(
                f"aesthetic: weights={weights!r} is not an aesthetic-predictor MLP state dict "
                f"(expected keys layers.0.weight ... layers.7.bias, got {sorted(state)[:4]}...)"
            )
        self.image_processor = load_image_processor(processor or clip_model, self.name)
        self.clip = load_clip_model(clip_model, self.dtype, self.device, self.name)
        in_dim = state["layers.0.weight"].shape[1]
        if in_dim != self.clip.config.projection_dim:
            raise ValueError(
                f"aesthetic: the MLP takes {in_dim}-d embeddings but clip_model={clip_model!r} gives "
                f"{self.clip.config.projection_dim}-d ones (the published MLP needs ViT-L/14, 768)"
            )
        self.mlp = AestheticMLP(in_dim)
        self.mlp.load_state_dict(state, strict=True)
        self.mlp.to(self.device).eval().requires_grad_(False)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The CLIP input for images [B, 3, H, W] in [0, 1]: float32 [B, 3, S, S] on CPU."""
        return self.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def score(self, images, prompts, meta):
        out = []
        for sl in batches(images.shape[0], self.batch_size):
            pix = self.pixels(images[sl]).to(self.device, self.dtype)
            emb = pooled(self.clip.get_image_features(pixel_values=pix)).float()
            emb = emb / emb.norm(dim=-1, keepdim=True)
            out.append(self.mlp(emb).squeeze(-1))
        return torch.cat(out).cpu()
