"""Build the loop's components from a :class:`~flowrl.config.schema.TrainConfig` (YAML and Python share these)."""

from __future__ import annotations

from typing import Any

import torch

from flowrl.config import chosen
from flowrl.config.checks import ADAPTER_KEYS, check_model_kwargs
from flowrl.config.schema import ConfigError, ModelSection, RewardTerm, TrainConfig
from flowrl.credit.base import CreditRule
from flowrl.errors import shown
from flowrl.models.base import FlowModel, LoraSpec
from flowrl.models.dtypes import DTYPES
from flowrl.objectives.base import Objective
from flowrl.rollout.base import RolloutPlan


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r} but CUDA is not available here; accepted: 'cpu' or 'auto'")
    return torch.device(name)


def build_model(section: ModelSection, device: torch.device | None = None) -> FlowModel:
    """The adapter for ``model.family`` loaded from ``model.path`` (the shipped shapes model by default), in
    ``model.dtype``. With ``model.full_finetune`` and a bf16/fp16 ``model.dtype`` the transformer is kept in fp32
    (the weights the optimizer updates) and computes under autocast in ``model.dtype``
    (:func:`flowrl.models.dtypes.master_weights_fp32`); with LoRA the base stays in ``model.dtype`` and the LoRA
    is fp32. On CUDA, torch's cuDNN attention kernel is turned off unless ``model.cudnn_attention``
    (:mod:`flowrl.models.attention`)."""
    import flowrl.models as models
    from flowrl.models.attention import configure_attention
    from flowrl.models.dtypes import master_weights_fp32

    device = device or resolve_device(section.device)
    configure_attention(device, section.cudnn_attention)
    check_model_kwargs(section)  # every model.kwargs key a keyword of the adapter, before any weight loads
    kwargs = {
        "device": device,
        "dtype": DTYPES[section.dtype],
        "gradient_checkpointing": section.gradient_checkpointing,
    }
    for key in ADAPTER_KEYS:  # the model.* keys the adapter reads
        value = getattr(section, key)
        if value is not None:
            kwargs[key] = value
    kwargs.update(section.kwargs or {})
    try:
        if section.path is None and models.model_family(section.family).needs_path:
            raise ConfigError(f"model.path must name a hub id or a local folder for model.family={section.family!r}")
        model = models.load_model(section.family, section.path, **kwargs)
    except (ValueError, OSError, ImportError, AttributeError, TypeError) as e:  # a missing folder, a bad size, …
        if isinstance(e, ConfigError):
            raise
        chosen = ", ".join(
            f"model.{k}={shown(getattr(section, k))}"
            for k in ("family", "path", "height", "width")
            if getattr(section, k) is not None
        )
        raise ConfigError(f"{chosen}: {e}") from e
    if section.full_finetune:
        master_weights_fp32(model)
    if section.offload_encoders:
        model.offload_encoders()
    limit = section.prompt_cache_mb
    model.prompt_cache.max_bytes = None if limit is None else int(limit * 2**20)
    return model


def lora_spec(section: ModelSection) -> LoraSpec:
    lora = section.lora
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=lora.targets, dropout=lora.dropout, init=lora.init)


def add_lora(model: FlowModel, section: ModelSection) -> None:
    """Wrap ``model``'s trainable module in the LoRA ``model.lora`` describes; bad targets name the key."""
    try:
        model.add_lora(lora_spec(section))
    except ValueError as e:
        raise ConfigError(f"model.lora.targets={section.lora.targets}: {e}") from e


def build_plan(section: Any) -> RolloutPlan:
    """The rollout plan ``rollout.plan`` names, built from the section's values of its fields."""
    return chosen.build_plan(section)


def build_rewards(terms: list[RewardTerm], normalize: str = "none", key: str = "rewards"):
    """A :class:`flowrl_rewards.MultiReward` over the configured terms (``reward_normalize`` → ``normalize``); errors
    name ``key``, the section the terms come from (``rewards`` or ``eval.rewards``)."""
    from flowrl_rewards import MultiReward, RewardSpec

    try:
        return MultiReward(
            [
                RewardSpec(name=t.name, weight=t.weight, kwargs=dict(t.kwargs), label=t.label, timeout=t.timeout)
                for t in terms
            ],
            normalize=normalize,
        )
    except (KeyError, ImportError, AttributeError, TypeError, ValueError, FileNotFoundError) as e:
        names = ", ".join(shown(t.name, 60) for t in terms)
        raise ConfigError(f"{key} ({names}): {e.args[0] if isinstance(e, KeyError) and e.args else e}") from e


def build_credit(cfg: TrainConfig) -> CreditRule:
    """The credit rule ``credit.rule`` names."""
    return chosen.build_credit(cfg)


def build_loss(cfg: TrainConfig) -> Objective:
    """The objective ``loss.objective`` names, with its rows per training forward (``train.micro_batch``, default
    ``rollout.max_batch``; a policy objective's replay follows the rollout's forwards of ``rollout.max_batch``
    states)."""
    return chosen.build_loss(cfg)
