"""A tiny, fully offline ``StableDiffusion3Pipeline`` (SD3 / SD3.5) with random weights, for tests.

It assembles real diffusers / transformers components from small configs (no model hub, no files read), so every
adapter code path runs exactly as it would on SD3/SD3.5, only smaller. It ``save_pretrained``-s and loads back
through :func:`flowrl.models.load_model`.

``tiny_sd3_pipeline``: 16×16 px images ↔ 4×8×8 latents (factor-2 VAE, channels (8, 8), no mid-block
attention), ``SD3Transformer2DModel`` with 2 layers × 2 heads × 8 (inner dim 16, patch 2 → 16 image
tokens, SD3.5-style RMS qk-norm and a dual-attention first layer; 24.6 k parameters), two CLIP text
encoders with projection (hidden = projection = 8 and 16, 2 layers → pooled 24; hidden states
zero-padded to 32), CLIP ``model_max_length`` 10 and, with ``with_t5=True``, a 1-layer T5 encoder
(d_model 32 = ``joint_attention_dim``). Scheduler shift 3.0 (static, as SD3). The adapter adds
``max_sequence_length`` (default 16) T5 tokens, zeros without T5, so the transformer sees 10 + 16
text tokens and 16 image tokens. A velocity at batch 16 takes about 10–20 ms on one CPU thread.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one CLIP token and one T5 token, so
different prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.autoencoders import kl_vae
from flowrl.models.testing.text_encoders import TINY_VOCAB, clip_text_encoder, clip_tokenizer, t5_encoder, t5_tokenizer


def tiny_sd3_pipeline(
    with_t5: bool = False,
    seed: int = 0,
    sample_size: int = 8,
    num_layers: int = 2,
    shift: float = 3.0,
    words: list[str] | None = None,
):
    """A random-weight ``StableDiffusion3Pipeline`` (see the module docstring for sizes).

    ``sample_size`` is the latent side (images are ``2 * sample_size`` px). ``seed`` fixes all weights,
    so two calls with the same arguments build identical pipelines. Returns the pipeline on CPU, fp32.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    words = list(words or TINY_VOCAB)
    if sample_size % 2:
        raise ValueError(f"sample_size must be even (patch size 2); got {sample_size}")
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer(words)
    tokenizer_2 = clip_tokenizer(words)
    vocab_size = len(tokenizer)
    # Two CLIPs of different widths (as CLIP-L 768 and CLIP-G 1280): hidden states 8 + 16 are
    # concatenated and zero-padded to the T5 width 32; pooled projections 8 + 16 → 24.
    text_encoder = clip_text_encoder(vocab_size, 8, with_projection=True)
    text_encoder_2 = clip_text_encoder(vocab_size, 16, with_projection=True)
    joint_dim = 32  # > the two CLIP hidden sizes concatenated (8 + 16); = the T5 width
    if with_t5:
        tokenizer_3 = t5_tokenizer(words)
        text_encoder_3 = t5_encoder(len(tokenizer_3), joint_dim)
    else:
        tokenizer_3 = text_encoder_3 = None
    transformer = SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=2,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=joint_dim,
        caption_projection_dim=16,  # = num_attention_heads * attention_head_dim
        pooled_projection_dim=24,  # = the two CLIP projections concatenated
        out_channels=4,
        pos_embed_max_size=max(16, sample_size),
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).eval()
    vae = kl_vae(4, quant_convs=True, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
