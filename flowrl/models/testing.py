"""Tiny, fully offline diffusers pipelines with random weights, for tests.

Both builders assemble real diffusers / transformers components from small configs (no model hub,
no files read), so every adapter code path runs exactly as it would on SD3/SD3.5 or FLUX.1, only
smaller. They ``save_pretrained`` and load back through :func:`flowrl.models.load_model`.

Sizes (defaults)
----------------
``tiny_sd3_pipeline``: 16×16 px images ↔ 4×8×8 latents (factor-2 VAE, channels (8, 8), no mid-block
attention), ``SD3Transformer2DModel`` with 2 layers × 2 heads × 8 (inner dim 16, patch 2 → 16 image
tokens, SD3.5-style RMS qk-norm and a dual-attention first layer; 24.6 k parameters), two CLIP text
encoders with projection (hidden = projection = 8 and 16, 2 layers → pooled 24; hidden states
zero-padded to 32), CLIP ``model_max_length`` 10 and, with ``with_t5=True``, a 1-layer T5 encoder
(d_model 32 = ``joint_attention_dim``). Scheduler shift 3.0 (static, as SD3). The adapter adds
``max_sequence_length`` (default 16) T5 tokens, zeros without T5, so the transformer sees 10 + 16
text tokens and 16 image tokens. A velocity at batch 16 takes about 10–20 ms on one CPU thread.

``tiny_flux_pipeline``: 16×16 px images ↔ 4×8×8 latents (factor-2 VAE without quant convs, as
FLUX's) packed 2×2 into 16 tokens of 16 channels; ``FluxTransformer2DModel`` with 1 double + 1 single
block × 2 heads × 8 (RoPE axes (2, 2, 4); 24.9 k parameters), guidance embedding on (as
FLUX.1-dev); CLIP text encoder (hidden 32 = pooled projection dim) and a 1-layer T5 (d_model 32).
Dynamic shifting as FLUX.1. FLUX pipelines default to 1024 px, so pass ``height=16, width=16`` to
the adapter.

``tiny_sana_pipeline``: 32×32 px images (``SanaPipeline`` needs multiples of 32) ↔ 4×8×8 latents
(factor-4 ``AutoencoderDC``: blocks (ResBlock, ResBlock, EfficientViTBlock) × 8 channels, scaling
0.41407, no shift), ``SanaTransformer2DModel`` with 2 layers × 2 heads × 8 (patch 1 → 64 image tokens,
cross-attention 2 × 8; 16.8 k parameters), a 1-layer ``Gemma2Model`` (hidden 16 = caption channels)
with an in-memory BPE ``GemmaTokenizer``, and SANA's scheduler (``DPMSolverMultistepScheduler`` with
flow sigmas, ``flow_shift`` 3; ``scheduler="euler"`` gives ``FlowMatchEulerDiscreteScheduler(shift=3)``).
Pass ``max_sequence_length`` (e.g. 8) to the adapter, and to the pipeline's own call
``use_resolution_binning=False`` and ``complex_human_instruction=None``.

Every word of :data:`TINY_VOCAB` is one CLIP token, one T5 token and one Gemma token, so different
prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.tokenizers import build_clip_tokenizer

TINY_VOCAB: list[str] = [
    "a",
    "an",
    "the",
    "photo",
    "of",
    "and",
    "on",
    "with",
    "left",
    "right",
    "above",
    "below",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "circle",
    "square",
    "triangle",
    "cat",
    "dog",
    "tree",
    "house",
    "car",
    "one",
    "two",
    "three",
    "small",
    "big",
]
"""Words of the tiny pipelines' tokenizers; each is exactly one token."""

CLIP_MAX_LENGTH = 10
"""``model_max_length`` of the tiny CLIP tokenizers (BOS + up to 8 words + EOS)."""


def _tiny_clip_tokenizer(words=TINY_VOCAB, model_max_length: int = CLIP_MAX_LENGTH):
    return build_clip_tokenizer(words, model_max_length=model_max_length)


