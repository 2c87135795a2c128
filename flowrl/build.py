"""Build the loop's components from a :class:`~flowrl.config.TrainConfig` (YAML and Python share these)."""
from __future__ import annotations

from dataclasses import asdict

import torch

from flowrl.config import ConfigError, ModelSection, RewardTerm, RolloutSection, TrainConfig
from flowrl.credit.group import GroupAdvantage
from flowrl.loss import PolicyLoss
from flowrl.models.base import FlowModel, LoraSpec
from flowrl.rollout.base import RolloutPlan
from flowrl.rollout.chains import Chains, SDEWindow

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r} but CUDA is not available here; accepted: 'cpu' or 'auto'")
    return torch.device(name)


def build_model(section: ModelSection, device: torch.device | None = None) -> FlowModel:
    """The adapter for ``model.family`` loaded from ``model.path`` (the shipped shapes model by default)."""
    from flowrl import models

    device = device or resolve_device(section.device)
    kwargs = {"device": device, "dtype": DTYPES[section.dtype], "gradient_checkpointing": section.gradient_checkpointing}
    for key in ("guidance", "true_cfg", "height", "width", "max_sequence_length"):
        value = getattr(section, key)
        if value is not None:
            kwargs[key] = value
    if section.family == "shapes":
        from flowrl.shapes.model import load_shapes_model

        return load_shapes_model(section.path, **kwargs)
    if section.path is None:
        raise ConfigError(f"model.path must name a hub id or a local folder for model.family={section.family!r}")
    return models.load_model(section.family, section.path, **kwargs)


def lora_spec(section: ModelSection) -> LoraSpec:
    lora = section.lora
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=lora.targets, dropout=lora.dropout, init=lora.init)


def build_plan(section: RolloutSection) -> RolloutPlan:
    """The rollout plan named by ``rollout.plan`` with the section's fields."""
    fields = asdict(section)
    plan = fields.pop("plan")
    fields.pop("max_batch")
    fields.pop("chunks")
    if plan == "chains":
        fields["window"] = SDEWindow(**fields["window"])
        return Chains(**fields)
    raise ConfigError(f"rollout.plan={plan!r} is not supported; accepted: ['chains']")


def build_rewards(terms: list[RewardTerm]):
    """A :class:`rewards.MultiReward` over the configured terms."""
    from rewards import MultiReward, RewardSpec

    try:
        return MultiReward([RewardSpec(name=t.name, weight=t.weight, kwargs=dict(t.kwargs), label=t.label) for t in terms])
    except (KeyError, ModuleNotFoundError, AttributeError, TypeError) as e:
        raise ConfigError(f"rewards: {e}") from e


def build_credit(cfg: TrainConfig, weights: dict[str, float]) -> GroupAdvantage:
    c = cfg.credit
    if c.rule != "group":
        raise ConfigError(f"credit.rule={c.rule!r} is not supported; accepted: ['group']")
    return GroupAdvantage(baseline=c.baseline, scale=c.scale, per_reward_norm=c.per_reward_norm, eps=c.eps, weights=weights)


def build_loss(cfg: TrainConfig) -> PolicyLoss:
    return PolicyLoss(**asdict(cfg.loss))
