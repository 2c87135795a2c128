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
