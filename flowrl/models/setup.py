"""The set-up every adapter shares (a mixin of :class:`~flowrl.models.base.FlowModel`): loading its diffusers pipeline
by class name (:meth:`AdapterSetup.from_pretrained`), placing and freezing it (:meth:`AdapterSetup._init_pipeline`),
the prompt settings (:meth:`AdapterSetup._init_text`) and the image size (:meth:`AdapterSetup._init_size`). An
adapter's ``__init__`` is its family's keywords and defaults around these calls."""

from __future__ import annotations

import contextlib
import os
from typing import ClassVar, Iterator, Sequence, TypedDict

import torch
from torch import nn

from flowrl.models.dtypes import cast_module


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


class AdapterOptions(TypedDict, total=False):
    """The keywords every adapter takes beside its family's own (its ``__init__``'s ``**options``)."""

    device: str | torch.device | None  # where the pipeline runs; None → where its transformer already is
    dtype: torch.dtype | None  # compute dtype of the transformer (cast when different); None → its current dtype
    height: int | None  # image size in pixels; None → the family's default (:meth:`AdapterSetup._size_rule`)
    width: int | None
    negative_prompt: str  # the unconditional prompt of CFG (default: the family's ``default_negative_prompt``)
    gradient_checkpointing: bool  # enable the transformer's gradient checkpointing


