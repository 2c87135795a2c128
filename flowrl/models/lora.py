"""LoRA on an adapter's trainable module: attach (peft), save and load in the diffusers format
(``pipe.load_lora_weights`` reads what :meth:`LoraAdapter.save_lora` writes), and the reference policy
(the LoRA disabled). :class:`~flowrl.models.base.FlowModel` inherits it; it relies on the adapter's
``trainable`` module, ``pipe`` and ``default_lora_targets``."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from flowrl.models.dtypes import dropped_log_messages, keep_adapter_fp32
from flowrl.models.module_group import peft_configs


@dataclass
class LoraSpec:
    """LoRA settings an adapter applies to its trainable module."""

    rank: int = 32
    alpha: float = 64.0
    target_modules: list[str] | None = None  # None → the adapter's defaults
    dropout: float = 0.0
    init: str = "gaussian"


class LoraAdapter:
    """The LoRA half of the :class:`~flowrl.models.base.FlowModel` contract."""

    def add_lora(self, spec: LoraSpec) -> None:
        """Attach a peft LoRA adapter named ``"default"`` to :attr:`trainable` and freeze the rest. The LoRA
        parameters are fp32 whatever the base weights' dtype (bf16/fp16 base, fp32 LoRA: an optimizer step on
        them is sound; :mod:`flowrl.models.dtypes`)."""
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
        keep_adapter_fp32(module, "default")  # fp32 LoRA on any base dtype (flowrl.models.dtypes)
        self.has_lora = True

    has_lora: bool = False

    def save_lora(self, directory: str | os.PathLike, layers: dict | None = None) -> None:
        """Write the LoRA of :attr:`trainable` in the diffusers format (``pytorch_lora_weights.safetensors``
        with the peft config as metadata), readable by ``pipe.load_lora_weights(directory)``. ``layers``: its
        peft state dict already gathered (a sharded LoRA's own tensors cannot be written), else read here."""
        from peft.utils import get_peft_model_state_dict

        module = self.trainable
        if not self.has_lora or "default" not in peft_configs(module):
            raise RuntimeError(
                "save_lora needs a LoRA adapter named 'default' (call add_lora first); "
                "for full fine-tuning save the transformer with save_pretrained"
            )
        type(self.pipe).save_lora_weights(
            str(directory),
            transformer_lora_layers=layers
            if layers is not None
            else get_peft_model_state_dict(module, adapter_name="default"),
            transformer_lora_adapter_metadata=peft_configs(module)["default"].to_dict(),
        )

    def load_lora(self, directory: str | os.PathLike) -> None:
        """Load a LoRA written by :meth:`save_lora` (or any diffusers-format transformer LoRA).

        With an adapter already attached (``add_lora`` with the same spec, e.g. on resume) its
        weights are overwritten in place, so optimizer references stay valid; every LoRA tensor must be
        matched. Without one, the adapter is created from the file (named ``"default"``, LoRA weights
        trainable and fp32, the rest frozen) by ``pipe.load_lora_weights``, with its expected notices about
        text encoders without LoRA keys left out, then its values are set again from the file in fp32 (peft
        created them in the base dtype).
        """
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        module = self.trainable
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"LoRA directory {str(directory)!r} does not exist")
        rounded = False  # whether peft created (and filled) the adapter below in a lower precision than fp32
        if not self.has_lora:
            # flowrl's LoRA is the transformer's only: "No LoRA keys associated to CLIPTextModel… found with the
            # prefix='text_encoder'" is expected for every text encoder, so that notice (only) is dropped; the same
            # notice about the transformer would mean something and still shows
            with dropped_log_messages(
                ("diffusers.loaders.lora_base", "diffusers.loaders.lora_pipeline", "diffusers.loaders.peft"),
                "No LoRA keys associated to",
                "prefix='text_encoder",
            ):
                self.pipe.load_lora_weights(str(directory), adapter_name="default")
            rounded = any(p.dtype != torch.float32 for n, p in module.named_parameters() if "lora_" in n)
            keep_adapter_fp32(module, "default")
            for name, param in module.named_parameters():
                param.requires_grad_("lora_" in name)
            self.has_lora = True
            if not rounded:
                return
        state = type(self.pipe).lora_state_dict(str(directory))
        if isinstance(state, tuple):
            state = state[0]
        prefix = "transformer."
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        expected = set(get_peft_model_state_dict(module, adapter_name="default"))
        if set(state) != expected and rounded:
            return  # a LoRA in another layout (converted by load_lora_weights): its values as loaded, upcast
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(
                f"LoRA in {str(directory)!r} does not match the attached adapter: "
                f"missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})"
            )
        with torch.no_grad():
            set_peft_model_state_dict(module, state, adapter_name="default")

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
