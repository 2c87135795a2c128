"""`FlowModel` adapter for ``WanPipeline`` (Wan 2.1 text-to-video and fine-tunes with its layout).

Conventions, as ``WanPipeline.__call__`` applies them:

- latents are videos: the adapter takes and returns ``[B, C, F, h, w]`` (C = the transformer's ``in_channels``, 16;
  F = (``num_frames`` − 1) / t + 1 latent frames with the VAE's temporal factor t = 4, the first frame alone in the
  first latent frame; h, w = height, width / 8). :attr:`WanFlowModel.latent_shape` is (C, F, h, w) and
  :meth:`FlowModel.noise` draws that shape from each seed (the pipeline's ``prepare_latents`` with the same
  generator gives the same numbers). ``num_frames`` − 1 must be a multiple of t (checked at construction: the
  pipeline would silently round it).
- text: the pipeline's own ``encode_prompt`` (cleaned prompt, UMT5 last hidden state cut to the prompt's tokens
  and zero-padded to ``max_sequence_length``, 512 as in the pipeline's call), one prompt at a time; the transformer
  attends to the zero rows too, as in the pipeline, so every row has the same length and a prompt's embedding never
  depends on its batch companions.
- transformer timestep = σ · ``num_train_timesteps`` (1000), as a float; with Wan 2.2 TI2V's ``expand_timesteps`` one
  per latent token. ``FlowMatchEulerDiscreteScheduler`` gives the pipeline exactly these timesteps;
  ``UniPCMultistepScheduler`` (Wan 2.1's own) gives them truncated to integers, which the adapter does not copy (its
  velocity is a smooth function of σ, as every SDE kernel of flowrl assumes).
- CFG: ``guidance`` is the pipeline's ``guidance_scale`` (5.0) against ``negative_prompt`` (the pipeline's default
  ``""``); ``guidance`` ≠ 1 runs ``[uncond; cond]`` in one forward and returns ``v_u + g·(v_c − v_u)``, the
  pipeline's combination of its two calls.
- schedule: the pipeline's scheduler's own ``set_timesteps(steps)`` on a fresh copy (:meth:`FlowModel.schedule`):
  UniPC's flow sigmas shifted by ``flow_shift`` (its first σ, nudged to 1 − 1e-6, put back to 1 for the SDE
  kernels), or flow-match Euler's shifted by ``shift``; then 0.
- decode: per-channel ``latents_std`` / ``latents_mean`` of the VAE config undone, the causal video VAE decoded,
  [-1, 1] → [0, 1]; :meth:`WanFlowModel.decode_video` (and :meth:`WanFlowModel.decode`, so a caller gets the video)
  returns ``[B, 4(F − 1) + 1, 3, H, W]``, the layout of the pipeline's ``output_type="pt"``.

Wan 2.2 A14B's two experts (``transformer_2`` and ``boundary_ratio``: ``transformer`` denoises timesteps
t ≥ ``boundary_ratio`` · 1000, ``transformer_2`` the rest, as ``WanPipeline.__call__`` switches): the adapter's
:attr:`~WanFlowModel.trainable` is :class:`WanExperts`, both experts as one module, which runs each row on its
expert; CFG scales each row by its expert's scale (``guidance`` for the high-noise expert, ``guidance_2`` — the
pipeline's ``guidance_scale_2``, default ``guidance`` — for the low-noise one). ``experts`` (``model.experts``:
``high``, ``low`` or ``both``, default ``both``) chooses which expert trains: LoRA on it (on each with ``both``), the
other frozen. The LoRA is written in diffusers' Wan layout, one file per expert: the high-noise expert's in the
folder (``pipe.load_lora_weights(folder)``), the low-noise expert's in ``folder/transformer_2``
(``pipe.load_lora_weights(folder + "/transformer_2", load_into_transformer_2=True)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.module_group import adapter_state
from flowrl.models.qwen_image import QwenImageFlowModel
from flowrl.models.wan_estimate import WAN_ESTIMATE
from flowrl.models.wan_experts import EXPERTS, WanExperts

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

WAN_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",  # self-attention (attn1) and text cross-attention (attn2) of every block
    "add_k_proj",
    "add_v_proj",  # image cross-attention of the I2V transformers (absent from text-to-video ones)
    "ffn.net.0.proj",
    "ffn.net.2",  # feed-forward
]
"""``model.experts`` → the pipeline components it trains (``transformer``: the high-noise expert)."""
LOW_NOISE_FOLDER = "transformer_2"  # the low-noise expert's LoRA file, inside the LoRA folder


class WanFlowModel(FlowModel):
    """Adapter over a ``WanPipeline``.

    Args (``pipe``, ``device``, ``dtype``, ``gradient_checkpointing``: as for every adapter, see
    :meth:`FlowModel._init_pipeline`):
        guidance: CFG scale (the pipeline's ``guidance_scale``, 5.0); 1.0 = no CFG, no uncond forward.
        height, width: frame size in pixels; None → the pipeline's 480 × 832. Multiples of the VAE's spatial factor
            × the transformer's patch (16).
        num_frames: video frames (the pipeline's 81); ``num_frames`` − 1 must be a multiple of the VAE's temporal
            factor (4): 1, 5, 9, …, 81.
        max_sequence_length: UMT5 tokens (the pipeline's 512); every prompt is zero-padded to it.
        negative_prompt: the unconditional prompt of CFG (the pipeline's default ``""``).
        guidance_2: a two-expert pipeline's CFG scale of the low-noise expert (the pipeline's ``guidance_scale_2``);
            None → ``guidance``.
        experts: a two-expert pipeline's trained experts: ``"high"``, ``"low"`` or ``"both"`` (None → both).
    """

    modality = "video"
    _experts: WanExperts | None = None
    """A two-expert pipeline's :class:`WanExperts` (set by ``_init_experts``), else None."""

    family = "wan"
    pipeline_class = "WanPipeline"
    default_lora_targets = WAN_LORA_TARGETS
    _vae_scale_shift = QwenImageFlowModel._vae_scale_shift  # (1 / latents_std, latents_mean) [1, C, 1, 1, 1]

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 5.0,
        num_frames: int = 81,
        max_sequence_length: int = 512,
        guidance_2: float | None = None,
        experts: str | None = None,
        **options: Unpack[AdapterOptions],
    ):
        two = self._two_experts(pipe)
        if not two and (experts is not None or guidance_2 is not None):
            raise ValueError(
                f"model.experts / guidance_2 apply to two-expert Wan 2.2 pipelines (transformer_2 and "
                f"boundary_ratio); {type(pipe).__name__} has one transformer: leave them unset "
                f"(got experts={experts!r}, guidance_2={guidance_2!r})"
            )
        if two and (experts if experts is not None else "both") not in EXPERTS:
            raise ValueError(f"model.experts must be one of {', '.join(EXPERTS)}; got {experts!r}")
        temporal = pipe.vae_scale_factor_temporal
        frames = int(num_frames) if not isinstance(num_frames, bool) else 0
        if frames != num_frames or frames < 1 or (frames - 1) % temporal:
            raise ValueError(
                f"num_frames (model.kwargs.num_frames) must be {temporal}·k + 1 — 1, {temporal + 1}, "
                f"{2 * temporal + 1}, …, 81 — as the VAE compresses {temporal} frames into each latent "
                f"frame after the first; got {num_frames!r}"
            )
        if int(max_sequence_length) < 1:
            raise ValueError(f"max_sequence_length must be ≥ 1; got {max_sequence_length}")
        self.vae_scale_factor_temporal = temporal
        self.num_frames = frames
        options = {**options, "height": options.get("height") or 480, "width": options.get("width") or 832}
        self._init_adapter(pipe, guidance, max_sequence_length, **options)
        self.guidance_2 = float(guidance if guidance_2 is None else guidance_2)
        if two:
            self._init_experts(pipe, EXPERTS[experts or "both"], bool(options.get("gradient_checkpointing")))

    @staticmethod
    def _two_experts(pipe) -> bool:
        """Whether ``pipe`` is a two-expert Wan 2.2 pipeline (``transformer_2`` and ``boundary_ratio`` both set)."""
        ratio, second = pipe.config.get("boundary_ratio"), getattr(pipe, "transformer_2", None)
        if (ratio is None) != (second is None):
            raise ValueError(
                "a two-expert Wan pipeline needs both transformer_2 and boundary_ratio; got "
                f"transformer_2={'set' if second is not None else None}, boundary_ratio={ratio!r}"
            )
        return second is not None

    def _init_experts(self, pipe, trained: tuple[str, ...], gradient_checkpointing: bool) -> None:
        """The low-noise expert placed as ``_init_pipeline`` places the transformer; both wrapped in
        :class:`WanExperts` with the pipeline's boundary timestep."""
        from flowrl.models.dtypes import cast_module
        from flowrl.models.setup import align_cpu_tensors

        second = pipe.transformer_2
        if second.dtype != self.dtype:
            cast_module(second, self.dtype)
        align_cpu_tensors(second)
        second.eval()
        if gradient_checkpointing:
            second.enable_gradient_checkpointing()
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        self._experts = WanExperts(pipe.transformer, second, boundary, trained)

    @property
    def experts(self) -> WanExperts | None:
        """Both experts of a two-expert pipeline as one module, else None."""
        return self._experts

    @property
    def trainable(self) -> nn.Module:
        """``pipe.transformer``; a two-expert pipeline's :class:`WanExperts` (a frozen copy of it while an objective
        has swapped one into ``pipe.transformer``)."""
        experts, current = self.experts, self.pipe.transformer
        return current if experts is None or isinstance(current, WanExperts) else experts

    def _scales(self, guidance: float | None) -> tuple[float, float]:
        """(high-noise, low-noise) CFG scales of a call: ``guidance`` (None → :attr:`guidance`) and, at the model's own
        guidance, :attr:`guidance_2` for the low-noise expert (another guidance applies to both)."""
        g = self.guidance_or_default(guidance)
        return g, (self.guidance_2 if self.experts is not None and g == self.guidance else g)

    def uses_cfg(self, guidance: float | None = None) -> bool:
        """CFG when either expert's scale is not 1."""
        return any(s != 1.0 for s in self._scales(guidance))

    def _latent_scale(self, pipe) -> int:
        """Pixels per latent cell: the VAE's spatial factor (Wan names its factors per axis)."""
        return pipe.vae_scale_factor_spatial

    def _size_rule(self) -> tuple[int, int, str]:
        """480 × 832 by default (set in ``__init__``); whole spatial patches."""
        _, patch_h, patch_w = self.patch_size
        return (
            0,
            self.vae_scale_factor * max(patch_h, patch_w),
            "the VAE's spatial factor × the transformer's patch size",
        )

    # ---- video latents ---------------------------------------------------------------------------------
    @property
    def patch_size(self) -> tuple[int, int, int]:
        """The transformer's (frames, height, width) patch: (1, 2, 2) for Wan."""
        return tuple(self.pipe.transformer.config.patch_size)

    @property
    def latent_frames(self) -> int:
        """F = (``num_frames`` − 1) / the VAE's temporal factor + 1."""
        return (self.num_frames - 1) // self.vae_scale_factor_temporal + 1

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, h, w) of one latent video (C = the transformer's ``in_channels``; h, w = height, width / 8)."""
        return (
            self.latent_channels,
            self.latent_frames,
            self.height // self.vae_scale_factor,
            self.width // self.vae_scale_factor,
        )

    @property
    def image_seq_len(self) -> int:
        """Video tokens the transformer sees: (F/p_t)·(h/p_h)·(w/p_w)."""
        _, frames, h, w = self.latent_shape
        p_t, p_h, p_w = self.patch_size
        return (frames // p_t) * (h // p_h) * (w // p_w)

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 (CPU), 1 → 0: the pipeline scheduler's own (:meth:`FlowModel.schedule`), with
        UniPC's first σ, 1 − 1e-6 (nudged there only to keep its log-SNR finite), put back to 1: the SDE kernels
        start from σ = 1 (Flow-GRPO's first-step case)."""
        sigmas = super().schedule(steps)
        if 0 < 1 - sigmas[0] < 1e-5:
            sigmas[0] = 1.0
        return sigmas

    def decode_video(self, x0: torch.Tensor) -> torch.Tensor:
        """Videos [B, num_frames, 3, H, W] fp32 in [0, 1] from latents [B, C, F, h, w]: :meth:`FlowModel.decode`
        (latents_std / latents_mean undone, the video VAE, [-1, 1] → [0, 1]) with frames before channels, as the
        pipeline's ``output_type="pt"``."""
        return super().decode(x0).transpose(1, 2)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """The video, [B, num_frames, 3, H, W] (:meth:`decode_video`): a video family decodes to videos; image
        rewards need a frame reduction first (not part of this adapter)."""
        return self.decode_video(x0)

    # ---- contract ------------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D], L = ``max_sequence_length``: the pipeline's UMT5 embedding, zero-padded."""
        embeds, _ = self.pipe.encode_prompt(
            [prompt],
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, F, h, w]) of latents ``x`` [B, C, F, h, w] at ``sigma`` ([B] or a
        scalar). guidance g (None → ``self.guidance``): CFG runs ``[uncond; cond]`` in one transformer call and
        returns ``v_u + s·(v_c − v_u)``, s = g (two experts: each row its expert's scale, :meth:`_scales`); without
        CFG the conditional velocity."""
        _, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond) * self.pipe.scheduler.config.num_train_timesteps
        rows = 2 if cfg else 1  # [uncond; cond] in one forward
        text = {k: v.to(device=self.device) for k, v in self._cfg_text(cond, cfg).items()}
        t = timestep.repeat(rows)
        if self.pipe.config.get("expand_timesteps", False):  # Wan 2.2 TI2V: one timestep per latent token
            t = t[:, None].expand(-1, self.image_seq_len)
        hidden = x.to(device=self.device, dtype=self.dtype).repeat(rows, 1, 1, 1, 1)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=self._model_input(hidden, text),
                timestep=t,
                encoder_hidden_states=text["prompt_embeds"].to(self.dtype),
                return_dict=False,
            )[0]
        out = out.float()
        if not cfg:
            return out
        high, low = self._scales(guidance)
        if self.experts is not None and high != low:  # each row its expert's scale
            scale = torch.where(timestep >= self.experts.boundary, high, low).view(-1, 1, 1, 1, 1)
            v_uncond, v_cond = self._cfg_split(out)
            return v_uncond + scale * (v_cond - v_uncond)
        return self._cfg_combine(out, high)

    def _model_input(self, hidden: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's ``hidden_states`` from the latents' rows ``hidden`` [R, C, F, h, w] (model dtype) and the
        call's conditioning rows: the latents as they are (image-to-video appends its image condition)."""
        return hidden

    # ---- LoRA of the two experts -----------------------------------------------------------------------
    def save_lora(self, directory: str | os.PathLike, layers: dict | None = None) -> None:
        """:meth:`LoraAdapter.save_lora`; two experts: each trained expert's LoRA in diffusers' Wan layout, the
        high-noise expert's in ``directory``, the low-noise expert's in ``directory/transformer_2`` (module
        docstring: how ``pipe.load_lora_weights`` loads each)."""
        experts = self.experts
        if experts is None:
            return super().save_lora(directory, layers)
        if not self.has_lora:
            raise RuntimeError("save_lora needs a LoRA adapter named 'default' (call add_lora first)")
        layers = layers if layers is not None else adapter_state(experts, "default")
        for name in experts.trained:
            prefix = f"{name}."
            own = {k[len(prefix) :]: v for k, v in layers.items() if k.startswith(prefix)}
            folder = Path(directory) if name == "transformer" else Path(directory) / LOW_NOISE_FOLDER
            type(self.pipe).save_lora_weights(
                str(folder),
                transformer_lora_layers=own,
                transformer_lora_adapter_metadata=getattr(experts, name).peft_config["default"].to_dict(),
            )

    def load_lora(self, directory: str | os.PathLike) -> None:
        """:meth:`LoraAdapter.load_lora`; two experts: each trained expert's file (:meth:`save_lora`'s layout) loaded
        into it — in place when the adapter is attached, else created by ``pipe.load_lora_weights`` — its values set
        from the file in fp32."""
        experts = self.experts
        if experts is None:
            return super().load_lora(directory)
        from peft.utils import set_peft_model_state_dict

        from flowrl.models.dtypes import keep_adapter_fp32

        folders = {"transformer": Path(directory), "transformer_2": Path(directory) / LOW_NOISE_FOLDER}
        files = {n: f / "pytorch_lora_weights.safetensors" for n, f in folders.items()}
        found = tuple(n for n in ("transformer", "transformer_2") if files[n].is_file())
        if found != experts.trained:
            raise ValueError(
                f"LoRA folder {str(directory)!r} holds the experts {list(found)} but the model trains "
                f"{list(experts.trained)} (model.experts); the low-noise expert's file is in {LOW_NOISE_FOLDER}/"
            )
        for name in experts.trained:
            expert = getattr(experts, name)
            if not self.has_lora:
                self.pipe.load_lora_weights(
                    str(folders[name]), adapter_name="default", load_into_transformer_2=name == "transformer_2"
                )
                keep_adapter_fp32(expert, "default")
            state = type(self.pipe).lora_state_dict(str(folders[name]))
            state = {k[len("transformer.") :]: v for k, v in state.items() if k.startswith("transformer.")}
            with torch.no_grad():
                set_peft_model_state_dict(expert, state, adapter_name="default")
        if not self.has_lora:
            experts.requires_grad_(False)
            for name, param in experts.named_parameters():
                param.requires_grad_("lora_" in name)
            self.has_lora = True


# what flowrl.estimate needs of the family (flowrl/models/estimate_spec.py): its inputs live beside it
WanFlowModel.estimate_spec = WAN_ESTIMATE
