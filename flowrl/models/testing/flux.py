"""A tiny, fully offline ``FluxPipeline`` (FLUX.1) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_flux_pipeline``: 16×16 px images ↔ 4×8×8 latents (factor-2 VAE without quant convs, as
FLUX's) packed 2×2 into 16 tokens of 16 channels; ``FluxTransformer2DModel`` with 1 double + 1 single
block × 2 heads × 8 (RoPE axes (2, 2, 4); 24.9 k parameters), guidance embedding on (as
FLUX.1-dev); CLIP text encoder (hidden 32 = pooled projection dim) and a 1-layer T5 (d_model 32).
Dynamic shifting as FLUX.1. FLUX pipelines default to 1024 px, so pass ``height=16, width=16`` to
the adapter.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one CLIP token and one T5 token, so
different prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.autoencoders import kl_vae
from flowrl.models.testing.text_encoders import TINY_VOCAB, clip_text_encoder, clip_tokenizer, t5_encoder, t5_tokenizer


def tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True, words: list[str] | None = None):
    """A random-weight ``FluxPipeline`` (see the module docstring for sizes); use 16×16 px images.

    ``guidance_embeds=True`` mimics FLUX.1-dev (distilled guidance input), False FLUX.1-schnell.
    Returns the pipeline on CPU, fp32.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    words = list(words or TINY_VOCAB)
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer(words)
    text_encoder = clip_text_encoder(len(tokenizer), 32)
    tokenizer_2 = t5_tokenizer(words)
    text_encoder_2 = t5_encoder(len(tokenizer_2), 32)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels × 2×2 packing
        out_channels=None,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 width
        pooled_projection_dim=32,  # CLIP hidden size
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),  # sums to attention_head_dim
    ).eval()
    vae = kl_vae(4, quant_convs=False, scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
