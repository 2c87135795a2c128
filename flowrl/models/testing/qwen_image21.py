"""A tiny, fully offline ``QwenImage21Pipeline`` (Qwen-Image 2.1) with random weights, for tests (as
:mod:`flowrl.models.testing.qwen_image`).

``tiny_qwen_image21_pipeline``: 32×64 px images ↔ 4×2×4 latents (``AutoencoderKLQwenImage21``: base dims 8, five
``dim_mult`` levels → spatial factor 16 as the pipeline requires, no temporal downsampling, per-channel
``latents_mean`` / ``latents_std``), one token per latent cell (8 target tokens, 2 vision-language slots of 2×2);
``QwenImage21Transformer2DModel`` with 2 single-stream blocks × 2 heads × 16 (hidden 32, RoPE axes (4, 6, 6),
``causal_condition`` on, as 2.1); a 1-layer ``Qwen3VLForConditionalGeneration`` (text hidden 32 =
``context_in_dim``, mRoPE sections (2, 3, 3); a 1-block vision tower that text-to-image never runs) with a
``Qwen3VLProcessor`` around an in-memory byte-level BPE ``Qwen2Tokenizer`` and a chat template of Qwen3-VL's shape
for the system turn (the pipeline drops that turn's tokens: ``_drop_idx``); the scheduler configured as Qwen-Image's
(dynamic shifting, exponential time shift, ``shift_terminal`` 0.02). ``sample_sigmas``: the pipeline's configured
grid (None: ``linspace(1, 1/steps, steps)``). Pass ``height=32, width=64`` to the adapter and to the pipeline's call.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` and of the pipeline's system prompt is one token
(with and without a leading space), so different prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.text_encoders import (
    QWEN_SPECIAL_TOKENS,
    TINY_VOCAB,
    VISION_TOKENS,
    decoder_config,
    qwen_tokenizer,
    qwen_vision_config,
    vision_token_ids,
)

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
"""``QwenImage21Pipeline.sys_prompt``."""
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for block in message['content'] -%}{%- if block['type'] == 'text' -%}{{ block['text'] }}"
    "{%- else -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
"""Qwen3-VL's chat template reduced to what the pipeline renders (a system turn, text and image blocks)."""


def tiny_qwen3vl_processor(words=TINY_VOCAB):
    """``Qwen3VLProcessor`` (Qwen2-VL image processor, patch 2, merge 1) around a ``Qwen2Tokenizer`` over ``words``,
    the system prompt's words and the chat roles, ``<|im_start|>`` / ``<|im_end|>`` and the vision tokens special."""
    import re

    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    words = [*words, *re.findall(r"[A-Za-z]+", SYSTEM_PROMPT), "system", "user", "assistant"]
    special = QWEN_SPECIAL_TOKENS[1:] + VISION_TOKENS
    tokenizer = qwen_tokenizer(words, special, special=special, model_max_length=4096)
    vision = dict(patch_size=2, temporal_patch_size=1, merge_size=1, min_pixels=4 * 4, max_pixels=64 * 64)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen_image21_pipeline(
    seed: int = 0, words: list[str] | None = None, num_layers: int = 2, sample_sigmas: list[float] | None = None
):
    """A random-weight ``QwenImage21Pipeline`` (module docstring for sizes); 32×64 px images. ``seed`` fixes all
    weights: two calls with the same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    processor = tiny_qwen3vl_processor(list(words or TINY_VOCAB))
    tokenizer = processor.tokenizer
    ids = vision_token_ids(tokenizer)
    torch.manual_seed(seed)
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=decoder_config(
                len(tokenizer),
                32,
                1,
                head_dim=16,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3]},
            ),
            vision_config=qwen_vision_config(32, num_position_embeddings=256, deepstack_visual_indexes=[0]),
            **ids,
        )
    ).eval()
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=32,
        mlp_ratio=3,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, False, False, False],
        latents_mean=[0.5126, 0.7721, -0.0631, 1.3506],
        latents_std=[2.1, 1.4, 2.3, 1.7],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImage21Pipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
        sample_sigmas=sample_sigmas,
    )
