"""A tiny, fully offline ``WanPipeline`` (Wan 2.1 text-to-video) with random weights, for tests (as
:mod:`flowrl.models.testing`).

``tiny_wan_pipeline``: videos of 4k + 1 frames ↔ latents ``[4, k + 1, H/8, W/8]`` (``AutoencoderKLWan``: base dim 8,
``dim_mult`` (1, 1, 1, 1) → spatial factor 8, temporal downsampling in the last two stages → temporal factor 4, the
first frame alone in the first latent frame; per-channel ``latents_mean`` / ``latents_std``); a
``WanTransformer3DModel`` with 2 blocks × 2 heads × 12 (patch (1, 2, 2), RoPE split 4/4/4 over frames, height, width);
a 1-layer ``UMT5EncoderModel`` (d_model 32 = the transformer's ``text_dim``) with an in-memory Unigram T5 tokenizer
(:func:`flowrl.models.testing._tiny_t5_tokenizer`: every word of :data:`~flowrl.models.testing.TINY_VOCAB` is one
token). Scheduler: ``scheduler="unipc"`` (default) is Wan 2.1's own (``UniPCMultistepScheduler`` with flow sigmas,
``flow_shift`` 3.0 as for 480P), ``"euler"`` a ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (the pipeline's own call
is then an Euler ODE, comparable step for step). ``expand_timesteps=True`` builds the pipeline in Wan 2.2 TI2V's
per-token timestep mode. Pass e.g. ``height=32, width=48, num_frames=5`` and a small ``max_sequence_length`` (e.g. 12)
to the adapter and to the pipeline's own call.
"""

from __future__ import annotations

import torch

from flowrl.models.testing import TINY_VOCAB, _tiny_t5_tokenizer

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
    seed: int = 0, words: list[str] | None = None, scheduler: str = "unipc", expand_timesteps: bool = False
):
    """A random-weight ``WanPipeline`` (module docstring for sizes). ``seed`` fixes all weights: two calls with the
    same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if scheduler not in ("unipc", "euler"):
        raise ValueError(f"scheduler must be 'unipc' or 'euler'; got {scheduler!r}")
    torch.manual_seed(seed)
    tokenizer = _tiny_t5_tokenizer(list(words or TINY_VOCAB), model_max_length=512)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    ).eval()
    if scheduler == "unipc":
        sampler = UniPCMultistepScheduler(**WAN_UNIPC_CONFIG)
    else:
        sampler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=sampler,
        expand_timesteps=expand_timesteps,
    )
