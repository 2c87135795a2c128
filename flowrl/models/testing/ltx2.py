"""A tiny, fully offline ``LTX2Pipeline`` (LTX-2 audio-video) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_ltx2_pipeline``: videos of 4k + 1 frames ↔ latents ``[4, k + 1, H/8, W/8]`` (``AutoencoderKLLTX2Video``: patch 2,
two spatio-temporal stages of 8 channels → spatial factor 8, temporal factor 4, the first frame alone in the first
latent frame; random per-channel ``latents_mean`` / ``latents_std`` buffers, as a trained VAE stores them); an
``LTX2VideoTransformer3DModel`` with 2 blocks, video stream 2 heads × 8 (patch 1: a token per latent cell), audio
stream 2 heads × 4, split RoPE; a 2-layer ``Gemma3ForConditionalGeneration`` (hidden 16, a 1-layer vision tower) with
an in-memory BPE ``GemmaTokenizer`` (every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one
token); the ``LTX2TextConnectors`` (3 stacked Gemma hidden states → 16 features, one connector block per stream,
4 learnable registers: ``max_sequence_length`` must be a multiple of 4); a one-stage ``AutoencoderKLLTX2Audio`` (2
latent channels, 8 mel bins) and an ``LTX2Vocoder``, which only the pipeline's own call uses (flowrl is video only).
Scheduler: ``FlowMatchEulerDiscreteScheduler`` with LTX's dynamic shift (base 0.95 at 1024 tokens, max 2.05 at 4096,
exponential, stretched to a terminal σ of 0.1). Pipeline sizes must be multiples of 32 px: pass e.g. ``height=32,
width=32, num_frames=5, max_sequence_length=8`` to the adapter and to the pipeline's own call.

``audio_to_video=False`` zeroes the audio→video cross-attention gate (the global ``av_cross_attn_video_a2v_gate`` and
every block's gate row): the pipeline's joint audio-video sampling then gives exactly the video of a video-only
transformer, the stand-in the equality test uses (LTX2Pipeline always samples audio beside the video).
"""

from __future__ import annotations

import torch

from flowrl.models.testing.text_encoders import TINY_VOCAB, decoder_config, gemma_tokenizer

LTX2_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
    time_shift_type="exponential",
)
"""LTX's flow-match Euler scheduler config (the values LTX2Pipeline's ``calculate_shift`` falls back on, and LTX's
terminal σ 0.1)."""


def _tiny_gemma3(vocab_size: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=decoder_config(
                vocab_size,
                16,
                2,
                head_dim=8,
                max_position_embeddings=64,
                sliding_window=16,
                eos_token_id=1,
                bos_token_id=2,
            ),
            vision_config=dict(
                hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8
            ),
            mm_tokens_per_image=4,
            boi_token_index=vocab_size,
            image_token_index=vocab_size + 1,
            eoi_token_index=vocab_size + 2,
        )
    ).eval()


def _tiny_vae():
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        patch_size=2,
        patch_size_t=1,
        decoder_causal=False,
    ).eval()
    with torch.no_grad():  # per-channel statistics of a trained VAE: decode must undo them
        vae.latents_mean.copy_(torch.randn(4) * 0.5)
        vae.latents_std.copy_(torch.rand(4) * 2 + 0.5)
    return vae


def _tiny_transformer(audio_to_video: bool):
    """The 2-block ``LTX2VideoTransformer3DModel`` (module docstring); ``audio_to_video=False`` zeroes its
    audio→video cross-attention gates."""
    from diffusers import LTX2VideoTransformer3DModel

    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=16,
        rope_type="split",
    ).eval()
    if not audio_to_video:
        with torch.no_grad():
            transformer.av_cross_attn_video_a2v_gate.linear.weight.zero_()
            transformer.av_cross_attn_video_a2v_gate.linear.bias.zero_()
            for block in transformer.transformer_blocks:
                block.video_a2v_cross_attn_scale_shift_table[4:].zero_()
    return transformer


def _tiny_connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(
        caption_channels=16,
        text_proj_in_factor=3,  # the 2 Gemma layers' hidden states and the embeddings
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32,
        rope_type="split",
    ).eval()


def _tiny_audio():
    """The one-stage ``AutoencoderKLLTX2Audio`` and the ``LTX2Vocoder`` (built in this order)."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        mel_bins=8,
    ).eval()
    vocoder = LTX2Vocoder(
        in_channels=16,  # audio VAE output channels × mel bins
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    ).eval()
    return audio_vae, vocoder


def tiny_ltx2_pipeline(seed: int = 0, words: list[str] | None = None, audio_to_video: bool = True):
    """A random-weight ``LTX2Pipeline`` (module docstring for sizes). ``seed`` fixes all weights: two calls with the
    same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer(list(words or TINY_VOCAB), model_max_length=64)
    text_encoder = _tiny_gemma3(len(tokenizer))
    transformer = _tiny_transformer(audio_to_video)  # the parts drawn in this order (the weights depend on it)
    connectors = _tiny_connectors()
    audio_vae, vocoder = _tiny_audio()
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER_CONFIG),
        vae=_tiny_vae(),
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
