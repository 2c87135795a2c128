"""A tiny, fully offline ``Flux2KleinPipeline`` (FLUX.2 [klein]) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_flux2_klein_pipeline``: the transformer, VAE and scheduler of
:func:`~flowrl.models.testing.flux2.tiny_flux2_pipeline` without its guidance embedding (FLUX.2 [klein]'s
transformers have none): 16×16 px images ↔ the VAE's 4×8×8 latents patchified 2×2 into the pipeline's 16×4×4
latents = 16 tokens of 16 channels, 1 double + 1 single block × 2 heads × 8, random batch-norm statistics; a
27-layer ``Qwen3ForCausalLM`` of width 16 (the pipeline stacks hidden states 9, 18 and 27: text width 48 =
``joint_attention_dim``) with a byte-level BPE ``Qwen2Tokenizer`` and a chat template of Qwen3's shape
(``<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n``, then ``<think>\\n\\n</think>\\n\\n`` when thinking is
off, as the pipeline asks). ``is_distilled`` is the pipeline's flag: True (FLUX.2-klein-4B, step-distilled: no CFG),
False (the Base models: CFG against the empty prompt). Pass ``height=16, width=16`` and a small
``max_sequence_length`` (e.g. 20: the template takes 12 tokens besides the prompt's words) to the adapter and to the
pipeline's own call.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one token (with and without a leading space),
so different prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.flux2 import tiny_flux2_pipeline
from flowrl.models.testing.text_encoders import TINY_VOCAB, decoder_config, qwen_tokenizer

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
"""Qwen3's chat template, reduced to what ``Flux2KleinPipeline`` renders (one user turn, thinking off)."""


def tiny_qwen3_tokenizer(words=TINY_VOCAB):
    """``Qwen2Tokenizer`` over ``words`` and the template's ``user``, ``assistant`` and ``\\n\\n`` (one token, as in
    Qwen3's vocabulary; id 0 ``<|endoftext|>``, also the padding), :data:`SPECIAL_TOKENS` special, :data:`CHAT_TEMPLATE`
    as its chat template."""
    return qwen_tokenizer(  # Ċ: the byte-level symbol of \n
        [*words, "user", "assistant", "ĊĊ"], special=SPECIAL_TOKENS, model_max_length=1024, chat_template=CHAT_TEMPLATE
    )


def tiny_flux2_klein_pipeline(seed: int = 0, is_distilled: bool = True, words: list[str] | None = None):
    """A random-weight ``Flux2KleinPipeline`` (module docstring for sizes); 16×16 px images. ``seed`` fixes all
    weights and the VAE's batch-norm statistics: two calls with the same arguments build identical pipelines.
    Returns it on CPU, fp32."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base = tiny_flux2_pipeline(seed, guidance_embeds=False, words=words)
    tokenizer = tiny_qwen3_tokenizer(list(words or TINY_VOCAB))
    torch.manual_seed(seed + 1)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            **decoder_config(
                len(tokenizer),
                16,
                27,
                head_dim=8,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
                bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            )
        )
    ).eval()
    return Flux2KleinPipeline(
        scheduler=base.scheduler,
        vae=base.vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=base.transformer,
        is_distilled=is_distilled,
    )
