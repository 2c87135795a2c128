"""`FlowModel` adapter for ``HunyuanImagePipeline`` (HunyuanImage 2.1, text to image; the refiner stage is refused).

Conventions, as ``HunyuanImagePipeline.__call__`` applies them:

- text: two encoders, as the pipeline's ``encode_prompt``: (1) the prompt in HunyuanImage's template (Qwen-Image's
  system line and user turn) through Qwen2.5-VL-7B, the hidden state ``hidden_state_skip_layer`` (2) layers before the
  last, the template's first 34 tokens dropped, padded by the tokenizer to ``max_sequence_length`` with
  ``prompt_embeds_mask`` (the pipeline's ``tokenizer_max_length``, 1000); (2) the text in quotes (the glyph text,
  ``extract_glyph_text``) through ByT5, padded to 128 tokens with its mask, or zeros with a zero mask when the prompt
  quotes nothing. Every prompt is the same length, so a cached row never depends on its batch; masked tokens are
  never attended to (the transformer puts the valid ones first).
- latents: ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor`` = 32, C = 64), one token per cell (``patch_size`` (1, 1));
  the transformer takes and returns them as they are.
- transformer timestep = σ·1000 in the transformer's dtype (the pipeline's ``t``); its output is the velocity.
- guidance: HunyuanImage 2.1 runs classifier-free guidance through its ``guider``
  (``AdaptiveProjectedMixGuidance``): ``guidance`` is its ``guidance_scale`` (3.5), ``[uncond; cond]`` in one
  forward, ``v_u + g·(v_c − v_u)``; the negative prompt is the pipeline's ``""``. The guider switches to adaptive
  projected guidance (APG) after step ``adaptive_projected_guidance_start_step`` (5), with a momentum over the
  steps: a velocity that depends on the previous steps, which no rollout plan or objective can replay, so the adapter
  keeps plain CFG at every step (the pipeline's own output for up to 6 steps; beyond, the guider's APG differs).
  A guidance-distilled transformer (``guidance_embeds``, no guider) takes ``guidance`` × 1000 as its embedding on
  every row (the pipeline's ``distilled_guidance_scale``, 3.25), never a CFG branch. HunyuanImage-2.1-Distilled's
  MeanFlow transformer (``use_meanflow``: its output depends on the next step's time) is refused.
- schedule: the pipeline's ``linspace(1, 0, steps + 1)[:-1]`` shifted by the scheduler (HunyuanImage 2.1: static
  shift 5), then 0.
- decode: ``latent / scaling_factor`` (no shift), the 32× VAE decoded, [-1, 1] → [0, 1].
- LoRA: ``HunyuanImagePipeline`` has no LoRA loader in diffusers; the adapter writes and reads diffusers' LoRA file
  of a single transformer (``pytorch_lora_weights.safetensors``, ``transformer.``-prefixed peft keys) through
  ``HunyuanVideoLoraLoaderMixin``'s file handling; a plain pipeline loads it with
  ``pipe.transformer.load_lora_adapter(folder, prefix="transformer")``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes
from flowrl.models.sd3 import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

HUNYUAN_SINGLE_BLOCKS = 40
"""Single-stream blocks of HunyuanImage 2.1: see HUNYUAN_IMAGE_LORA_TARGETS."""

HUNYUAN_IMAGE_LORA_TARGETS = [
    *SD3_LORA_TARGETS,  # double-stream attention (both streams) and the token refiner's attention
    "ff.net.0.proj",
    "ff.net.2",  # feed-forwards of the image stream (and of the token refiner)
    "ff_context.net.0.proj",
    "ff_context.net.2",  # the text stream's
    "proj_mlp",  # single-stream blocks' MLP input; their output Linear `proj_out` is named per block: the suffix
    # also names the transformer's final output layer
    *(f"single_transformer_blocks.{i}.proj_out" for i in range(HUNYUAN_SINGLE_BLOCKS)),
]

REFINER = "HunyuanImageRefinerPipeline"
REFINER_REFUSAL = (
    "HunyuanImage 2.1's refiner stage (HunyuanImageRefinerPipeline, hunyuanvideo-community/"
    "HunyuanImage-2.1-Refiner-Diffusers) is out of scope for model.family=hunyuan_image; accepted: the text-to-image "
    "HunyuanImage 2.1 (hunyuanvideo-community/HunyuanImage-2.1-Diffusers, a HunyuanImagePipeline), without a refiner"
)


def refuse_refiner(path: str | os.PathLike) -> None:
    """Raise a ValueError naming ``model.path`` when it is HunyuanImage 2.1's refiner: a hub id or folder named
    ``…Refiner…``, or a folder whose ``model_index.json`` names ``HunyuanImageRefinerPipeline``."""
    index = Path(path) / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    if name == REFINER or "refiner" in Path(str(path)).name.lower():
        raise ValueError(f"model.path={str(path)!r}: {REFINER_REFUSAL}")


class HunyuanImageFlowModel(FlowModel):
    """Adapter over a ``HunyuanImagePipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; both text encoders and the VAE frozen, all modules in eval mode; on
            CPU, unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``). A refiner
            pipeline or transformer is refused, so is a MeanFlow (step-distilled) transformer.
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: CFG scale (None → the pipeline guider's ``guidance_scale``, 3.5 for HunyuanImage 2.1; 1.0 without
            a guider); a guidance-distilled transformer's embedding value (None → 3.25).
        height, width: image size in pixels; None → 2048 (the pipeline's). Multiples of ``2 * vae_scale_factor``.
        max_sequence_length: Qwen2.5-VL tokens after the template (the pipeline's 1000); every prompt is padded to
            it with its mask, so a smaller value is faster when prompts are short.
        use_refiner: the original pipeline's switch; True is refused (the refiner stage is out of scope).
        negative_prompt: the unconditional prompt of CFG (the pipeline's "").
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "hunyuan_image"
    pipeline_class = "HunyuanImagePipeline"
    frozen = ("text_encoder", "text_encoder_2", "vae")
    default_lora_targets = HUNYUAN_IMAGE_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        guidance: float | None = None,
        max_sequence_length: int = 1000,
        use_refiner: bool = False,
        **options: Unpack[AdapterOptions],
    ):
        config = pipe.transformer.config
        if use_refiner:
            raise ValueError(f"model.kwargs.use_refiner={use_refiner!r}: {REFINER_REFUSAL}")
        if type(pipe).__name__ == REFINER or len(config.patch_size) != 2:
            raise ValueError(f"model.path holds a {type(pipe).__name__} (a 3-D patch transformer): {REFINER_REFUSAL}")
        if config.get("use_meanflow", False):
            raise ValueError(
                "model.path: HunyuanImage-2.1-Distilled's transformer (use_meanflow) predicts the mean velocity up to "
                "the next step's time (timestep_r), which no rollout plan or objective can replay; accepted: "
                "HunyuanImage 2.1 (hunyuanvideo-community/HunyuanImage-2.1-Diffusers)"
            )
        if not 1 <= int(max_sequence_length) <= 1000:
            raise ValueError(
                f"model.max_sequence_length={max_sequence_length}: must be in [1, 1000] for HunyuanImage (the "
                "pipeline's tokenizer_max_length)"
            )
        self.distilled = bool(config.guidance_embeds)
        if guidance is None:
            guidance = 3.25 if self.distilled else self._guider_scale(pipe)
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    @staticmethod
    def _guider_scale(pipe) -> float:
        """The CFG scale of the pipeline's guider in flowrl's form (``v_u + g·(v_c − v_u)``): its
        ``guidance_scale`` (+1 with ``use_original_formulation``); 1.0 without an enabled guider."""
        guider = getattr(pipe, "guider", None)
        if guider is None or not guider.config.get("enabled", True):
            return 1.0
        return float(guider.config.guidance_scale) + (1.0 if guider.config.get("use_original_formulation") else 0.0)

    @classmethod
    def from_pretrained(cls, path, *, dtype=torch.float32, pipeline_kwargs=None, **kw):
        """:meth:`FlowModel.from_pretrained` after :func:`refuse_refiner` (before anything is loaded)."""
        refuse_refiner(path)
        return super().from_pretrained(path, dtype=dtype, pipeline_kwargs=pipeline_kwargs, **kw)

    def _size_rule(self) -> tuple[int, int, str]:
        """``default_sample_size`` latent cells (2048 px); multiples of 2 × vae_scale_factor (the pipeline's)."""
        return self.pipe.default_sample_size * self.vae_scale_factor, 2 * self.vae_scale_factor, "2 × vae_scale_factor"

    @property
    def image_seq_len(self) -> int:
        """Image tokens: one per latent cell of its (1, 1) patches."""
        ph, pw = self.pipe.transformer.config.patch_size
        _, h, w = self.latent_shape
        return (h // ph) * (w // pw)

    def _schedule_sigmas(self, steps: int):
        """The pipeline's ``linspace(1, 0, steps + 1)[:-1]``."""
        return np.linspace(1.0, 0.0, steps + 1)[:-1]

    def uses_cfg(self, guidance: float | None = None) -> bool:
        """CFG when the guidance ≠ 1; never for a guidance-distilled transformer (its guidance is an embedding)."""
        return not self.distilled and super().uses_cfg(guidance)

    # ---- contract ------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] and ``prompt_embeds_mask`` [1, L] (L = ``max_sequence_length``), the glyph
        text's ``prompt_embeds_2`` [1, 128, D2] and ``prompt_embeds_mask_2`` [1, 128] (zeros without quoted text)."""
        pipe = self.pipe
        embeds, mask = pipe._get_qwen_prompt_embeds(
            pipe.tokenizer,
            pipe.text_encoder,
            [prompt],
            device=self.device,
            tokenizer_max_length=self.max_sequence_length,
            template=pipe.prompt_template_encode,
            drop_idx=pipe.prompt_template_encode_start_idx,
        )
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(
            [prompt], device=self.device, prompt_embeds=embeds, prompt_embeds_mask=mask
        )
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": embeds_2,
            "prompt_embeds_mask_2": mask_2,
        }

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, h, w]) of latents ``x`` [B, C, h, w] at ``sigma`` ([B] or a scalar).

        guidance g (None → ``self.guidance``): CFG g ≠ 1 runs ``[uncond; cond]`` in one transformer call and returns
        ``v_u + g·(v_c − v_u)``; a guidance-distilled transformer gets g·1000 as its embedding, one row each."""
        g, cfg = self._cfg_of(cond, guidance)
        sigma = self._check_inputs(x, sigma, cond)
        text = self._cfg_text(cond, cfg)
        rows = 2 if cfg else 1
        timestep = (sigma * 1000).repeat(rows).to(self.dtype)  # the pipeline's t, in the latents' (model) dtype
        kwargs = {name: value.to(self.device) for name, value in text.items()}
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=x.to(device=self.device, dtype=self.dtype).repeat(rows, 1, 1, 1),
                timestep=timestep,
                encoder_hidden_states=kwargs["prompt_embeds"].to(self.dtype),
                encoder_attention_mask=kwargs["prompt_embeds_mask"],
                encoder_hidden_states_2=kwargs["prompt_embeds_2"].to(self.dtype),
                encoder_attention_mask_2=kwargs["prompt_embeds_mask_2"],
                guidance=torch.full_like(timestep, g * 1000.0) if self.distilled else None,
                return_dict=False,
            )[0]
        out = out.float()
        return self._cfg_combine(out, g) if cfg else out

    # ---- LoRA files (the pipeline has no LoRA loader of its own) ---------------------------------------------
    @contextlib.contextmanager
    def _lora_files(self) -> Iterator[None]:
        """Within it ``self.pipe`` is :class:`TransformerLoraFiles` over the same transformer: what
        :class:`~flowrl.models.lora.LoraAdapter` calls on the pipeline (``save_lora_weights``, ``lora_state_dict``,
        ``load_lora_weights``) reads and writes diffusers' single-transformer LoRA file."""
        pipe = self.pipe
        self.pipe = TransformerLoraFiles(pipe.transformer)
        try:
            yield
        finally:
            self.pipe = pipe

    def save_lora(self, directory, layers: dict | None = None) -> None:
        """:meth:`LoraAdapter.save_lora` in diffusers' single-transformer LoRA file (module docstring)."""
        with self._lora_files():
            super().save_lora(directory, layers)

    def load_lora(self, directory) -> None:
        """:meth:`LoraAdapter.load_lora` from diffusers' single-transformer LoRA file (module docstring)."""
        with self._lora_files():
            super().load_lora(directory)


