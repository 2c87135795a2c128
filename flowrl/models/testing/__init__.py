"""Tiny, fully offline diffusers pipelines with random weights, for tests.

Each builder assembles real diffusers / transformers components from small configs (no model hub, no files read),
so every adapter code path runs exactly as it would on the full-size model, only smaller; ``seed`` fixes all
weights (two calls with the same arguments build identical pipelines), and the pipelines ``save_pretrained`` and
load back through :func:`flowrl.models.load_model`. One module per family (its docstring gives the sizes and what
to pass the adapter):

- :mod:`~flowrl.models.testing.sd3`: ``tiny_sd3_pipeline`` (SD3 / SD3.5);
- :mod:`~flowrl.models.testing.flux`: ``tiny_flux_pipeline`` (FLUX.1);
  :mod:`~flowrl.models.testing.flux_kontext`: ``tiny_flux_kontext_pipeline`` (FLUX.1 Kontext);
- :mod:`~flowrl.models.testing.flux2`: ``tiny_flux2_pipeline`` (FLUX.2);
  :mod:`~flowrl.models.testing.flux2_klein`: ``tiny_flux2_klein_pipeline`` (FLUX.2 [klein]);
- :mod:`~flowrl.models.testing.sana`: ``tiny_sana_pipeline``;
- :mod:`~flowrl.models.testing.qwen_image`: ``tiny_qwen_image_pipeline``, ``tiny_qwen_image_edit_pipeline`` (and
  ``tiny_qwen_tokenizer``, Qwen-Image's template tokenizer, also HunyuanImage's and Z-Image's);
  :mod:`~flowrl.models.testing.qwen_image_edit_plus`: ``tiny_qwen_image_edit_plus_pipeline`` (2509 / 2511);
  :mod:`~flowrl.models.testing.qwen_image21`: ``tiny_qwen_image21_pipeline`` (Qwen-Image 2.1);
- :mod:`~flowrl.models.testing.hunyuan_image`: ``tiny_hunyuan_image_pipeline`` (HunyuanImage 2.1);
- :mod:`~flowrl.models.testing.zimage`: ``tiny_zimage_pipeline`` (Z-Image / Turbo);
- :mod:`~flowrl.models.testing.wan`: ``tiny_wan_pipeline`` (Wan 2.1 / 2.2, text- and image-to-video);
- :mod:`~flowrl.models.testing.ltx2`: ``tiny_ltx2_pipeline`` (LTX-2).

They share :mod:`~flowrl.models.testing.text_encoders` (the word-level tokenizers, in which every word of
:data:`TINY_VOCAB` is one token, and the small CLIP, T5 and decoder-only text encoders) and
:mod:`~flowrl.models.testing.autoencoders` (the factor-2 ``AutoencoderKL``). This package re-exports the builders,
``TINY_VOCAB``, ``CLIP_MAX_LENGTH`` and ``gemma_vocab_and_merges``.
"""

from __future__ import annotations

from flowrl.models.testing.flux import tiny_flux_pipeline
from flowrl.models.testing.flux2 import tiny_flux2_pipeline
from flowrl.models.testing.flux2_klein import tiny_flux2_klein_pipeline
from flowrl.models.testing.flux_kontext import tiny_flux_kontext_pipeline
from flowrl.models.testing.hunyuan_image import tiny_hunyuan_image_pipeline
from flowrl.models.testing.ltx2 import tiny_ltx2_pipeline
from flowrl.models.testing.qwen_image import tiny_qwen_image_edit_pipeline, tiny_qwen_image_pipeline
from flowrl.models.testing.qwen_image21 import tiny_qwen_image21_pipeline
from flowrl.models.testing.qwen_image_edit_plus import tiny_qwen_image_edit_plus_pipeline
from flowrl.models.testing.sana import tiny_sana_pipeline
from flowrl.models.testing.sd3 import tiny_sd3_pipeline
from flowrl.models.testing.text_encoders import CLIP_MAX_LENGTH, TINY_VOCAB, gemma_vocab_and_merges, t5_tokenizer
from flowrl.models.testing.wan import tiny_wan_pipeline
from flowrl.models.testing.zimage import tiny_zimage_pipeline

_tiny_t5_tokenizer = t5_tokenizer  # its name before the package (flowrl.models.random_init imports it)

__all__ = [
    "CLIP_MAX_LENGTH",
    "TINY_VOCAB",
    "gemma_vocab_and_merges",
    "tiny_flux2_klein_pipeline",
    "tiny_flux2_pipeline",
    "tiny_flux_kontext_pipeline",
    "tiny_flux_pipeline",
    "tiny_hunyuan_image_pipeline",
    "tiny_ltx2_pipeline",
    "tiny_qwen_image21_pipeline",
    "tiny_qwen_image_edit_pipeline",
    "tiny_qwen_image_edit_plus_pipeline",
    "tiny_qwen_image_pipeline",
    "tiny_sana_pipeline",
    "tiny_sd3_pipeline",
    "tiny_wan_pipeline",
    "tiny_zimage_pipeline",
]
