"""A tiny, fully offline ``HunyuanImagePipeline`` (HunyuanImage 2.1) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_hunyuan_image_pipeline``: 16×16 px images ↔ 4×4×4 latents (``AutoencoderKLHunyuanImage``: blocks (32, 32,
32), spatial compression 4, 4 latent channels, scaling 0.75289 as HunyuanImage 2.1's), one token per latent cell
(patch (1, 1)): 16 image tokens; ``HunyuanImageTransformer2DModel`` with 1 double-stream + 1 single-stream block and
1 token-refiner block × 2 heads × 8 (RoPE axes (4, 4)); with ``glyph=True`` HunyuanImage 2.1's glyph (ByT5)
projection (input width 8; its hidden width is diffusers' fixed 2048: 4.2 M parameters, so it is off by default and
the transformer ignores the ByT5 embeddings the pipeline still computes); a 3-layer
``Qwen2_5_VLForConditionalGeneration`` of width 16 (the pipeline takes the hidden state two layers before the last:
``hidden_state_skip_layer`` 2) with :func:`~flowrl.models.testing.qwen_image.tiny_qwen_tokenizer` (Qwen-Image's template
words, so the template's first 34 tokens are its system turn and the user header, the ones the pipeline drops); a
1-layer ``T5EncoderModel`` of width 8 with the byte-level ``ByT5Tokenizer`` for quoted text; the scheduler with
HunyuanImage 2.1's static shift 5; the guider HunyuanImage 2.1's ``AdaptiveProjectedMixGuidance`` (CFG 3.5, APG from
step 6 on). ``guidance_embeds=True`` builds a guidance-distilled transformer without a guider (the pipeline's
``distilled_guidance_scale`` is then its input). The pipeline encodes its text to ``tokenizer_max_length`` (1000)
tokens: set ``pipe.tokenizer_max_length`` to the adapter's ``max_sequence_length`` (e.g. 16) to compare them, and pass
``height=16, width=16``.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.qwen_image import tiny_qwen_tokenizer
from flowrl.models.testing.text_encoders import TINY_VOCAB, qwen25vl_text_encoder


def _text_encoders(tokenizer):
    """(Qwen2.5-VL text encoder of width 16, 3 layers; ByT5 tokenizer and a 1-layer T5 encoder of width 8)."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = qwen25vl_text_encoder(len(tokenizer), 16, 3, im_end, mrope_section=[2, 1, 1])  # head_dim 8
    # The glyph encoder: byte-level ByT5 (its own vocabulary and attention sizes, not the word-level tiny T5).
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=8,
            d_kv=4,
            d_ff=16,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    return text_encoder, tokenizer_2, text_encoder_2


def tiny_hunyuan_image_pipeline(
    seed: int = 0, guidance_embeds: bool = False, glyph: bool = False, words: list[str] | None = None
):
    """A random-weight ``HunyuanImagePipeline`` (module docstring for sizes); 16×16 px images. ``seed`` fixes all
    weights: two calls with the same arguments build identical pipelines. ``guidance_embeds``: a guidance-distilled
    transformer (no guider) instead of HunyuanImage 2.1's CFG one (its APG guider); ``glyph``: with the ByT5
    projection. CPU, fp32."""
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(list(words or TINY_VOCAB))
    text_encoder, tokenizer_2, text_encoder_2 = _text_encoders(tokenizer)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=(1, 1),
        guidance_embeds=guidance_embeds,
        text_embed_dim=16,
        text_embed_2_dim=8 if glyph else None,
        rope_axes_dim=(4, 4),
    ).eval()
    vae = AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 32, 32),
        layers_per_block=1,
        spatial_compression_ratio=4,
        sample_size=16,
        scaling_factor=0.75289,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    return HunyuanImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        guider=None if guidance_embeds else AdaptiveProjectedMixGuidance(),
    )
