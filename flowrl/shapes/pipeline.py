"""The embedded shapes model: a real (tiny) diffusers ``StableDiffusion3Pipeline`` over the shapes world.

Components (built from configs, no model hub):

- ``vae``: ``AutoencoderKL`` with one downsampling (factor 2), channels (32, 64), 4 latent channels,
  no mid-block attention. A 32×32 image becomes a ``[4, 16, 16]`` latent. Its ``scaling_factor`` and
  ``shift_factor`` are measured on rendered images after the VAE is trained (``1 / std`` and
  ``mean`` of the latents), so scaled latents have mean 0 and std 1.
- ``text_encoder`` / ``text_encoder_2``: two small ``CLIPTextModelWithProjection`` (hidden 64,
  2 layers, projection 32) with a word-level CLIP tokenizer over :func:`flowrl.shapes.world.vocabulary`
  (each vocabulary word is exactly one token; ``model_max_length`` = :data:`CLIP_MAX_LENGTH`).
  Their penultimate hidden states are concatenated to 128 features (= the transformer's
  ``joint_attention_dim``, so SD3's zero-padding is a no-op); the pooled projections to 64.
- No T5 (``text_encoder_3=None``). SD3 then appends ``max_sequence_length`` zero tokens to the text
  sequence; the model is trained with :data:`MAX_SEQUENCE_LENGTH` of them and must be sampled with
  the same number (the diffusers default of 256 would add 248 tokens it never saw).
- ``transformer``: ``SD3Transformer2DModel``, 4 layers × 4 heads × 32 (width 128), patch 2, so 64
  image tokens and ``CLIP_MAX_LENGTH + MAX_SEQUENCE_LENGTH`` text tokens.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=1.0)``.

Generation with the shipped weights (the call the pretraining report was measured with)::

    from flowrl.shapes.pipeline import load_shapes_pipeline, generation_defaults
    pipe = load_shapes_pipeline()                       # flowrl/shapes/weights, CPU fp32
    images = pipe("a red circle above a blue square", num_inference_steps=20, guidance_scale=3.0,
                  height=32, width=32, max_sequence_length=8,
                  generator=torch.Generator().manual_seed(0)).images   # list of 32×32 PIL images
    # equivalently: pipe(prompt, **generation_defaults(), ...)

``generation_defaults()`` reads ``flowrl_shapes.json`` in the weights folder
(``{"max_sequence_length", "height", "width", "guidance_scale", "num_inference_steps"}``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
CONFIG_FILE = "flowrl_shapes.json"

CANVAS_SIZE = 32  # image side (px)
CLIP_MAX_LENGTH = 16  # CLIP tokens per prompt (BOS + up to 14 words + EOS/pad)
MAX_SEQUENCE_LENGTH = 8  # zero "T5" tokens SD3 appends without T5; trained with exactly this many
DEFAULT_GUIDANCE = 3.0  # CFG scale the model is evaluated and aligned at (colours found 0.92 vs 0.81 at 1.0)
DEFAULT_STEPS = 20

VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=CANVAS_SIZE,
    mid_block_add_attention=False,
    scaling_factor=1.0,  # replaced by the measured 1 / std after VAE training
    shift_factor=0.0,  # replaced by the measured mean after VAE training
)

TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    projection_dim=32,
    max_position_embeddings=CLIP_MAX_LENGTH,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)

TRANSFORMER_CONFIG = dict(
    sample_size=CANVAS_SIZE // 2,  # latent side
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=2 * TEXT_CONFIG["hidden_size"],
    caption_projection_dim=128,
    pooled_projection_dim=2 * TEXT_CONFIG["projection_dim"],
    pos_embed_max_size=CANVAS_SIZE // 4,  # 8×8 patches
)


def build_shapes_tokenizer():
    """Word-level ``CLIPTokenizer`` over the shapes vocabulary (one token per word)."""
    from flowrl.models.tokenizers import build_clip_tokenizer
    from flowrl.shapes.world import vocabulary

    return build_clip_tokenizer(vocabulary(), model_max_length=CLIP_MAX_LENGTH)


def build_shapes_pipeline(seed: int = 0):
    """An untrained shapes ``StableDiffusion3Pipeline`` (fp32, CPU), weights initialised from ``seed``.

    Initialisation uses a forked global torch RNG seeded with ``seed``, so the caller's RNG state
    is untouched and the same seed gives the same weights.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = build_shapes_tokenizer()
    text_config = CLIPTextConfig(vocab_size=len(tokenizer), **TEXT_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(**VAE_CONFIG)
        text_encoder = CLIPTextModelWithProjection(text_config)
        text_encoder_2 = CLIPTextModelWithProjection(text_config)
        transformer = SD3Transformer2DModel(**TRANSFORMER_CONFIG)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_generation_defaults(path: str | Path, guidance_scale: float = DEFAULT_GUIDANCE) -> None:
    """Write ``flowrl_shapes.json`` (how to call the pipeline) into a saved pipeline folder."""
    cfg = dict(
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        height=CANVAS_SIZE,
        width=CANVAS_SIZE,
        guidance_scale=guidance_scale,
        num_inference_steps=DEFAULT_STEPS,
        clip_max_length=CLIP_MAX_LENGTH,
    )
    (Path(path) / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def generation_defaults(path: str | Path = SHIPPED_DIR) -> dict:
    """Keyword arguments for ``pipe(prompt, **kwargs)``: height, width, max_sequence_length,
    guidance_scale, num_inference_steps (from ``flowrl_shapes.json``; module defaults if absent)."""
    file = Path(path) / CONFIG_FILE
    cfg = json.loads(file.read_text()) if file.is_file() else {}
    return dict(
        height=cfg.get("height", CANVAS_SIZE),
        width=cfg.get("width", CANVAS_SIZE),
        max_sequence_length=cfg.get("max_sequence_length", MAX_SEQUENCE_LENGTH),
        guidance_scale=cfg.get("guidance_scale", DEFAULT_GUIDANCE),
        num_inference_steps=cfg.get("num_inference_steps", DEFAULT_STEPS),
    )


def load_shapes_pipeline(
    path: str | Path = SHIPPED_DIR, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
):
    """Load a saved shapes pipeline (default: the shipped, pretrained one) with plain diffusers.

    Equivalent to ``StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None,
    tokenizer_3=None, dtype=dtype).to(device)`` (the weights are stored in fp32; loading in ``dtype``,
    rather than casting after, is what diffusers asks for). It loads in a fraction of a second, so
    diffusers' and transformers' loading bars are off during the load. Generate with
    ``generation_defaults(path)`` (notably ``max_sequence_length``; see the module docstring).
    """
    from diffusers import StableDiffusion3Pipeline

    from flowrl.models.dtypes import no_loading_bars

    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"no shapes pipeline at {str(path)!r} (model_index.json missing); "
            "train one with `python scripts/pretrain_shapes.py --out <folder>`"
        )
    with no_loading_bars():
        pipe = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)
