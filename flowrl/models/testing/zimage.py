"""A tiny, fully offline ``ZImagePipeline`` (Z-Image / Z-Image-Turbo) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_zimage_pipeline``: 16×16 px images ↔ 4×8×8 VAE latents (``AutoencoderKL`` of FLUX.1's kind: factor 2,
channels (8, 8), no mid attention, scaling 0.3611 and shift 0.1159 as Z-Image's), which the transformer cuts into
2×2 patches: 16 image tokens; ``ZImageTransformer2DModel`` with 1 main layer and 1 noise + 1 context refiner layer ×
2 heads × 16 (dim 32, RoPE axes (4, 6, 6)); a 2-layer ``Qwen3Model`` of width 16 (the pipeline takes the hidden
state before the last layer) with an in-memory byte-level BPE ``Qwen2Tokenizer`` whose chat template renders a user
turn and the assistant header as Qwen3's does with ``enable_thinking=True``; the scheduler configured as
Z-Image-Turbo's (static shift 3; ``shift=6.0`` gives Z-Image's). Pass ``height=16, width=16`` and a small
``max_sequence_length`` (e.g. 16: the template takes 5 tokens) to the adapter and to the pipeline's own call.

Every word of :data:`~flowrl.models.testing.text_encoders.TINY_VOCAB` is one token (with and without a leading space),
so different prompts always encode differently.
"""

from __future__ import annotations

import torch

from flowrl.models.testing.autoencoders import kl_vae
from flowrl.models.testing.qwen_image import tiny_qwen_tokenizer
from flowrl.models.testing.text_encoders import TINY_VOCAB, decoder_config

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat template reduced to what ``ZImagePipeline`` renders (a user turn, the generation prompt)."""


def tiny_zimage_pipeline(seed: int = 0, shift: float = 3.0, words: list[str] | None = None):
    """A random-weight ``ZImagePipeline`` (module docstring for sizes); 16×16 px images. ``seed`` fixes all weights
    (the transformer's zero-initialised pad tokens and final layer drawn too): two calls with the same arguments
    build identical pipelines. ``shift``: the scheduler's static shift (3: Turbo's, 6: Z-Image's). CPU, fp32."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(list(words or TINY_VOCAB))
    tokenizer.chat_template = CHAT_TEMPLATE
    text_encoder = Qwen3Model(
        Qwen3Config(**decoder_config(len(tokenizer), 16, 2, head_dim=8, max_position_embeddings=1024))
    ).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],
    ).eval()
    with torch.no_grad():  # a trained model's: the pad tokens and the zero-initialised output layer are not zero
        for name, param in transformer.named_parameters():
            if param.abs().sum() == 0:
                param.copy_(torch.randn_like(param) * 0.1)
    vae = kl_vae(4, quant_convs=False, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=False, shift=shift)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
