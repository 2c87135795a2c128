"""The `FlowModel` contract: what every rollout plan, credit rule and the trainer may ask of a model.

An adapter wraps one diffusers pipeline family (SD3/SD3.5/shapes in `sd3.py`, FLUX.1 in `flux.py`) and hides its
packing, text encoders and timestep conventions behind six calls:

- ``encode(prompts)`` → :class:`Conditioning` (cached per prompt string; the unconditional branch
  is included when the model's guidance > 1).
- ``velocity(x, sigma, cond, guidance)`` → v, with classifier-free guidance composed inside, both
  branches in ONE forward (``[uncond; cond]`` concatenated along the batch).
- ``schedule(steps)`` → sigmas ``[steps + 1]`` from 1 to 0, with the model's shift.
- ``noise(seeds)`` → x_T ``[B, C, H, W]`` fp32, each row from its own seed on a CPU generator (bit-exact anywhere).
- ``decode(x0)`` → images ``[B, 3, H, W]`` in [0, 1], fp32; ``trainable``: the module training updates (the
transformer).

Latents handed to and returned by an adapter are always fp32 ``[B, C, H, W]`` in the model's latent space (before
the VAE's scaling is undone); adapters cast to the model dtype internally.

Shared behaviour implemented here: the per-prompt embedding cache behind ``encode``, ``noise``, ``schedule`` (the
pipeline's scheduler, static or dynamic shift), ``decode`` (undo the VAE's scaling and shift, decode, map [-1, 1] →
[0, 1]), ``trainable`` / ``latent_shape`` / ``image_seq_len`` from ``pipe.transformer``'s config; LoRA attach / save /
load in the diffusers format and the ``reference()`` context (LoRA disabled) from
:class:`~flowrl.models.lora.LoraAdapter`;
text encoders offloaded between uses from :class:`~flowrl.models.offload.EncoderOffload`.

Writing an adapter (e.g. for ``SanaPipeline``)
----------------------------------------------
A subclass must implement:

- ``__init__(pipe, ...)``: call ``_init_pipeline`` (device, dtype, frozen text encoders and VAE, sets
  ``vae_scale_factor`` from the pipeline), ``_init_text`` (guidance, max_sequence_length, negative prompt) and
  ``_init_size`` (:mod:`flowrl.models.setup`); class attributes ``family``, ``pipeline_class`` (the diffusers
  class ``from_pretrained`` loads; ``load_model`` calls it) and ``default_lora_targets``.
- ``_encode_one(prompt)``: the pipeline's own ``encode_prompt`` for one prompt, as a dict of tensors
  with a leading batch dimension of 1 (e.g. ``prompt_embeds`` and ``pooled``, or SANA's
  ``prompt_embeds`` and ``prompt_attention_mask``).
- ``velocity(x, sigma, cond, guidance)``: the family's packing and timestep convention (SD3:
  σ·1000; FLUX: σ; SANA: σ·1000·``timestep_scale``) around one ``self.forward_module(...)`` call.
  The helpers :meth:`FlowModel._check_inputs` (shapes, σ as an fp32 [B] vector),
  :meth:`FlowModel._cfg_text` (text rows ``[uncond; cond]``) and :meth:`FlowModel._cfg_combine`
  (``v_u + g·(v_c − v_u)``) keep the CFG layout the same across families.

and overrides, where the family differs from the defaults:

- ``latent_channels`` (default ``transformer.config.in_channels``; FLUX packs 4 channels per token),
- ``image_seq_len`` (default (h/p)·(w/p) with p = ``transformer.config.patch_size``; it sets ``mu``
  of dynamic shifting),
- ``_schedule_sigmas(steps)`` (default None: the scheduler's own spacing; FLUX passes
  ``linspace(1, 1/steps, steps)``) and ``shift_defaults`` (fallbacks of ``calculate_shift``),
- ``_vae_scale_shift()`` (default the VAE config's ``scaling_factor`` and ``shift_factor``, the
  shift None when the VAE has none, as SANA's DC-AE),
- ``uses_cfg(guidance)`` (default: CFG when guidance ≠ 1; FLUX decides by ``true_cfg``).

Training through CFG (``loss.cfg_gradient``; docs/algorithms.md, "Training through CFG"): inside
``with model.cfg_gradient("cond"):`` the unconditional branch leaves the composition detached, so a loss of
v = v_u + g·(v_c − v_u) sends its gradient through g·∇v_c only (Flow-GRPO's ``train_sd3.py``); ``"both"`` (outside
any such context) lets it flow through both branches, adding (1 − g)·∇v_u. Values are the same bit for bit either
way: only autograd sees the difference. An adapter that composes the branches itself takes them from
:meth:`FlowModel._cfg_split`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from flowrl.models.cfg import CFG_GRADIENTS, CfgComposition  # noqa: F401 (CFG_GRADIENTS: part of this module's API)
from flowrl.models.conditioning import Conditioning, calculate_shift, sigma_vector  # noqa: F401 (this module's API)
from flowrl.models.dtypes import AUTOCAST_FOLLOWS_ACCELERATE, autocast_context
from flowrl.models.lora import LoraAdapter, LoraSpec  # noqa: F401 (LoraSpec: part of this module's API)
from flowrl.models.offload import EncoderOffload
from flowrl.models.prompt_cache import PromptCache
from flowrl.models.setup import AdapterSetup, align_cpu_tensors  # noqa: F401 (align_cpu_tensors: API)


class FlowModel(AdapterSetup, LoraAdapter, EncoderOffload, CfgComposition):
    """Base class of model adapters. Subclasses implement ``_encode_one`` and ``velocity`` (and
    override the family hooks where they differ); the module docstring lists what an adapter provides.

    Attributes set by subclasses (most through :meth:`_init_pipeline` and :meth:`_init_size`):
    ``pipe`` (the diffusers pipeline), ``device``, ``dtype`` (compute dtype of the transformer),
    ``vae_scale_factor`` (pixels per latent cell), ``height``/``width`` (pixels), ``guidance``
    (default CFG scale; 1.0 = no CFG), ``negative_prompt`` (the unconditional prompt, ``""``),
    ``default_lora_targets`` (module name suffixes).
    """

    pipe: object
    device: torch.device
    dtype: torch.dtype
    vae_scale_factor: int
    height: int
    width: int
    guidance: float = 1.0
    negative_prompt: str = ""
    takes_source_image: bool = False
    """An editing family: every prompt carries the image it edits (:mod:`flowrl.models.image_prompts`)."""
    source_images: int | None = 1
    """With :attr:`takes_source_image`: the most images one prompt may carry (leading ``[image: PATH]`` tags), checked
    at load; None: the adapter's own setting decides (Qwen-Image-Edit 2509/2511's ``max_images``, checked at encode)."""
    family: str | None = None
    """The registered family name (``model.family``: ``"sd3"``, ``"flux"``, …), a class attribute of each family
    adapter; None for an adapter outside the registry (it is named by its class then)."""
    modality: str = "image"
    """What the family samples: ``"image"`` (decode → [B, 3, H, W]) or ``"video"`` (``decode_video`` → [B, F, 3, H, W],
    frames ``num_frames``); declared once, read by the loop, the rewards' checks and the estimate."""
    num_frames: int | None = None
    """Frames of a video family's samples (``model.kwargs.num_frames``, set by its adapter); None for image families."""
    default_lora_targets: list[str] = []
    autocast: torch.dtype | str | None = AUTOCAST_FOLLOWS_ACCELERATE
    """Autocast dtype of the transformer call (:meth:`autocast_context`): a dtype, None (never) or ``"accelerate"``
    (default: accelerate's ``mixed_precision`` of this process); :mod:`flowrl.models.dtypes` has the conventions."""
    shift_defaults: dict[str, float] = {
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "base_shift": 0.5,
        "max_shift": 1.15,
    }
    """Fallbacks of :func:`calculate_shift`'s parameters for a dynamic-shifting scheduler whose config
    lacks them (the values the family's pipeline ``__call__`` uses)."""

    # ---- state the model's own methods set (declared: nothing outside a model stashes attributes on it) ----------
    forward_override: nn.Module | None = None
    """The wrapper :meth:`velocity` calls instead of :attr:`trainable` (:meth:`set_forward_module`), or None."""
    frozen_copies: tuple[nn.Module, ...] = ()
    """The frozen full copies of :attr:`trainable` made for this model (:func:`flowrl.models.frozen.frozen_copy`:
    an objective's old policy or reference, a loaded teacher), oldest first: whatever later wraps the transformer
    (FSDP2 sharding) wraps them alike."""
    _prompt_cache: PromptCache | None = None  # made by :attr:`prompt_cache` on first use

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
            uncond = self._cached_batch(self._negative_prompts(prompts))
        return Conditioning(cond, uncond)

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The unconditional prompt of each of ``prompts`` for CFG: the negative prompt (an editing family: on the
        same source image)."""
        return [self.negative_prompt] * len(prompts)

    def guidance_or_default(self, guidance: float | None) -> float:
        """The guidance a call uses: ``guidance``, else (None) the model's default :attr:`guidance`."""
        return float(self.guidance if guidance is None else guidance)

    def uses_cfg(self, guidance: float | None = None) -> bool:
        """Whether :meth:`velocity` runs classifier-free guidance (needs ``Conditioning.uncond``)."""
        return self.guidance_or_default(guidance) != 1.0

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """Embeddings of one prompt, each tensor with a leading batch dimension of 1 (subclasses)."""
        raise NotImplementedError

    @property
    def prompt_cache(self) -> PromptCache:
        """The embeddings of encoded prompts (LRU, bounded by ``prompt_cache.max_bytes``; see
        :mod:`flowrl.models.prompt_cache`)."""
        if self._prompt_cache is None:
            self._prompt_cache = PromptCache()
        return self._prompt_cache

    def _cached_batch(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        cache = self.prompt_cache

        def encoded(p: str):
            with torch.no_grad():
                return {k: v.detach().to(self.device) for k, v in self._encode_one(p).items()}

        with self.encoders_ready(any(p not in cache for p in prompts)):  # offloaded: one visit for the new prompts
            entries = [cache.get(p, lambda p=p: encoded(p)) for p in prompts]
        batch = {k: torch.cat([e[k] for e in entries]) for k in entries[0]}
        cache.trim()
        return batch

    def clear_cache(self) -> None:
        """Forget cached prompt embeddings (needed only if the text encoders change)."""
        self.prompt_cache.clear()

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """v ≈ ε − x0 for latents ``x`` [B, C, H, W] (fp32) at noise levels ``sigma`` [B] (or scalar).

        With guidance g > 1 runs ``[uncond; cond]`` in one forward and returns
        ``v_u + g·(v_c − v_u)``. Returns fp32 [B, C, H, W].
        """
        raise NotImplementedError

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 on the CPU, 1 → 0, with the model's shift: the pipeline's own schedule.

        As the diffusers pipelines compute it, on a fresh copy of ``pipe.scheduler`` (the pipeline's
        scheduler is not touched): ``set_timesteps(steps)``, or ``set_timesteps(sigmas=...)`` when
        :meth:`_schedule_sigmas` gives the unshifted sigmas; the scheduler shifts them by its static
        ``shift``, or, when it uses dynamic shifting, by ``mu`` = :func:`calculate_shift` of
        :attr:`image_seq_len` and the scheduler's config (:attr:`shift_defaults` where it lacks a
        value), and appends the final 0.
        """
        steps = int(steps)
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1; got {steps}")
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        config = scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            defaults = self.shift_defaults
            kwargs["mu"] = calculate_shift(
                self.image_seq_len,
                config.get("base_image_seq_len", defaults["base_image_seq_len"]),
                config.get("max_image_seq_len", defaults["max_image_seq_len"]),
                config.get("base_shift", defaults["base_shift"]),
                config.get("max_shift", defaults["max_shift"]),
            )
        sigmas = self._schedule_sigmas(steps)
        if sigmas is None:
            scheduler.set_timesteps(steps, device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()

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
        """Images [B, 3, H, W] fp32 in [0, 1] from clean latents ``x0`` [B, C, h, w] (fp32, unpacked).

        Undoes the VAE's scaling and shift (:meth:`_vae_scale_shift`) in the VAE's dtype, decodes and
        maps [-1, 1] to [0, 1], as the pipelines' image processor does for ``output_type="pt"``.
        """
        vae = self.pipe.vae
        scaling, shift = self._vae_scale_shift()
        latents = x0.to(device=self.device, dtype=vae.dtype) / scaling
        if shift is not None:
            latents = latents + shift
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @property
    def trainable(self) -> nn.Module:
        """The module training updates: ``pipe.transformer`` (possibly with LoRA layers)."""
        return self.pipe.transformer

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one (unpacked) latent: (:attr:`latent_channels`, height / f, width / f),
        f = ``vae_scale_factor``."""
        return (self.latent_channels, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)

    # ---- family hooks (override where the family differs) ---------------------------------
    @property
    def latent_channels(self) -> int:
        """Channels C of an unpacked latent; default: the transformer's ``in_channels``."""
        return self.pipe.transformer.config.in_channels

    @property
    def image_seq_len(self) -> int:
        """Image tokens the transformer sees (``mu`` of dynamic shifting depends on it); default
        (h/p)·(w/p) of the latent with p = the transformer's ``patch_size``."""
        patch = self.pipe.transformer.config.patch_size
        _, h, w = self.latent_shape
        return (h // patch) * (w // patch)

    def _schedule_sigmas(self, steps: int):
        """Unshifted sigmas [steps] (a numpy array) the pipeline passes to ``set_timesteps(sigmas=...)``,
        or None (default) for the scheduler's own spacing from ``set_timesteps(steps)``."""
        return None

    def _vae_scale_shift(self) -> tuple[float, float | None]:
        """(scaling, shift) with latent = (vae latent − shift) · scaling, undone by :meth:`decode`.
        Default: the VAE config's ``scaling_factor`` and ``shift_factor`` (None when the VAE has no shift,
        as SANA's DC-AE)."""
        config = self.pipe.vae.config
        return config.scaling_factor, config.get("shift_factor")

    # ---- helpers of velocity --------------------------------------------------------------
    def _check_inputs(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning) -> torch.Tensor:
        """Check ``x`` [B, *latent_shape] and ``cond`` (B rows) for :meth:`velocity`; return σ as an fp32
        vector [B] on ``self.device`` (from a scalar, a 0-d tensor or a [B] tensor)."""
        batch = x.shape[0]
        if tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(f"x must be [B, {', '.join(map(str, self.latent_shape))}]; got {list(x.shape)}")
        if len(cond) != batch:
            raise ValueError(f"cond has {len(cond)} rows but x has {batch}")
        return sigma_vector(sigma, batch, self.device)

    # ---- shared behaviour -----------------------------------------------------------------
    def autocast_context(self):
        """The context :meth:`velocity`'s transformer call runs in: ``torch.autocast`` in :attr:`autocast`'s dtype,
        or a null context. Velocities leave it as fp32; kernels and log-probs run outside it in fp32."""
        return autocast_context(self)

    def set_forward_module(self, module: nn.Module | None) -> None:
        """Route :meth:`velocity`'s transformer call through ``module`` (None: :attr:`trainable` itself).

        For a wrapper around the same transformer: the DDP module ``accelerator.prepare`` returns
        (gradients are synchronised only when the forward goes through it) or a ``torch.compile``d one.
        It must accept the transformer's keyword arguments. Config, LoRA and saving still use
        :attr:`trainable`.
        """
        self.forward_override = module

    @property
    def forward_module(self) -> nn.Module:
        """The module :meth:`velocity` calls: the one given to :meth:`set_forward_module`, else :attr:`trainable`."""
        module = self.forward_override
        return self.trainable if module is None else module

    def record_frozen_copy(self, module: nn.Module) -> None:
        """Record ``module``, a frozen full copy of :attr:`trainable` (:func:`flowrl.models.frozen.frozen_copy`), in
        :attr:`frozen_copies`."""
        self.frozen_copies = (*self.frozen_copies, module)
