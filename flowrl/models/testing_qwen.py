"""Tiny, fully offline ``QwenImagePipeline`` / ``QwenImageEditPipeline`` with random weights, for tests (as
:mod:`flowrl.models.testing`).

``tiny_qwen_image_pipeline``: 32×32 px images ↔ 4×8×8 latents (``AutoencoderKLQwenImage``: base dim 8,
``dim_mult`` (1, 2, 2) → spatial factor 4, no temporal downsampling, per-channel ``latents_mean`` /
``latents_std``), packed 2×2 into 16 tokens of 16 channels; ``QwenImageTransformer2DModel`` with 2 blocks ×
2 heads × 16 (hidden 32, RoPE axes (4, 6, 6)); a 1-layer ``Qwen2_5_VLForConditionalGeneration`` (text hidden
32 = ``joint_attention_dim``, mRoPE sections (2, 3, 3); a 1-block vision tower with patch 2, temporal patch 1,
merge 1, that text-to-image never runs) with an in-memory byte-level BPE ``Qwen2Tokenizer``; the scheduler
configured as Qwen-Image's (dynamic shifting with an exponential time shift, ``shift_terminal`` 0.02). Pass
``height=32, width=32`` and a small ``max_sequence_length`` (e.g. 8) to the adapter and to the pipeline's own call.

The tokenizer makes every word of :data:`~flowrl.models.testing.TINY_VOCAB` and of Qwen-Image's prompt
template one token (with and without a leading space), so the template's first 34 tokens — the ones the
pipeline drops (``prompt_template_encode_start_idx``) — are exactly its system turn and the user header, as
with the real tokenizer.

``tiny_qwen_image_edit_pipeline``: the same modules (same seed → same transformer, VAE and text-encoder rows),
the tokenizer extended — after all its ids — by the words of the edit template (whose first 64 tokens, the
dropped ones, are again the system turn and ``<|im_start|>user\\n``) and :data:`VISION_TOKENS`, and a
``Qwen2VLProcessor`` matching the vision tower: a 32×32 source image is 16×16 patches of 2×2 px → 256
``<|image_pad|>`` tokens (``max_pixels`` 32·32 caps any source there; ``min_pixels`` 4·4).
"""

from __future__ import annotations

import re

import torch

from flowrl.models.testing import TINY_VOCAB

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""``QwenImagePipeline.prompt_template_encode`` (its words are in the tiny vocabulary)."""
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the image. "
    "Generate a new image that meets the user's requirements while maintaining consistency with the "
    "original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
"""``QwenImageEditPipeline.prompt_template_encode`` (its words and `` (``, ``),``, ``'s`` are single tokens)."""
EDIT_PIXELS = dict(min_pixels=4 * 4, max_pixels=32 * 32)
"""The tiny ``Qwen2VLImageProcessor``'s pixel range (``smart_resize`` to multiples of 2 px within it)."""


def qwen_vocab_and_merges(words, more=()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2 / Qwen2 style: ``Ġ`` marks a leading space) in which each of ``words`` is one
    token with and without the space: id 0 ``<|endoftext|>``, the 256 byte symbols, then every substring of
    every word (each split of a substring a merge, so a word always ends as one token). ``more`` (words, and
    ``<|…|>`` strings, one token each) follows in its order, leaving the ids and merges before it unchanged."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = [SPECIAL_TOKENS[0], *sorted(ByteLevel.alphabet())]
    seen, merges, merge_seen = set(tokens), [], set()
    for word in [*sorted(set(words)), *more]:
        if word.startswith("<|"):
            seen.add(word)
            tokens.append(word)
            continue
        for full in (word, "Ġ" + word):
            for length in range(2, len(full) + 1):
                for i in range(len(full) - length + 1):
                    if full[i : i + length] not in seen:
                        seen.add(full[i : i + length])
                        tokens.append(full[i : i + length])
                    for k in range(i + 1, i + length):
                        if (full[i:k], full[k : i + length]) not in merge_seen:
                            merge_seen.add((full[i:k], full[k : i + length]))
                            merges.append((full[i:k], full[k : i + length]))
    return {t: i for i, t in enumerate(tokens)}, merges


def _words(template: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", re.sub(r"<\|\w+\|>", " ", template))


def tiny_qwen_tokenizer(words=TINY_VOCAB, edit: bool = False):
    """``Qwen2Tokenizer`` over ``words`` and the template's words, ``<|im_start|>`` / ``<|im_end|>`` special.
    ``edit``: then (same ids so far) the edit template's pieces and :data:`VISION_TOKENS`, special too."""
    from transformers import Qwen2Tokenizer

    more = [*SPECIAL_TOKENS[1:], *sorted({*_words(EDIT_TEMPLATE), "(", "),", "'s"}), *VISION_TOKENS] if edit else ()
    vocab, merges = qwen_vocab_and_merges([*words, *_words(TEMPLATE)], more)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048 if edit else 1024 + 34)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:] + (VISION_TOKENS if edit else [])})
    return tokenizer


def _tiny_modules(seed: int, tokenizer, num_layers: int, vocab_size: int | None = None, **token_ids) -> dict:
    """Seeded text encoder (``vocab_size`` rows, the new ones appended last), transformer, VAE, scheduler."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=vocab_size or len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                bos_token_id=None,
                eos_token_id=im_end,
                pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},  # head_dim 16
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
                patch_size=2,
                temporal_patch_size=1,
                spatial_merge_size=1,
            ),
            **token_ids,
        )
    ).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, False],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    ).eval()
    if len(tokenizer) > text_encoder.config.text_config.vocab_size:
        text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler_config.json
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
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def tiny_qwen_image_pipeline(seed: int = 0, words: list[str] | None = None, num_layers: int = 2):
    """A random-weight ``QwenImagePipeline`` (module docstring for sizes); 32×32 px images. ``seed`` fixes all
    weights: two calls with the same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_tiny_modules(seed, tiny_qwen_tokenizer(list(words or TINY_VOCAB)), num_layers))


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The ids a Qwen-VL config takes for its vision tokens (``image_token_id``, ``video_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id``), read from ``tokenizer``'s ``<|image_pad|>``, … tokens."""
    names = {"image": "image_pad", "video": "video_pad", "vision_start": "vision_start", "vision_end": "vision_end"}
    return {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for name, token in names.items()}


def tiny_qwen_image_edit_pipeline(seed: int = 0, words: list[str] | None = None, num_layers: int = 2):
    """A random-weight ``QwenImageEditPipeline`` (module docstring); 32×32 px source and output images. Its
    transformer, VAE and the text encoder's rows for the text-to-image vocabulary are
    :func:`tiny_qwen_image_pipeline`'s with the same arguments; the config's ``image_token_id``,
    ``video_token_id``, ``vision_start_token_id`` and ``vision_end_token_id`` are the tokenizer's. The pipeline
    resizes its (PIL) source to ``calculate_dimensions(1024 * 1024, ratio)``, a module-level function of
    ``pipeline_qwenimage_edit``: patch it to return ``(32, 32, None)`` to keep 32×32. CPU, fp32."""
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = tiny_qwen_tokenizer(list(words or TINY_VOCAB), edit=True)
    ids = vision_token_ids(tokenizer)
    vision = dict(patch_size=2, temporal_patch_size=1, merge_size=1, **EDIT_PIXELS)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vision),
    )
    base_vocab = tokenizer.convert_tokens_to_ids("<|im_end|>") + 1  # the text-to-image tokenizer's size
    modules = _tiny_modules(seed, tokenizer, num_layers, base_vocab, **ids)
    return QwenImageEditPipeline(processor=processor, **modules)
