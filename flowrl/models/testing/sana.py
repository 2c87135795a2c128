"""A tiny, fully offline ``SanaPipeline`` with random weights, for tests (as :mod:`flowrl.models.testing.sd3`).

``tiny_sana_pipeline``: 32×32 px images (``SanaPipeline`` needs multiples of 32) ↔ 4×8×8 latents
(factor-4 ``AutoencoderDC``: blocks (ResBlock, ResBlock, EfficientViTBlock) × 8 channels, scaling
0.41407, no shift), ``SanaTransformer2DModel`` with 2 layers × 2 heads × 8 (patch 1 → 64 image tokens,
cross-attention 2 × 8; 16.8 k parameters), a 1-layer ``Gemma2Model`` (hidden 16 = caption channels)
with an in-memory BPE ``GemmaTokenizer``, and SANA's scheduler (``DPMSolverMultistepScheduler`` with
flow sigmas, ``flow_shift`` 3; ``scheduler="euler"`` gives ``FlowMatchEulerDiscreteScheduler(shift=3)``).
Pass ``max_sequence_length`` (e.g. 8) to the adapter, and to the pipeline's own call
``use_resolution_binning=False`` and ``complex_human_instruction=None``.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one Gemma token, so different prompts
always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.text_encoders import TINY_VOCAB, decoder_config, gemma_tokenizer


def tiny_sana_pipeline(seed: int = 0, words: list[str] | None = None, scheduler: str = "dpm"):
    """A random-weight ``SanaPipeline`` (see the module docstring for sizes); 32×32 px images.

    ``scheduler``: ``"dpm"`` (SANA's ``DPMSolverMultistepScheduler`` with flow sigmas) or ``"euler"``
    (``FlowMatchEulerDiscreteScheduler``). Returns the pipeline on CPU, fp32.
    """
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    words = list(words or TINY_VOCAB)
    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer(words, model_max_length=16)
    text_encoder = Gemma2Model(
        Gemma2Config(
            **decoder_config(
                len(tokenizer),
                16,
                1,
                head_dim=8,
                max_position_embeddings=64,
                eos_token_id=1,
                bos_token_id=2,
                attn_implementation="eager",
            )
        )
    ).eval()
    transformer = SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
    ).eval()
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        encoder_qkv_multiscales=((), (), (5,)),
        decoder_qkv_multiscales=((), (), (5,)),
        encoder_layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    ).eval()
    if scheduler == "dpm":
        sched = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    elif scheduler == "euler":
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    else:
        raise ValueError(f"scheduler must be 'dpm' or 'euler'; got {scheduler!r}")
    return SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=sched
    )
