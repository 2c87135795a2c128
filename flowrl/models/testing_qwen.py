"""A tiny, fully offline ``QwenImagePipeline`` with random weights, for tests (as :mod:`flowrl.models.testing`).

``tiny_qwen_image_pipeline``: 32×32 px images ↔ 4×8×8 latents (``AutoencoderKLQwenImage``: base dim 8,
``dim_mult`` (1, 2, 2) → spatial factor 4, no temporal downsampling, per-channel ``latents_mean`` /
``latents_std``), packed 2×2 into 16 tokens of 16 channels; ``QwenImageTransformer2DModel`` with 2 blocks ×
2 heads × 16 (hidden 32, RoPE axes (4, 6, 6)); a 1-layer ``Qwen2_5_VLForConditionalGeneration`` (text hidden
32 = ``joint_attention_dim``, mRoPE sections (2, 3, 3); a 1-block vision tower that text-to-image never runs)
with an in-memory byte-level BPE ``Qwen2Tokenizer``; the scheduler configured as Qwen-Image's
(dynamic shifting with an exponential time shift, ``shift_terminal`` 0.02). Pass ``height=32, width=32``
and a small ``max_sequence_length`` (e.g. 8) to the adapter and to the pipeline's own call.

The tokenizer makes every word of :data:`~flowrl.models.testing.TINY_VOCAB` and of Qwen-Image's prompt
template one token (with and without a leading space), so the template's first 34 tokens — the ones the
pipeline drops (``prompt_template_encode_start_idx``) — are exactly its system turn and the user header, as
with the real tokenizer.
"""
from __future__ import annotations

import re

import torch

from flowrl.models.testing import TINY_VOCAB

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
"""``QwenImagePipeline.prompt_template_encode`` (its words are in the tiny vocabulary)."""


def qwen_vocab_and_merges(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2 / Qwen2 style: ``Ġ`` marks a leading space) in which each of ``words`` is one
    token with and without the space: id 0 ``<|endoftext|>``, the 256 byte symbols, then every substring of
    every word (each split of a substring a merge, so a word always ends as one token)."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = [SPECIAL_TOKENS[0], *sorted(ByteLevel.alphabet())]
    seen, merges, merge_seen = set(tokens), [], set()
    for word in sorted(set(words)):
        for full in (word, "Ġ" + word):
            for length in range(2, len(full) + 1):
                for i in range(len(full) - length + 1):
                    if full[i:i + length] not in seen:
                        seen.add(full[i:i + length])
                        tokens.append(full[i:i + length])
                    for k in range(i + 1, i + length):
                        if (full[i:k], full[k:i + length]) not in merge_seen:
                            merge_seen.add((full[i:k], full[k:i + length]))
                            merges.append((full[i:k], full[k:i + length]))
    return {t: i for i, t in enumerate(tokens)}, merges


def tiny_qwen_tokenizer(words=TINY_VOCAB):
    """``Qwen2Tokenizer`` over ``words`` and the template's words, ``<|im_start|>`` / ``<|im_end|>`` special."""
    from transformers import Qwen2Tokenizer

    template_words = re.findall(r"[A-Za-z]+", TEMPLATE.replace("<|im_start|>", " ").replace("<|im_end|>", " "))
    vocab, merges = qwen_vocab_and_merges([*words, *template_words])
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024 + 34)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def tiny_qwen_image_pipeline(seed: int = 0, words: list[str] | None = None, num_layers: int = 2):
    """A random-weight ``QwenImagePipeline`` (module docstring for sizes); 32×32 px images. ``seed`` fixes all
    weights: two calls with the same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(list(words or TINY_VOCAB))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None, eos_token_id=im_end, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},  # head_dim 16
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0], patch_size=2, temporal_patch_size=1, spatial_merge_size=1),
    )).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, False],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075], latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler_config.json
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
