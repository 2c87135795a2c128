"""A tiny, fully offline ``WanPipeline`` (Wan 2.1 text-to-video) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_wan_pipeline``: videos of 4k + 1 frames ↔ latents ``[4, k + 1, H/8, W/8]`` (``AutoencoderKLWan``: base dim 8,
``dim_mult`` (1, 1, 1, 1) → spatial factor 8, temporal downsampling in the last two stages → temporal factor 4, the
first frame alone in the first latent frame; per-channel ``latents_mean`` / ``latents_std``); a
``WanTransformer3DModel`` with 2 blocks × 2 heads × 12 (patch (1, 2, 2), RoPE split 4/4/4 over frames, height, width);
a 1-layer ``UMT5EncoderModel`` (d_model 32 = the transformer's ``text_dim``) with an in-memory Unigram T5 tokenizer
(:func:`~flowrl.models.testing.text_encoders.t5_tokenizer`: every word of
:data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one token). Scheduler: ``scheduler="unipc"`` (default) is
Wan 2.1's own (``UniPCMultistepScheduler`` with flow sigmas, ``flow_shift`` 3.0 as for 480P), ``"euler"`` a
``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (the pipeline's own call is then an Euler ODE, comparable step for
step). ``expand_timesteps=True`` builds the pipeline in Wan 2.2 TI2V's
per-token timestep mode; ``vae="wan22"`` gives it Wan 2.2's VAE layout (TI2V-5B: residual blocks, 2×2 pixel patches
→ spatial factor 16, ``z_dim`` 8 standing for 48). ``two_experts=True`` adds Wan 2.2 A14B's low-noise expert
``transformer_2`` (the same architecture, its own weights) and ``boundary_ratio`` (0.875, T2V-A14B's);
``image_to_video=True`` builds a ``WanImageToVideoPipeline`` in I2V-A14B's layout (no image encoder; the transformer
takes the latents, a 4-channel first-frame mask and the image's latent: 2·4 + 4 = 12 channels in, 4 out). Pass e.g.
``height=32, width=48, num_frames=5`` and a small ``max_sequence_length`` (e.g. 12) to the adapter and to the
pipeline's own call (``vae="wan22"``: sides multiples of 32).
"""

from __future__ import annotations

import torch

from flowrl.models.testing.text_encoders import TINY_VOCAB, t5_encoder, t5_tokenizer

WAN_UNIPC_CONFIG = dict(
    num_train_timesteps=1000,
    solver_order=2,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    final_sigmas_type="zero",
    lower_order_final=True,
    predict_x0=True,
    solver_type="bh2",
    timestep_spacing="linspace",
)
"""The scheduler of Wan2.1-T2V-1.3B-Diffusers (``UniPCMultistepScheduler``), flow shift 3.0 (480P; 5.0 for 720P)."""


def tiny_wan_pipeline(
    seed: int = 0,
    words: list[str] | None = None,
    scheduler: str = "unipc",
    expand_timesteps: bool = False,
    vae: str = "wan21",
    two_experts: bool = False,
    boundary_ratio: float = 0.875,
    image_to_video: bool = False,
):
    """A random-weight ``WanPipeline`` (``image_to_video``: ``WanImageToVideoPipeline``; module docstring for sizes).
    ``seed`` fixes all weights: two calls with the same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    if scheduler not in ("unipc", "euler"):
        raise ValueError(f"scheduler must be 'unipc' or 'euler'; got {scheduler!r}")
    if vae not in ("wan21", "wan22"):
        raise ValueError(f"vae must be 'wan21' or 'wan22'; got {vae!r}")
    torch.manual_seed(seed)
    tokenizer = t5_tokenizer(list(words or TINY_VOCAB), model_max_length=512)
    text_encoder = t5_encoder(len(tokenizer), 32, umt5=True)
    z = 4 if vae == "wan21" else 8
    inputs = 2 * z + 4 if image_to_video else z  # I2V: latents, the first-frame mask (4) and the image's latent
    transformer = _tiny_transformer(inputs, z)
    autoencoder = _tiny_vae(vae)
    if scheduler == "unipc":
        sampler = UniPCMultistepScheduler(**WAN_UNIPC_CONFIG)
    else:
        sampler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=autoencoder)
    if two_experts:
        components.update(transformer_2=_tiny_transformer(inputs, z), boundary_ratio=boundary_ratio)
    cls = WanImageToVideoPipeline if image_to_video else WanPipeline
    return cls(**components, scheduler=sampler, expand_timesteps=expand_timesteps)


def _tiny_transformer(in_channels: int, out_channels: int):
    """A ``WanTransformer3DModel``: 2 blocks × 2 heads × 12, patch (1, 2, 2), text_dim 32 (the tiny UMT5's)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()


def _tiny_vae(kind: str):
    """``AutoencoderKLWan``: Wan 2.1's layout (z 4, spatial factor 8) or Wan 2.2's (z 8, residual, 2×2 pixel patches:
    spatial factor 16); temporal factor 4."""
    from diffusers import AutoencoderKLWan

    common = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    if kind == "wan21":
        return AutoencoderKLWan(
            **common,
            z_dim=4,
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
            latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
        ).eval()
    return AutoencoderKLWan(
        **common,
        z_dim=8,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557],
        latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013],
    ).eval()