def _tiny_t5_tokenizer(words=TINY_VOCAB, model_max_length: int = 16):
    """A Unigram T5 tokenizer: ids 0 = <pad>, 1 = </s>, 2 = <unk>, then ``▁word`` pieces and characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("▁" + w, -1.0) for w in sorted(set(words))]
    pieces += [("▁", -2.0)] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def _clip_text_config(vocab_size: int, hidden: int, projection: int, max_length: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=projection,
        hidden_act="quick_gelu",
        bos_token_id=0,
        eos_token_id=1,  # pooled output at the first EOS (the tokenizer's EOS id is 1)
        pad_token_id=1,
    )


def _tiny_t5_encoder(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def _tiny_vae(latent_channels: int, *, quant_convs: bool, scaling_factor: float, shift_factor: float):
    """Factor-2 ``AutoencoderKL`` (two blocks), channels (8, 8)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        mid_block_add_attention=False,
        use_quant_conv=quant_convs,
        use_post_quant_conv=quant_convs,
    ).eval()


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
    from transformers import CLIPTextModelWithProjection

    words = list(words or TINY_VOCAB)
    if sample_size % 2:
        raise ValueError(f"sample_size must be even (patch size 2); got {sample_size}")
    torch.manual_seed(seed)
    tokenizer = _tiny_clip_tokenizer(words)
    tokenizer_2 = _tiny_clip_tokenizer(words)
    vocab_size = len(tokenizer)
    # Two CLIPs of different widths (as CLIP-L 768 and CLIP-G 1280): hidden states 8 + 16 are
    # concatenated and zero-padded to the T5 width 32; pooled projections 8 + 16 → 24.
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(vocab_size, 8, 8, CLIP_MAX_LENGTH)).eval()
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(vocab_size, 16, 16, CLIP_MAX_LENGTH)).eval()
    joint_dim = 32  # > the two CLIP hidden sizes concatenated (8 + 16); = the T5 width
    if with_t5:
        tokenizer_3 = _tiny_t5_tokenizer(words)
        text_encoder_3 = _tiny_t5_encoder(len(tokenizer_3), joint_dim)
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
    vae = _tiny_vae(4, quant_convs=True, scaling_factor=1.5305, shift_factor=0.0609)
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


def tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True, words: list[str] | None = None):
    """A random-weight ``FluxPipeline`` (see the module docstring for sizes); use 16×16 px images.

    ``guidance_embeds=True`` mimics FLUX.1-dev (distilled guidance input), False FLUX.1-schnell.
    Returns the pipeline on CPU, fp32.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    words = list(words or TINY_VOCAB)
    torch.manual_seed(seed)
    tokenizer = _tiny_clip_tokenizer(words)
    text_encoder = CLIPTextModel(_clip_text_config(len(tokenizer), 32, 32, CLIP_MAX_LENGTH)).eval()
    tokenizer_2 = _tiny_t5_tokenizer(words)
    text_encoder_2 = _tiny_t5_encoder(len(tokenizer_2), 32)
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
    vae = _tiny_vae(4, quant_convs=False, scaling_factor=0.3611, shift_factor=0.1159)
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


def gemma_vocab_and_merges(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a BPE ``GemmaTokenizer`` in which each of ``words`` is one token, with and
    without the leading ``▁`` (Gemma replaces spaces by ``▁`` and does not split words apart): ids 0–4
    ``<pad> <eos> <bos> <unk> <mask>``, then ``▁``, characters and every substring of every word (each
    split of a substring is a merge, so every word always ends as one token)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"]
    seen, merges, merge_seen = set(tokens), [], set()

    def add(token: str) -> None:
        if token not in seen:
            seen.add(token)
            tokens.append(token)

    for c in sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz0123456789.,")):
        add(c)
    for word in sorted({w.lower() for w in words if w}):
        for full in (word, "▁" + word):
            for length in range(2, len(full) + 1):
                for i in range(len(full) - length + 1):
                    add(full[i : i + length])
                    for k in range(i + 1, i + length):
                        pair = (full[i:k], full[k : i + length])
                        if pair not in merge_seen:
                            merge_seen.add(pair)
                            merges.append(pair)
    return {t: i for i, t in enumerate(tokens)}, merges


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
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

    words = list(words or TINY_VOCAB)
    torch.manual_seed(seed)
    vocab, merges = gemma_vocab_and_merges(words)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=16, add_bos_token=True)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(vocab),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            attn_implementation="eager",
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
