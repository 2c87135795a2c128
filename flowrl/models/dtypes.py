"""Precision of an adapter's modules, and loading without spurious library warnings.

Low precision (``model.dtype`` bfloat16 or float16, or accelerate's ``mixed_precision``), as the adapters
and the loop hold it:

- **frozen weights** of the transformer are stored in ``model.dtype`` (loaded with ``from_pretrained(dtype=...)``,
  or cast by :func:`cast_module`, which keeps a model's ``_keep_in_fp32_modules`` in fp32 as that load does);
  hidden states enter the transformer in ``model.dtype``; text encoders and the VAE keep their own dtype.
- **trainable parameters are fp32.** LoRA: :func:`keep_adapter_fp32` (peft's ``cast_adapter_dtype``, the
  common practice of bf16 base + fp32 LoRA); peft then runs the LoRA branch in fp32 and casts the layer's sum
  back to the base dtype. An optimizer step on bf16/fp16 weights is not sound: AdamW's update (≈ lr) is far
  below a bf16 weight's spacing (2⁻⁸ relative) and is rounded away, and in fp16 its ``eps`` (1e-8) underflows
  to 0, so a tiny second moment divides by zero (measured here: fp16 LoRA weights turned inf in 2 steps).
  Full fine-tuning: :func:`master_weights_fp32` keeps the transformer in fp32 and computes under autocast.
- **autocast**: :func:`autocast_dtype` — the adapter's ``autocast`` attribute (a dtype, or None for never), or
  by default accelerate's ``mixed_precision`` of this process (``accelerate launch --mixed_precision bf16``,
  ``ACCELERATE_MIXED_PRECISION``), the compute dtype ``accelerator.prepare(model)`` would give the forward.
  Only the transformer call runs under it (:meth:`FlowModel.autocast_context`).
- **fp16 needs loss scaling**: log-probs are means over latent elements, so the gradient reaching each
  activation is about 1/N of the loss's (N = 262,144 for a 1024 px SD3.5 latent), below fp16's smallest
  normal number. When :func:`computes_in_fp16`, the updater scales the loss dynamically (``optim.loss_scaling``,
  torch's ``GradScaler``) and unscales before clipping; bf16 has fp32's range and needs none.
- **velocities, kernels, log-probs are fp32**: every adapter returns ``v`` as fp32 and :mod:`flowrl.rollout.sde` casts
  its inputs to fp32 and runs outside the autocast region; elementwise ops are never autocast anyway. The
  replay runs the same call in the same dtype path, so the first inner step's ratio is exactly 1 (tested in
  tests/test_low_precision.py for SD3, FLUX and SANA in bf16 and fp16).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

AUTOCAST_FOLLOWS_ACCELERATE = "accelerate"
"""Default of ``FlowModel.autocast``: follow accelerate's ``mixed_precision`` of this process."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` name → torch dtype, the one definition of these names: the config's check (its accepted values),
model building and the memory estimate read it."""
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}
"""Short names some settings also take (a reward's ``dtype``), each for one of :data:`DTYPES`."""


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype of a name of :data:`DTYPES` or :data:`DTYPE_ALIASES` (case and a ``torch.`` prefix ignored);
    None for any other name."""
    key = str(name).lower().removeprefix("torch.")
    return DTYPES.get(DTYPE_ALIASES.get(key, key))


MIXED_PRECISION: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The short names → torch dtype: accelerate's ``mixed_precision`` and the explorer's ``bf16`` / ``fp16`` backends."""


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place, keeping the submodules a
    diffusers model lists in ``_keep_in_fp32_modules`` in fp32 (what ``from_pretrained(dtype=...)`` does).

    Unlike diffusers' ``ModelMixin.to(dtype)``, which warns on every cast in diffusers 0.42 ("There are modules
    in … that should be kept in float32: []"), even when the list is empty, because it cannot keep them.
    """
    nn.Module.to(module, dtype=dtype)
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    if keep and dtype != torch.float32:
        for name, sub in module.named_modules():
            if any(k in name.split(".") for k in keep):
                nn.Module.to(sub, dtype=torch.float32)
    return module


def accelerate_mixed_precision() -> torch.dtype | None:
    """The compute dtype of accelerate's ``mixed_precision`` in this process (bf16 / fp16), or None when it is
    ``no`` or no ``Accelerator`` was created (nothing else reads ``ACCELERATE_MIXED_PRECISION``)."""
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return None
    if not is_initialized():
        return None
    return MIXED_PRECISION.get(str(AcceleratorState().mixed_precision))


def autocast_dtype(model) -> torch.dtype | None:
    """The dtype the transformer call of ``model`` runs under autocast in, or None (no autocast): the model's
    ``autocast`` attribute when it names a dtype (None: never), else accelerate's ``mixed_precision``."""
    choice = model.autocast  # declared by FlowModel (default AUTOCAST_FOLLOWS_ACCELERATE)
    if choice is None or isinstance(choice, torch.dtype):
        return choice
    if choice != AUTOCAST_FOLLOWS_ACCELERATE:
        raise ValueError(
            f"FlowModel.autocast={choice!r}: choose a torch dtype, None or {AUTOCAST_FOLLOWS_ACCELERATE!r}"
        )
    return accelerate_mixed_precision()


def computes_in_fp16(model) -> bool:
    """Whether the transformer's forward (and so its backward) runs in fp16: weights stored in fp16, or
    autocast to fp16 (``model.autocast`` / accelerate's ``mixed_precision: fp16``)."""
    return model.dtype == torch.float16 or autocast_dtype(model) == torch.float16


def autocast_context(model) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the model's device in :func:`autocast_dtype` (a null context when None)."""
    dtype = autocast_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(model.device).type, dtype=dtype)


