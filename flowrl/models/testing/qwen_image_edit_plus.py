"""A tiny, fully offline ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit 2509 / 2511) with random weights, for tests
(as :mod:`flowrl.models.testing.qwen_image`).

``tiny_qwen_image_edit_plus_pipeline``: :func:`~flowrl.models.testing.qwen_image.tiny_qwen_image_edit_pipeline`'s
modules (same seed → same transformer, VAE, text encoder, tokenizer and ``Qwen2VLProcessor``: a 32×32 condition image is
256 vision tokens) in the Plus pipeline, whose user turn labels each image ``Picture i:`` (the label's pieces are byte
tokens of the tiny vocabulary; the template's first 64 tokens, the dropped ones, are the same system turn).
``zero_cond_t=True`` gives Qwen-Image-Edit-2511's transformer: the same weights with the source tokens modulated at
t = 0. The pipeline resizes each source to ``calculate_dimensions(384², ratio)`` for the vision encoder and
``calculate_dimensions(1024², ratio)`` for the VAE (module-level in ``pipeline_qwenimage_edit_plus``): patch it to
return ``(32, 32)`` to keep 32×32, and wrap the pipeline with ``height=32, width=32, condition_area=32 * 32``.
"""

from __future__ import annotations


def tiny_qwen_image_edit_plus_pipeline(
    seed: int = 0, words: list[str] | None = None, num_layers: int = 2, zero_cond_t: bool = False
):
    """A random-weight ``QwenImageEditPlusPipeline`` (module docstring); 32×32 px sources and outputs; CPU, fp32.
    ``zero_cond_t``: the 2511 transformer (the same weights as without)."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    from flowrl.models.testing.qwen_image import tiny_qwen_image_edit_pipeline

    components = dict(tiny_qwen_image_edit_pipeline(seed, words, num_layers).components)
    if zero_cond_t:
        base = components["transformer"]
        config = {k: v for k, v in base.config.items() if not k.startswith("_")}
        transformer = QwenImageTransformer2DModel(**{**config, "zero_cond_t": True}).eval()
        transformer.load_state_dict(base.state_dict())
        components["transformer"] = transformer
    return QwenImageEditPlusPipeline(**components)
