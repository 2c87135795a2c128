"""A tiny, fully offline ``Flux2Pipeline`` (FLUX.2) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_flux2_pipeline``: 16×16 px images ↔ 4×8×8 VAE latents (``AutoencoderKLFlux2``: factor 2, channels (8, 8), no
mid attention; batch-norm statistics over the 16 patchified channels set to random values, so undoing them matters),
patchified 2×2 into the pipeline's 16×4×4 latents = 16 tokens of 16 channels; ``Flux2Transformer2DModel`` with 1
double + 1 single block × 2 heads × 8 (RoPE axes (2, 2, 2, 2)), guidance embedding on (as FLUX.2-dev); a
``Mistral3ForConditionalGeneration`` with a 30-layer Mistral text model of width 16 (the pipeline stacks hidden
states 10, 20 and 30: text width 48 = ``joint_attention_dim``; a 1-layer Pixtral vision tower that text-to-image
never runs) and a ``PixtralProcessor`` around an in-memory byte-level BPE with Mistral's control tokens and a chat
template of Mistral Small 3.1's shape (``<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]``); the scheduler
configured as FLUX.2-dev's (dynamic shifting; the pipeline sets ``mu`` itself). Pass ``height=16, width=16`` and
a small ``max_sequence_length`` (e.g. 40: the system message takes 30 tokens) to the adapter and to the
pipeline's own call.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` and of the pipeline's system message is one
token (with and without a leading space), so different prompts always encode differently.
"""

from __future__ import annotations

import re

import torch

from flowrl.models.testing.text_encoders import TINY_VOCAB, decoder_config, qwen_vocab_and_merges

SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "<pad>",
]
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'][0]['text'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{{- '[/INST]' }}{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}{%- endfor %}"
)
"""Mistral Small 3.1's chat template, reduced to what ``Flux2Pipeline`` renders (system message, user text)."""


def tiny_mistral_processor(words=TINY_VOCAB):
    """``PixtralProcessor`` (PIL image processor, patch 2) around a byte-level BPE ``TokenizersBackend`` over
    ``words`` and the words of FLUX.2's system message: ids 0–10 :data:`SPECIAL_TOKENS`, then the byte symbols and
    every word's substrings (:func:`~flowrl.models.testing.text_encoders.qwen_vocab_and_merges`)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralProcessor, TokenizersBackend
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    vocab, merges = qwen_vocab_and_merges([*words, *re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)])
    vocab = {token: i + len(SPECIAL_TOKENS) - 1 for token, i in vocab.items() if i}  # id 0 is Qwen's <|endoftext|>
    vocab.update({token: i for i, token in enumerate(SPECIAL_TOKENS)})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = TokenizersBackend(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessorPil(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        patch_size=2,
        spatial_merge_size=1,
    )


def tiny_flux2_pipeline(seed: int = 0, guidance_embeds: bool = True, words: list[str] | None = None):
    """A random-weight ``Flux2Pipeline`` (module docstring for sizes); 16×16 px images. ``seed`` fixes all weights
    and the VAE's batch-norm statistics: two calls with the same arguments build identical pipelines. Returns it on
    CPU, fp32."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    processor = tiny_mistral_processor(list(words or TINY_VOCAB))
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=decoder_config(
                len(processor.tokenizer),
                16,
                30,
                head_dim=8,
                max_position_embeddings=1024,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=10,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=8,
                patch_size=2,
                image_size=16,
            ),
            image_token_index=SPECIAL_TOKENS.index("[IMG]"),
            spatial_merge_size=1,
        )
    ).eval()
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=guidance_embeds,
    ).eval()
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        mid_block_add_attention=False,
    ).eval()
    with torch.no_grad():  # latent statistics of a trained VAE (FLUX.2's are per patchified channel)
        vae.bn.running_mean.copy_(torch.randn(16) * 0.5)
        vae.bn.running_var.copy_(torch.rand(16) * 3 + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2-dev's scheduler_config.json
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    return Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor, transformer=transformer
    )