class AdapterSetup:
    """Class attributes an adapter sets: ``pipeline_class`` (the diffusers pipeline class :meth:`from_pretrained`
    loads, by its name in ``diffusers``), ``frozen`` (its components trained never: text encoders, VAE) and
    ``default_negative_prompt``; it overrides :meth:`_size_rule` where its size rule differs and
    :meth:`_latent_scale` where a latent cell is not ``pipe.vae_scale_factor`` pixels."""

    pipeline_class: ClassVar[str] = ""
    frozen: ClassVar[tuple[str, ...]] = ("text_encoder", "vae")
    default_negative_prompt: ClassVar[str] = ""
    max_sequence_length: int
    """Text tokens of an encoded prompt (set by :meth:`_init_text`)."""

    def _init_adapter(
        self,
        pipe,
        guidance: float,
        max_sequence_length: int,
        *,
        device=None,
        dtype=None,
        height: int | None = None,
        width: int | None = None,
        negative_prompt: str | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        """The set-up every adapter's ``__init__`` runs: the pipeline placed and frozen, the prompt settings, the
        size."""
        self._init_pipeline(pipe, device, dtype, self.frozen, gradient_checkpointing)
        self._init_text(
            guidance, max_sequence_length, self.default_negative_prompt if negative_prompt is None else negative_prompt
        )
        self._init_size(height, width, *self._size_rule())

    def _size_rule(self) -> tuple[int, int, str]:
        """(default pixels, the multiple height and width must be, its name): the transformer's ``sample_size``
        latent cells, whole patches."""
        config = self.pipe.transformer.config
        return (
            config.sample_size * self.vae_scale_factor,
            self.vae_scale_factor * config.patch_size,
            "vae_scale_factor × patch_size",
        )

    def largest_side(self) -> int | None:
        """The most pixels a side of an image may have for the transformer, or None (no bound: rotary position
        embeddings, default). A family with a learned position table of fixed size overrides it."""
        return None

    def check_size(self, height: int, width: int, keys: str = "model.height/model.width") -> None:
        """``height`` × ``width`` pixels are a size the transformer accepts: positive, multiples of the family's
        multiple, within :meth:`largest_side`; else a ConfigError naming ``keys``, the size and what is accepted."""
        from flowrl.errors import ConfigError

        _, multiple, what = self._size_rule()
        largest = self.largest_side()
        if height < 1 or width < 1 or height % multiple or width % multiple:
            raise ConfigError(
                f"{keys} = {height}×{width}: must be positive multiples of {what} = {multiple} for "
                f"{type(self).__name__}"
            )
        if largest is not None and max(height, width) > largest:
            raise ConfigError(
                f"{keys} = {height}×{width}: {type(self).__name__}'s transformer accepts at most "
                f"{largest} pixels a side (its position table); accepted: sides of at most {largest}"
            )

    def resize(self, height: int | None, width: int | None, keys: str = "eval.height/eval.width") -> None:
        """From now on images (and latents, :attr:`latent_shape`) are ``height`` × ``width`` pixels (None: the side
        kept), checked by :meth:`check_size` naming ``keys``. Sampling, decoding and the schedule's shift all read
        the size from the model."""
        size = (int(height or self.height), int(width or self.width))
        if size != (self.height, self.width):
            self.check_size(*size, keys)
            self.height, self.width = size

    @contextlib.contextmanager
    def sized(self, height: int | None, width: int | None, keys: str = "eval.height/eval.width") -> Iterator[None]:
        """:meth:`resize` for the block only: the model's own size is restored after it."""
        saved = (self.height, self.width)
        self.resize(height, width, keys)
        try:
            yield
        finally:
            self.height, self.width = saved

    def _latent_scale(self, pipe) -> int:
        """Pixels per latent cell (``vae_scale_factor``): the pipeline's."""
        return pipe.vae_scale_factor

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, pipeline_kwargs: dict | None = None, **kw
    ):
        """Load the family's pipeline (``pipeline_class``; a hub id or a local folder) in ``dtype`` and wrap it;
        ``pipeline_kwargs`` go to the pipeline's ``from_pretrained``, the other keywords to the adapter."""
        import diffusers

        pipe = getattr(diffusers, cls.pipeline_class).from_pretrained(str(path), dtype=dtype, **(pipeline_kwargs or {}))
        return cls(pipe, dtype=dtype, **kw)

    def _init_pipeline(self, pipe, device, dtype, frozen: Sequence[str], gradient_checkpointing: bool) -> None:
        """Move ``pipe`` to ``device``, cast the transformer to ``dtype`` (None → keep), freeze and
        eval the ``frozen`` components, align CPU weights (bit-exact replays), optional checkpointing.
        Sets ``pipe``, ``device``, ``dtype`` and ``vae_scale_factor`` (:meth:`_latent_scale`)."""
        transformer = pipe.transformer
        self.pipe = pipe
        self.vae_scale_factor = self._latent_scale(pipe)
        self.device = torch.device(device) if device is not None else transformer.device
        self.dtype = dtype if dtype is not None else transformer.dtype
        pipe.to(self.device)
        if transformer.dtype != self.dtype:
            cast_module(transformer, self.dtype)  # keeps _keep_in_fp32_modules; no diffusers `.to()` warning
        modules = [getattr(pipe, name, None) for name in frozen]
        align_cpu_tensors(transformer, *modules)
        for module in modules:
            if module is not None:
                module.requires_grad_(False).eval()
        transformer.eval()  # no dropout in these transformers; eval keeps the forward deterministic
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._prompt_cache = None  # a fresh cache (its budget: build_model sets model.prompt_cache_mb)

    def _init_text(self, guidance: float, max_sequence_length: int, negative_prompt: str = "") -> None:
        """Set ``guidance`` (the default CFG scale, or a family's guidance value), ``max_sequence_length`` and
        ``negative_prompt`` (CFG's unconditional prompt)."""
        self.guidance = float(guidance)
        self.max_sequence_length = int(max_sequence_length)
        self.negative_prompt = negative_prompt

    def _init_size(self, height: int | None, width: int | None, default_px: int, multiple: int, what: str) -> None:
        """Set ``height``/``width`` (None → ``default_px``); both must be multiples of ``multiple``."""
        self.height = int(height or default_px)
        self.width = int(width or default_px)
        if self.height % multiple or self.width % multiple:
            raise ValueError(
                f"height and width must be multiples of {what} = {multiple}; got {self.height}×{self.width}"
            )