@functools.cache
def _lora_files_class() -> type:
    """:class:`TransformerLoraFiles`'s class, made on first use (diffusers is imported then, not with this module)."""
    from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

    class TransformerLoraFiles(HunyuanVideoLoraLoaderMixin):
        """diffusers' LoRA file of a single transformer (``HunyuanVideoLoraLoaderMixin``'s: ``transformer.``-prefixed
        keys; a diffusers-format file is read as it is) over ``transformer``, for a pipeline without a LoRA loader."""

        hf_device_map = None  # what diffusers' LoRA loading asks of a pipeline: no device map, its components

        def __init__(self, transformer):
            self.transformer = transformer
            self.components = {"transformer": transformer}

    return TransformerLoraFiles


def TransformerLoraFiles(transformer):  # noqa: N802 — builds an instance of the class above
    """The LoRA files of ``transformer`` (:func:`_lora_files_class`): ``save_lora_weights``, ``lora_state_dict`` and
    ``load_lora_weights`` as a diffusers pipeline has them."""
    return _lora_files_class()(transformer)


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, C, h, w], ``timestep`` [B] fp32,
    ``encoder_hidden_states`` [B, L, text_embed_dim], ``encoder_attention_mask`` [B, L] int64."""
    L, meta = shapes.text_tokens, {"device": "meta"}
    return {
        "hidden_states": torch.empty(rows, *shapes.latent, dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["text_embed_dim"], dtype=dtype, **meta),
        "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta),
    }


# guidance None → the guider's guidance_scale, 3.5 for HunyuanImage 2.1
HunyuanImageFlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs, token_patch=2, masked_text=True, text_limit=1000, defaults={"guidance": 3.5}
)
