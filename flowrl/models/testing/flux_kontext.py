"""A tiny, fully offline ``FluxKontextPipeline`` (FLUX.1 Kontext) with random weights, for tests (as
:mod:`flowrl.models.testing.sd3`).

``tiny_flux_kontext_pipeline``: the modules of :func:`~flowrl.models.testing.flux.tiny_flux_pipeline` (same seed → the
same weights): 16×16 px images ↔ 4×8×8 latents packed 2×2 into 16 tokens of 16 channels, a source image of the same
size as 16 more tokens; the FLUX.1 transformer with 1 double + 1 single block, guidance embedding on (as FLUX.1
Kontext [dev]); CLIP (pooled) and a 1-layer T5 (at most 16 tokens). Pass ``height=16, width=16`` (and
``max_sequence_length`` ≤ 16) to the adapter; to the pipeline's own call also ``max_area=16 * 16`` (it otherwise
generates about 1024² pixels) and ``_auto_resize=False`` (it otherwise resizes the source to a preferred Kontext
resolution).
"""

from __future__ import annotations

from flowrl.models.testing.flux import tiny_flux_pipeline


def tiny_flux_kontext_pipeline(seed: int = 0, guidance_embeds: bool = True, words: list[str] | None = None):
    """A random-weight ``FluxKontextPipeline`` (module docstring for sizes); 16×16 px images. ``seed`` fixes all
    weights: two calls with the same arguments build identical pipelines. Returns it on CPU, fp32."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_pipeline(seed, guidance_embeds=guidance_embeds, words=words).components)
