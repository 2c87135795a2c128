"""Tiny, fully offline ``QwenImagePipeline`` / ``QwenImageEditPipeline`` with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_qwen_image_pipeline``: 32×32 px images ↔ 4×8×8 latents (``AutoencoderKLQwenImage``: base dim 8,
``dim_mult`` (1, 2, 2) → spatial factor 4, no temporal downsampling, per-channel ``latents_mean`` /
``latents_std``), packed 2×2 into 16 tokens of 16 channels; ``QwenImageTransformer2DModel`` with 2 blocks ×
2 heads × 16 (hidden 32, RoPE axes (4, 6, 6)); a 1-layer ``Qwen2_5_VLForConditionalGeneration`` (text hidden
32 = ``joint_attention_dim``, mRoPE sections (2, 3, 3); a 1-block vision tower with patch 2, temporal patch 1,
merge 1, that text-to-image never runs) with an in-memory byte-level BPE ``Qwen2Tokenizer``; the scheduler
configured as Qwen-Image's (dynamic shifting with an exponential time shift, ``shift_terminal`` 0.02). Pass
``height=32, width=32`` and a small ``max_sequence_length`` (e.g. 8) to the adapter and to the pipeline's own call.

The tokenizer (:func:`tiny_qwen_tokenizer`, also HunyuanImage's and Z-Image's) makes every word of
:data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` and of Qwen-Image's prompt template one token (with and
without a leading space), so the template's first 34 tokens — the ones the pipeline drops
(``prompt_template_encode_start_idx``) — are exactly its system turn and the user header, as with the real tokenizer.

``tiny_qwen_image_edit_pipeline``: the same modules (same seed → same transformer, VAE and text-encoder rows),
the tokenizer extended — after all its ids — by the words of the edit template (whose first 64 tokens, the
dropped ones, are again the system turn and ``<|im_start|>user\\n``) and
:data:`~flowrl.models.testing.text_encoders.VISION_TOKENS`, and a ``Qwen2VLProcessor`` matching the vision tower: a
32×32 source image is 16×16 patches of 2×2 px → 256 ``<|image_pad|>`` tokens (``max_pixels`` 32·32 caps any source
there; ``min_pixels`` 4·4).
"""

from __future__ import annotations

import re

import torch

from flowrl.models.testing.text_encoders import (
    QWEN_SPECIAL_TOKENS,
    TINY_VOCAB,
    VISION_TOKENS,
    qwen25vl_text_encoder,
    qwen_tokenizer,
    vision_token_ids,
)

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


def _words(template: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", re.sub(r"<\|\w+\|>", " ", template))


def tiny_qwen_tokenizer(words=TINY_VOCAB, edit: bool = False):
    """``Qwen2Tokenizer`` over ``words`` and the template's words, ``<|im_start|>`` / ``<|im_end|>`` special.
    ``edit``: then (same ids so far) the edit template's pieces and the vision tokens, special too."""
    special = QWEN_SPECIAL_TOKENS[1:]
    more = [*special, *sorted({*_words(EDIT_TEMPLATE), "(", "),", "'s"}), *VISION_TOKENS] if edit else ()
    return qwen_tokenizer(
        [*words, *_words(TEMPLATE)],
        more,
        special=special + (VISION_TOKENS if edit else []),
        model_max_length=2048 if edit else 1024 + 34,
    )


def _tiny_modules(seed: int, tokenizer, num_layers: int, vocab_size: int | None = None, **token_ids) -> dict:
    """Seeded text encoder (``vocab_size`` rows, the new ones appended last), transformer, VAE, scheduler."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = qwen25vl_text_encoder(
        vocab_size or len(tokenizer), 32, 1, eos_token_id=im_end, mrope_section=[2, 3, 3], **token_ids
    )  # head_dim 16
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
