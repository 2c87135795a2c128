"""The tokenizers and text encoders the tiny pipelines share: built in memory (no model hub, no files), seeded by the
caller (each factory only draws weights, in the order called).

Tokenizers, in each of which every word of :data:`TINY_VOCAB` (or the caller's ``words``) is one token, so different
prompts always encode differently:

- :func:`clip_tokenizer`: word-level CLIP BPE (:func:`flowrl.models.tokenizers.build_clip_tokenizer`), ids 0 BOS,
  1 EOS (= pad), ``model_max_length`` :data:`CLIP_MAX_LENGTH`;
- :func:`t5_tokenizer`: Unigram T5 (ids 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``, then ``▁word`` pieces and characters);
- :func:`gemma_tokenizer`: BPE ``GemmaTokenizer`` (:func:`gemma_vocab_and_merges`);
- :func:`qwen_tokenizer`: byte-level BPE ``Qwen2Tokenizer`` (:func:`qwen_vocab_and_merges`) with ``<|im_start|>`` /
  ``<|im_end|>`` (and the vision tokens, :data:`VISION_TOKENS`) special.

Text encoders: :func:`clip_text_encoder` (2 layers × 2 heads, projection = hidden), :func:`t5_encoder` (1 layer ×
2 heads × 8, gated GELU; ``umt5=True``: ``UMT5EncoderModel``), and for the decoder-only language models (Gemma 2/3,
Mistral, Qwen2.5-VL, Qwen3, Qwen3-VL) one text config, :func:`decoder_config` (2 heads, 1 key-value head,
intermediate = 2 × hidden, pad id 0), with :func:`qwen_vision_config` (a 1-block vision tower, patch 2, temporal
patch 1, merge 1, that text-to-image never runs) and :func:`qwen25vl_text_encoder`.
"""

from __future__ import annotations

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

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Qwen's text special tokens: id 0 of every :func:`qwen_vocab_and_merges` vocabulary, then the chat-turn markers."""
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen-VL's vision tokens."""


# CLIP


def clip_tokenizer(words=TINY_VOCAB, model_max_length: int = CLIP_MAX_LENGTH):
    """Word-level CLIP BPE tokenizer over ``words`` (ids 0 BOS, 1 EOS = pad)."""
    return build_clip_tokenizer(words, model_max_length=model_max_length)


def clip_text_config(vocab_size: int, hidden: int, projection: int, max_length: int = CLIP_MAX_LENGTH):
    """``CLIPTextConfig``: 2 layers × 2 heads, intermediate 2 × ``hidden``, special ids those of
    :func:`clip_tokenizer`."""
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


def clip_text_encoder(vocab_size: int, hidden: int, with_projection: bool = False):
    """``CLIPTextModel`` (``with_projection``: ``CLIPTextModelWithProjection``, as SD3's) of width ``hidden``
    (projection ``hidden`` too), positions for :data:`CLIP_MAX_LENGTH` tokens; in eval mode."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(clip_text_config(vocab_size, hidden, hidden, CLIP_MAX_LENGTH)).eval()


# T5


def t5_tokenizer(words=TINY_VOCAB, model_max_length: int = 16):
    """A Unigram T5 tokenizer: ids 0 = <pad>, 1 = </s>, 2 = <unk>, then ``▁word`` pieces and characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("▁" + w, -1.0) for w in sorted(set(words))]
    pieces += [("▁", -2.0)] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def t5_encoder(vocab_size: int, d_model: int, umt5: bool = False):
    """A 1-layer ``T5EncoderModel`` (``umt5``: ``UMT5EncoderModel``, as Wan's) of width ``d_model``: 2 heads × 8,
    gated-GELU feed-forward of 2 × ``d_model``, 8 relative-attention buckets, no dropout, special ids those of
    :func:`t5_tokenizer`; in eval mode."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model(
        config(
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
    ).eval()


# Gemma


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


def gemma_tokenizer(words=TINY_VOCAB, model_max_length: int = 16):
    """BPE ``GemmaTokenizer`` over ``words`` (:func:`gemma_vocab_and_merges`: ids 0 pad, 1 eos, 2 bos), adding BOS."""
    from transformers import GemmaTokenizer

    vocab, merges = gemma_vocab_and_merges(words)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, add_bos_token=True)


# Qwen (byte-level BPE) and the decoder-only language models


def qwen_vocab_and_merges(words, more=()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2 / Qwen2 style: ``Ġ`` marks a leading space) in which each of ``words`` is one
    token with and without the space: id 0 ``<|endoftext|>``, the 256 byte symbols, then every substring of
    every word (each split of a substring a merge, so a word always ends as one token). ``more`` (words, and
    ``<|…|>`` strings, one token each) follows in its order, leaving the ids and merges before it unchanged."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = [QWEN_SPECIAL_TOKENS[0], *sorted(ByteLevel.alphabet())]
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


def qwen_tokenizer(words, more=(), *, special, model_max_length: int, chat_template: str | None = None):
    """``Qwen2Tokenizer`` over :func:`qwen_vocab_and_merges` (``words``, then ``more``), the tokens ``special``
    added as additional special tokens, ``chat_template`` set when given."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocab_and_merges(words, more)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The ids a Qwen-VL config takes for its vision tokens (``image_token_id``, ``video_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id``), read from ``tokenizer``'s ``<|image_pad|>``, … tokens."""
    names = {"image": "image_pad", "video": "video_pad", "vision_start": "vision_start", "vision_end": "vision_end"}
    return {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for name, token in names.items()}


def decoder_config(vocab_size: int, hidden: int, num_layers: int, **overrides) -> dict:
    """The text config (keyword arguments) of a tiny decoder-only language model (Gemma, Mistral, Qwen): width
    ``hidden``, intermediate 2 × ``hidden``, ``num_layers`` layers × 2 heads, 1 key-value head, pad id 0;
    ``overrides`` (head_dim, positions, special ids, RoPE, …) replace or add to these."""
    config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
    )
    return {**config, **overrides}


def qwen_vision_config(out_hidden: int, **overrides) -> dict:
    """A Qwen-VL vision tower (keyword arguments): 1 block of width 16 × 2 heads, patch 2, temporal patch 1, merge 1,
    output width ``out_hidden`` (the language model's)."""
    return dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=out_hidden,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
        **overrides,
    )


def qwen25vl_text_encoder(
    vocab_size: int, hidden: int, num_layers: int, eos_token_id: int, mrope_section: list[int], **token_ids
):
    """``Qwen2_5_VLForConditionalGeneration``: a :func:`decoder_config` language model (2048 positions, no BOS,
    mRoPE ``mrope_section`` with θ 1e6) and a :func:`qwen_vision_config` tower with full attention; ``token_ids``
    (:func:`vision_token_ids`) into the config. In eval mode."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_config = decoder_config(
        vocab_size,
        hidden,
        num_layers,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(mrope_section)},
    )
    vision_config = qwen_vision_config(hidden, fullatt_block_indexes=[0])
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
    ).eval()
