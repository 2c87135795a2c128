"""Copies of the policy an objective compares against: the frozen KL reference and a lagging old policy.

Both run through the model's own ``velocity`` inside a context (``with copy.active(): model.velocity(...)``):

- :class:`Reference`: the initial policy. LoRA: the base with the adapter disabled (no copy);
  full fine-tuning: a frozen copy of the initial transformer swapped in.
- :class:`OldPolicy`: an exponential moving average of the policy, θ_old ← d·θ_old + (1−d)·θ after each
  optimizer step (d from a schedule). LoRA: a second peft adapter (``flowrl_old``) on the same base,
  activated for the forward (no model copy); full fine-tuning: a frozen copy of the transformer.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

import torch

from flowrl.models.dtypes import keep_adapter_fp32
from flowrl.models.frozen import frozen_copy
from flowrl.models.module_group import peft_configs

OLD_ADAPTER = "flowrl_old"


@contextlib.contextmanager
def swapped_transformer(model, module: torch.nn.Module) -> Iterator[None]:
    """``model.velocity`` runs ``module`` instead of the trained transformer inside the context."""
    pipe = model.pipe
    live, pipe.transformer = pipe.transformer, module
    forward = model.forward_override
    model.set_forward_module(None)
    try:
        yield
    finally:
        pipe.transformer = live
        model.set_forward_module(forward)


@contextlib.contextmanager
def _kept_requires_grad(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """peft's ``set_adapter`` marks the active adapter trainable and the others frozen: undo that for ``params``."""
    flags = [(p, p.requires_grad) for p in params]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class LoraLayers:
    """The LoRA layers (peft ``BaseTunerLayer``) of a module, found once and switched one by one: what diffusers'
    ``disable_adapters`` / ``enable_adapters`` / ``set_adapter`` do to each layer, without the package-version check
    (an ``importlib.metadata`` read) and the walk over every module that they repeat on each call: switched once per
    micro-batch, those cost more than the switching (issue 52). Found again if the model's trainable module changes."""

    def __init__(self):
        self._module: torch.nn.Module | None = None
        self._layers: list = []

    def of(self, module: torch.nn.Module) -> list:
        """The LoRA layers of ``module``, in module order."""
        if module is not self._module:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._module, self._layers = module, [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
        return self._layers

    def parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Every parameter of the LoRA layers of ``module`` (their base layers' too), looked up each time (sharding
        replaces the parameter objects)."""
        return [p for layer in self.of(module) for p in layer.parameters()]

    def enable(self, module: torch.nn.Module, enabled: bool) -> None:
        """Every adapter on (the active one trainable) or off (diffusers' ``enable_adapters`` /
        ``disable_adapters``)."""
        for layer in self.of(module):
            layer.enable_adapters(enabled=enabled)

    def activate(self, module: torch.nn.Module, name: str) -> None:
        """Adapter ``name`` active at its configured scale (diffusers' ``set_adapter(name)``; peft marks it trainable
        and the others frozen)."""
        for layer in self.of(module):
            layer.set_adapter([name])
            layer.set_scale(name, 1.0)


class Reference:
    """The KL reference policy (the weights before training)."""

    def __init__(self, model):
        self.model = model
        self.frozen = None if model.has_lora else frozen_copy(model)
        self._lora = LoraLayers()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.frozen is None:  # LoRA: the base with the adapters disabled (the model's ``reference()``)
            module = self.model.trainable
            self._lora.enable(module, False)
            try:
                yield
            finally:
                self._lora.enable(module, True)
        else:
            with swapped_transformer(self.model, self.frozen):
                yield


class OldPolicy:
    """A lagging copy of the policy, starting equal to it (see module docstring)."""

    def __init__(self, model):
        self.model = model
        self._lora = LoraLayers()
        module = model.trainable
        if model.has_lora:
            from peft import LoraConfig

            if OLD_ADAPTER not in peft_configs(module):  # a second objective on the same model reuses it
                config = LoraConfig(
                    **{
                        k: v
                        for k, v in peft_configs(module)["default"].to_dict().items()
                        if k in LoraConfig.__dataclass_fields__ and k not in ("peft_type", "task_type")
                    }
                )
                with _kept_requires_grad(module.parameters()), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # intended: two adapters
                    module.add_adapter(config, adapter_name=OLD_ADAPTER)
                    module.set_adapter("default")
                keep_adapter_fp32(module, OLD_ADAPTER)  # as the policy's LoRA: an fp32 EMA on any base dtype
            self.frozen = None
            for old, _ in self.pairs:
                old.requires_grad_(False)
        else:
            self.frozen = frozen_copy(model)
        self.copy_from_policy()

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(old, live) parameter pairs, looked up each time (sharding replaces the parameter objects)."""
        module = self.model.trainable
        if self.frozen is not None:
            return list(zip(self.frozen.parameters(), module.parameters()))
        named = dict(module.named_parameters())
        return [
            (named[n.replace(".default.", f".{OLD_ADAPTER}.")], p)
            for n, p in named.items()
            if ".default." in n and "lora_" in n
        ]

    @torch.no_grad()
    def copy_from_policy(self) -> None:
        for old, live in self.pairs:
            old.copy_(live.detach())

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """θ_old ← decay·θ_old + (1 − decay)·θ (one fused multi-tensor update on CUDA)."""
        pairs = self.pairs
        if pairs:
            olds = [old for old, _ in pairs]
            torch._foreach_mul_(olds, decay)
            torch._foreach_add_(olds, [live.detach().to(old.dtype) for old, live in pairs], alpha=1.0 - decay)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.frozen is not None:
            with swapped_transformer(self.model, self.frozen):
                yield
            return
        module = self.model.trainable
        with _kept_requires_grad(self._lora.parameters(module)):  # set_adapter touches the LoRA layers' only
            self._lora.activate(module, OLD_ADAPTER)
            try:
                yield
            finally:
                self._lora.activate(module, "default")

    def state_dict(self) -> list[torch.Tensor]:
        return [old.detach().cpu().clone() for old, _ in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.pairs):
            raise ValueError(f"old-policy state holds {len(tensors)} tensors, the model {len(self.pairs)}")
        for (old, _), t in zip(self.pairs, tensors):
            old.copy_(t.to(old.device, old.dtype))
