"""ImageReward (Xu et al., 2023) through the ``image-reward`` package (optional extra).

The package is loaded with ``ImageReward.load`` and scored exactly as its ``score()`` method does
(BLIP ViT-L image embedding → BERT with cross-attention over the prompt, tokenised to 35 tokens →
MLP on the [CLS] feature → ``(r − mean) / std``), but batched: all images of a call go through the
vision encoder in chunks of ``batch_size``, each prompt is tokenised once. Preprocessing is the
package's own transform (bicubic resize to 224, centre crop, OpenAI mean/std) on 8-bit PIL images.

``image-reward`` 1.5 pins ``timm==0.6.13`` and imports functions that transformers 5 removed, so it
cannot share an environment with open_clip_torch ≥ 3 or transformers ≥ 5. Run it in its own
environment and reach it with ``python -m flowrl_rewards.serving.serve imagereward`` + the ``remote`` reward.
"""

from __future__ import annotations

import torch

from flowrl_rewards.core._common import batches, check_batch_size, resolve_device, resolve_dtype, to_pil, unique
from flowrl_rewards.core.base import Reward

EXTRA_HINT = (
    "pip install 'flowrl-align[imagereward]' (the image-reward package; it needs timm==0.6.13 and "
    "transformers<5, so use a separate environment and serve it with "
    "`python -m flowrl_rewards.serving.serve imagereward`, then use the 'remote' reward)"
)


def import_image_reward():
    """The ``ImageReward`` module, or an ImportError naming the extra to install."""
    try:
        import ImageReward as RM
    except ImportError as e:
        raise ImportError(
            f"the 'imagereward' reward needs the optional extra 'imagereward': {EXTRA_HINT}. "
            f"Import failed with: {type(e).__name__}: {e}"
        ) from e
    return RM


class ImageRewardScore(Reward):
    """ImageReward score (≈ −2…2, z-scored against the package's reference mean/std).

    kwargs:
      model: ``"ImageReward-v1.0"`` (default, fetched by the package from ``THUDM/ImageReward``) or a local
        ``ImageReward.pt`` checkpoint file.
      med_config: local ``med_config.json`` (default: the package downloads it next to the checkpoint).
      download_root: where the package caches downloads (default ``~/.cache/ImageReward``).
      device / dtype: ``"auto"`` (cuda + fp16, else cpu + fp32) or explicit; the final MLP runs in fp32.
      batch_size: images per forward pass (default 32).
    """

    name = "imagereward"
    max_length = 35  # the package's prompt length

    def __init__(
        self,
        model: str = "ImageReward-v1.0",
        med_config: str | None = None,
        download_root: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ):
        RM = import_image_reward()
        self.device = resolve_device(device, self.name)
        self.dtype = resolve_dtype(dtype, self.device, self.name)
        self.batch_size = check_batch_size(batch_size, self.name)
        net = RM.load(model, device=str(self.device), download_root=download_root, med_config=med_config)
        for child_name, child in net.named_children():  # the package runs the MLP on float32 features
            child.to(device=self.device, dtype=torch.float32 if child_name == "mlp" else self.dtype)
        net.eval().requires_grad_(False)
        net.device = self.device
        self.model = net

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The BLIP input for images [B, 3, H, W] in [0, 1]: float32 [B, 3, 224, 224] on CPU."""
        return torch.stack([self.model.preprocess(im) for im in to_pil(images)])

    @torch.no_grad()
    def score(self, images, prompts, meta):
        net = self.model
        uniq, index = unique(prompts)
        tok = net.blip.tokenizer(
            uniq, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        out = []
        for sl in batches(images.shape[0], self.batch_size):
            emb = net.blip.visual_encoder(self.pixels(images[sl]).to(self.device, self.dtype))
            atts = torch.ones(emb.shape[:-1], dtype=torch.long, device=self.device)
            rows = index[sl].to(self.device)
            txt = net.blip.text_encoder(
                tok.input_ids[rows],
                attention_mask=tok.attention_mask[rows],
                encoder_hidden_states=emb,
                encoder_attention_mask=atts,
                return_dict=True,
            )
            feat = txt.last_hidden_state[:, 0, :].float()
            out.append(((net.mlp(feat) - net.mean) / net.std).squeeze(-1))
        return torch.cat(out).cpu()