def keep_adapter_fp32(module: nn.Module, adapter_name: str = "default") -> None:
    """Upcast the bf16/fp16 parameters of peft adapter ``adapter_name`` in ``module`` to fp32 (peft's
    ``cast_adapter_dtype``; it replaces the Parameter objects, so call it before an optimizer holds them).

    peft creates an adapter's layers in its base layer's dtype; this keeps them fp32 whatever the base's dtype.
    """
    from peft.tuners.tuners_utils import cast_adapter_dtype

    cast_adapter_dtype(module, adapter_name, autocast_adapter_dtype=True)


def master_weights_fp32(model) -> None:
    """Full fine-tuning of a low-precision ``model``: its transformer (every weight trainable) becomes fp32 and
    its forward runs under autocast in the former ``model.dtype``, so the optimizer updates fp32 weights.

    Sets ``model.dtype`` = fp32 (hidden states enter in fp32; autocast casts the matmuls) and ``model.autocast``
    = the former dtype, unless an autocast dtype was chosen already. No-op for an fp32 model.
    """
    compute = model.dtype
    if compute == torch.float32:
        return
    cast_module(model.trainable, torch.float32)
    model.dtype = torch.float32
    if not isinstance(model.autocast, torch.dtype):
        model.autocast = compute


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str, containing: str):
        super().__init__()
        self.prefix, self.containing = prefix, containing

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not (message.startswith(self.prefix) and self.containing in message)


@contextlib.contextmanager
def dropped_log_messages(logger_names: tuple[str, ...], prefix: str, containing: str = "") -> Iterator[None]:
    """Inside the context, records of the loggers ``logger_names`` whose message starts with ``prefix`` and
    contains ``containing`` are dropped (only those: every other warning still shows)."""
    drop = _DropMessages(prefix, containing)
    loggers = [logging.getLogger(name) for name in logger_names]
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


@contextlib.contextmanager
def no_loading_bars() -> Iterator[None]:
    """diffusers' and transformers' loading progress bars off inside the context (restored after), for loads
    that take a fraction of a second (the shipped shapes model)."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    states = [(lib, lib.is_progress_bar_enabled()) for lib in (dlog, tlog)]
    for lib, _ in states:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, enabled in states:
            if enabled:
                lib.enable_progress_bar()
