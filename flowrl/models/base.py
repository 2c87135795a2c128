"""The `FlowModel` contract: what every rollout plan, credit rule and the trainer may ask of a model.

An adapter wraps one diffusers pipeline family (SD3/SD3.5/shapes in `sd3.py`, FLUX.1 in `flux.py`)
and hides its packing, text encoders and timestep conventions behind six calls:

- ``encode(prompts)`` → :class:`Conditioning` (cached per prompt string; the unconditional branch
  is included when the model's guidance > 1).
- ``velocity(x, sigma, cond, guidance)`` → v, with classifier-free guidance composed inside, both
  branches in ONE forward (``[uncond; cond]`` concatenated along the batch).
- ``schedule(steps)`` → sigmas ``[steps + 1]`` from 1 to 0, with the model's shift.
- ``noise(seeds)`` → x_T ``[B, C, H, W]`` fp32, each row built from its own seed on a CPU generator
  (bit-exact on any device).
- ``decode(x0)`` → images ``[B, 3, H, W]`` in [0, 1], fp32.
- ``trainable``: the module whose parameters training updates (the transformer).

Latents handed to and returned by an adapter are always fp32 ``[B, C, H, W]`` in the model's
latent space (before the VAE's scaling is undone); adapters cast to the model dtype internally.

Shared behaviour implemented here: the per-prompt embedding cache behind ``encode`` (subclasses
implement ``_encode_one``), ``noise``, LoRA attach / save / load in the diffusers format, and the
``reference()`` context (LoRA disabled).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import os
from typing import Iterator, Sequence

import torch
from torch import nn


def align_cpu_tensors(*modules: nn.Module | None) -> None:
    """Copy CPU parameters and buffers that are not 64-byte aligned into fresh (aligned) memory.

    CPU GEMM kernels round differently depending on the alignment of their operands (measured here:
    a weight offset by 4 bytes changes results by 1 ulp). safetensors loading (mmap) leaves weights at
    arbitrary file offsets, so without this a loaded pipeline differs in the last bit from the
    in-memory one that was saved. Fresh CPU allocations are 64-byte aligned.
    """
    for module in modules:
        if module is None:
            continue
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % 64:
                tensor.data = tensor.data.clone()


@dataclass
class Conditioning:
    """Text conditioning for a batch of B prompts.

    ``cond`` / ``uncond`` map names (e.g. ``"prompt_embeds"`` [B, L, D], ``"pooled"`` [B, D]) to
    tensors whose first dimension is the batch. ``uncond`` is None when guidance is off.
    """

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return next(iter(self.cond.values())).shape[0]

    def select(self, index: torch.Tensor | Sequence[int]) -> "Conditioning":
        """Rows ``index`` (a LongTensor or list of ints) of every tensor."""
        index = torch.as_tensor(index, dtype=torch.long)
        pick = lambda d: None if d is None else {k: v[index.to(v.device)] for k, v in d.items()}
        return Conditioning(pick(self.cond), pick(self.uncond))

    @staticmethod
    def cat(parts: Sequence["Conditioning"]) -> "Conditioning":
        """Concatenate along the batch dimension."""
        keys = parts[0].cond.keys()
        cond = {k: torch.cat([p.cond[k] for p in parts]) for k in keys}
        if parts[0].uncond is None:
            return Conditioning(cond, None)
        uncond = {k: torch.cat([p.uncond[k] for p in parts]) for k in keys}
        return Conditioning(cond, uncond)


@dataclass
class LoraSpec:
    """LoRA settings an adapter applies to its trainable module."""

    rank: int = 32
    alpha: float = 64.0
    target_modules: list[str] | None = None  # None → the adapter's defaults
    dropout: float = 0.0
    init: str = "gaussian"


class FlowModel:
    """Base class of model adapters. Subclasses implement the abstract methods below.

    Attributes set by subclasses: ``pipe`` (the diffusers pipeline), ``device``, ``dtype`` (compute
    dtype of the transformer), ``height``/``width`` (pixels), ``guidance`` (default CFG scale;
    1.0 = no CFG), ``negative_prompt`` (the unconditional prompt, ``""``), ``default_lora_targets``
    (module name suffixes).
    """

    pipe: object
    device: torch.device
    dtype: torch.dtype
    height: int
    width: int
    guidance: float = 1.0
    negative_prompt: str = ""
    default_lora_targets: list[str] = []

    # ---- shared set-up of adapters ---------------------------------------------------------
    def _init_pipeline(self, pipe, device, dtype, frozen: Sequence[str], gradient_checkpointing: bool) -> None:
        """Move ``pipe`` to ``device``, cast the transformer to ``dtype`` (None → keep), freeze and
        eval the ``frozen`` components, align CPU weights (bit-exact replays), optional checkpointing."""
        transformer = pipe.transformer
        self.pipe = pipe
        self.device = torch.device(device) if device is not None else transformer.device
        self.dtype = dtype if dtype is not None else transformer.dtype
        pipe.to(self.device)
        if transformer.dtype != self.dtype:
            transformer.to(self.dtype)
        modules = [getattr(pipe, name, None) for name in frozen]
        align_cpu_tensors(transformer, *modules)
        for module in modules:
            if module is not None:
                module.requires_grad_(False).eval()
        transformer.eval()  # no dropout in these transformers; eval keeps the forward deterministic
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._prompt_cache = {}

    def _init_size(self, height: int | None, width: int | None, default_px: int, multiple: int, what: str) -> None:
        """Set ``height``/``width`` (None → ``default_px``); both must be multiples of ``multiple``."""
        self.height = int(height or default_px)
        self.width = int(width or default_px)
        if self.height % multiple or self.width % multiple:
            raise ValueError(f"height and width must be multiples of {what} = {multiple}; got {self.height}×{self.width}")

    # ---- contract -------------------------------------------------------------------------
    def encode(self, prompts: Sequence[str], guidance: float | None = None) -> Conditioning:
        """Conditioning for ``prompts`` (B strings); ``uncond`` (B copies of the negative prompt's
        embeddings) is included when :meth:`uses_cfg` says CFG is on for ``guidance``.

        Each distinct prompt string is encoded once, alone (batch of 1, so its embedding never depends
        on which other prompts came with it), by the pipeline's own ``encode_prompt``, and cached on
        the adapter: detached, on ``self.device``. Batches are assembled from the cache.
        """
        if isinstance(prompts, str):
            raise TypeError(f"encode takes a list of prompt strings, got the single string {prompts!r}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode needs at least one prompt; got an empty list")
        cond = self._cached_batch(prompts)
        uncond = None
        if self.uses_cfg(guidance):
            uncond = self._cached_batch([self.negative_prompt] * len(prompts))
        return Conditioning(cond, uncond)

    def uses_cfg(self, guidance: float | None = None) -> bool:
        """Whether :meth:`velocity` runs classifier-free guidance (needs ``Conditioning.uncond``)."""
        g = self.guidance if guidance is None else guidance
        return float(g) != 1.0

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """Embeddings of one prompt, each tensor with a leading batch dimension of 1 (subclasses)."""
        raise NotImplementedError

    def _cached_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        cache = self.__dict__.setdefault("_prompt_cache", {})
        for p in prompts:
            if p not in cache:
                with torch.no_grad():
                    embeds = self._encode_one(p)
                cache[p] = {k: v.detach().to(self.device) for k, v in embeds.items()}
        keys = cache[prompts[0]].keys()
        return {k: torch.cat([cache[p][k] for p in prompts]) for k in keys}

    def clear_cache(self) -> None:
        """Forget cached prompt embeddings (needed only if the text encoders change)."""
        self.__dict__["_prompt_cache"] = {}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """v ≈ ε − x0 for latents ``x`` [B, C, H, W] (fp32) at noise levels ``sigma`` [B] (or scalar).

        With guidance g > 1 runs ``[uncond; cond]`` in one forward and returns
        ``v_u + g·(v_c − v_u)``. Returns fp32 [B, C, H, W].
        """
        raise NotImplementedError

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1], fp32, from 1 down to 0, with the model's shift."""
        raise NotImplementedError

    def noise(self, seeds: Sequence[int]) -> torch.Tensor:
        """x_T [len(seeds), C, H, W] fp32 on ``self.device``; row i from ``torch.Generator().manual_seed(seeds[i])``.

        Each row is drawn on the CPU from its own generator, so it is bit-exact on any device and
        independent of the other seeds in the batch.
        """
        seeds = [int(s) for s in seeds]
        if not seeds:
            raise ValueError("noise needs at least one seed; got an empty list")
        rows = [
            torch.randn(self.latent_shape, generator=torch.Generator("cpu").manual_seed(s), dtype=torch.float32)
            for s in seeds
        ]
        return torch.stack(rows).to(self.device)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] fp32 in [0, 1] from clean latents [B, C, H, W]."""
        raise NotImplementedError

    @property
    def trainable(self) -> nn.Module:
        """The module training updates (the transformer, possibly with LoRA layers)."""
        raise NotImplementedError

    # ---- shared behaviour -----------------------------------------------------------------
    def set_forward_module(self, module: nn.Module | None) -> None:
        """Route :meth:`velocity`'s transformer call through ``module`` (None: :attr:`trainable` itself).

        For a wrapper around the same transformer: the DDP module ``accelerator.prepare`` returns
        (gradients are synchronised only when the forward goes through it) or a ``torch.compile``d one.
        It must accept the transformer's keyword arguments. Config, LoRA and saving still use
        :attr:`trainable`.
        """
        self.__dict__["_forward_module"] = module

    @property
    def forward_module(self) -> nn.Module:
        """The module :meth:`velocity` calls: the one given to :meth:`set_forward_module`, else :attr:`trainable`."""
        module = self.__dict__.get("_forward_module")
        return self.trainable if module is None else module

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one latent."""
        raise NotImplementedError

    def add_lora(self, spec: LoraSpec) -> None:
        """Attach a peft LoRA adapter named ``"default"`` to :attr:`trainable` and freeze the rest."""
        from peft import LoraConfig

        targets = spec.target_modules or list(self.default_lora_targets)
        module = self.trainable
        module.requires_grad_(False)
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            init_lora_weights=spec.init if spec.init != "default" else True,
            target_modules=targets,
        )
        module.add_adapter(config)
        self.has_lora = True

    has_lora: bool = False

    def save_lora(self, directory: str | os.PathLike) -> None:
        """Write the LoRA of :attr:`trainable` in the diffusers format (``pytorch_lora_weights.safetensors``
        with the peft config as metadata), readable by ``pipe.load_lora_weights(directory)``."""
        from peft.utils import get_peft_model_state_dict

        module = self.trainable
        if not self.has_lora or "default" not in getattr(module, "peft_config", {}):
            raise RuntimeError("save_lora needs a LoRA adapter named 'default' (call add_lora first); "
                               "for full fine-tuning save the transformer with save_pretrained")
        type(self.pipe).save_lora_weights(
            str(directory),
            transformer_lora_layers=get_peft_model_state_dict(module, adapter_name="default"),
            transformer_lora_adapter_metadata=module.peft_config["default"].to_dict(),
        )

    def load_lora(self, directory: str | os.PathLike) -> None:
        """Load a LoRA written by :meth:`save_lora` (or any diffusers-format transformer LoRA).

        With an adapter already attached (``add_lora`` with the same spec, e.g. on resume) its
        weights are overwritten in place, so optimizer references stay valid; every LoRA tensor must be
        matched. Without one, the adapter is created from the file (named ``"default"``, LoRA weights
        trainable, the rest frozen).
        """
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        module = self.trainable
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"LoRA directory {str(directory)!r} does not exist")
        if not self.has_lora:
            self.pipe.load_lora_weights(str(directory), adapter_name="default")
            for name, param in module.named_parameters():
                param.requires_grad_("lora_" in name)
            self.has_lora = True
            return
        state = type(self.pipe).lora_state_dict(str(directory))
        if isinstance(state, tuple):
            state = state[0]
        prefix = "transformer."
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        expected = set(get_peft_model_state_dict(module, adapter_name="default"))
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"LoRA in {str(directory)!r} does not match the attached adapter: "
                             f"missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})")
        with torch.no_grad():
            set_peft_model_state_dict(module, state, adapter_name="default")

    def sample(self, prompts: Sequence[str], plan, generator_seed: int = 0, guidance: float | None = None,
               max_batch: int = 64):
        """SDE sampling with log-probs by a rollout plan (``flowrl.Chains(...)``, trees, explore):
        returns ``SampleOutput(images [L, 3, H, W], forest)``. Same as :func:`flowrl.sample`."""
        from flowrl.rollout.sampling import sample_with_plan

        return sample_with_plan(self, prompts, plan, seed=generator_seed, guidance=guidance, max_batch=max_batch)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Within this context the model computes the reference (base) policy: LoRA disabled.

        Only meaningful with LoRA; for full fine-tuning the trainer keeps a frozen copy instead.
        """
        if not self.has_lora:
            raise RuntimeError("reference() needs a LoRA adapter; full fine-tuning keeps a frozen copy")
        self.trainable.disable_adapters()
        try:
            yield
        finally:
            self.trainable.enable_adapters()
