"""HPSv2 / HPSv2.1 (Human Preference Score v2): an open_clip ViT-H-14 fine-tuned on human preferences.

As the HPSv2 package scores: the full HPS checkpoint (``{"state_dict": ...}``) is loaded into an
open_clip ``ViT-H-14``; score = cos(image embedding, text embedding) (≈ 0.2–0.35 for real images),
with open_clip's validation transform (bicubic resize of the shorter side to 224, centre crop,
OpenAI mean/std) on 8-bit images.
"""

from __future__ import annotations

from flowrl_rewards.core._common import check_batch_size, hub_or_local_file, resolve_device, resolve_dtype
from flowrl_rewards.preference.clip_score import OpenClipCosine, load_open_clip

#: Checkpoints of the official ``xswu/HPSv2`` hub repo, by version.
HPS_CHECKPOINTS = {"v2.0": "xswu/HPSv2:HPS_v2_compressed.pt", "v2.1": "xswu/HPSv2:HPS_v2.1_compressed.pt"}


class HPSv2(OpenClipCosine):
    """Human Preference Score v2 / v2.1.

    kwargs:
      version: ``"v2.1"`` (default) or ``"v2.0"``; picks the hub checkpoint when ``checkpoint`` is None.
      checkpoint: local HPS checkpoint file (``.pt`` / ``.safetensors``) or ``"org/repo:file"`` on the hub.
      model: open_clip architecture (default ``"ViT-H-14"``; ``"local-dir:/path"`` for a config folder).
      scale: multiplier of the cosine (default 1.0, the published score).
      device / dtype / batch_size: as for every model reward (``"auto"``: cuda+fp16 or cpu+fp32; 32).
    """

    name = "hpsv2"

    def __init__(
        self,
        version: str = "v2.1",
        checkpoint: str | None = None,
        model: str = "ViT-H-14",
        scale: float = 1.0,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ):
        if version not in HPS_CHECKPOINTS:
            raise ValueError(f"hpsv2: version={version!r} is not known; use one of {sorted(HPS_CHECKPOINTS)}")
        dev = resolve_device(device, self.name)
        dt = resolve_dtype(dtype, dev, self.name)
        check_batch_size(batch_size, self.name)
        path = hub_or_local_file(checkpoint or HPS_CHECKPOINTS[version], "checkpoint", self.name)
        net, preprocess, tokenizer = load_open_clip(model, None, self.name, device=dev)  # init on the GPU: fast
        import open_clip

        try:  # open_clip's loader: weights_only torch.load, {"state_dict": ...} and "module." handled
            open_clip.load_checkpoint(net, path, strict=True)
        except Exception as e:
            raise RuntimeError(f"hpsv2: checkpoint {path!r} does not fit open_clip model {model!r}: {e}") from e
        self.version, self.checkpoint = version, path
        self._setup(net, preprocess, tokenizer, dev, dt, scale, batch_size)
