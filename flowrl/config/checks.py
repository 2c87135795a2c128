"""The checks a loaded :class:`~flowrl.config.schema.TrainConfig` passes before anything is built: choices and
ranges of every section, each failure a :class:`ConfigError` naming the key, the value and what is
accepted; the chosen components check their own fields when instantiated here."""
from __future__ import annotations

import math
import re
from typing import Any

from flowrl.config import components
from flowrl.config.choices import choose, did_you_mean
from flowrl.errors import ConfigError, shown
from flowrl.models.dtypes import DTYPES
from flowrl.prompts.source import check_adaptive_settings

REWARD_NORMALIZE = ("none", "batch", "group")  # how MultiReward combines several rewards


def check_config(cfg: Any) -> None:
    """Every check that needs no model on ``cfg`` (a TrainConfig, read by attribute: flowrl.config.schema calls this
    module, which never imports it); raises ConfigError at the first failure."""
    if ":" not in cfg.model.family:  # else an out-of-tree adapter, checked when it is imported
        from flowrl.models import MODEL_FAMILIES

        choose("model.family", cfg.model.family, tuple(MODEL_FAMILIES))
    choose("model.dtype", cfg.model.dtype, tuple(DTYPES))
    choose("model.shard", cfg.model.shard, ("auto", "ddp", "fsdp"))
    choose("model.shard_rollouts", cfg.model.shard_rollouts, ("per_block", "whole"))
    choose("reward_normalize", cfg.reward_normalize, REWARD_NORMALIZE)
    choose("optim.schedule", cfg.optim.schedule, ("constant", "linear", "cosine"))
    cfg.optim.loss_scaling = str(cfg.optim.loss_scaling).lower()  # YAML true/false arrive as "True"/"False"
    choose("optim.loss_scaling", cfg.optim.loss_scaling, ("auto", "true", "false"))
    choose("train.log_with", cfg.train.log_with, ("none", "tensorboard", "wandb"))
    positive("train.max_steps", cfg.train.max_steps, allow_zero=True)
    positive("train.max_minutes", cfg.train.max_minutes, allow_zero=True)
    positive("train.inner_epochs", cfg.train.inner_epochs)
    positive("train.updates_per_epoch", cfg.train.updates_per_epoch)
    positive("prompts.per_step", cfg.prompts.per_step)
    choose("prompts.sampling", cfg.prompts.sampling, ("epoch", "adaptive"))
    check_adaptive_settings(cfg.prompts.adaptive_floor, cfg.prompts.adaptive_decay)
    positive("rollout.max_batch", cfg.rollout.max_batch)
    positive("rollout.chunks", cfg.rollout.chunks)
    positive("optim.grad_clip", cfg.optim.grad_clip)  # ≤ 0 would reverse or zero every update
    positive("train.checkpoint_every", cfg.train.checkpoint_every, allow_zero=True)
    positive("train.keep_last", cfg.train.keep_last, allow_zero=True)
    positive("eval.every", cfg.eval.every, allow_zero=True)
    positive("eval.every_minutes", cfg.eval.every_minutes, allow_zero=True)
    positive("eval.steps", cfg.eval.steps)
    positive("model.lora.rank", cfg.model.lora.rank)
    positive("model.lora.alpha", cfg.model.lora.alpha)
    within("model.lora.dropout", cfg.model.lora.dropout, 0.0, 1.0)
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(cfg.model.device)):
        raise ConfigError(f"model.device={shown(cfg.model.device)} is not supported; accepted: auto, cpu, mps, "
                          "cuda, cuda:N")
    for key in ("guidance", "true_cfg"):
        if getattr(cfg.model, key) is not None:
            positive(f"model.{key}", getattr(cfg.model, key), allow_zero=True)
    for key in ("height", "width", "max_sequence_length", "prompt_cache_mb"):
        if getattr(cfg.model, key) is not None:
            positive(f"model.{key}", getattr(cfg.model, key))
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must be two numbers, e.g. [0.9, 0.999]")
    for i, beta in enumerate(cfg.optim.betas):
        within(f"optim.betas[{i}]", beta, 0.0, 1.0)
    positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    positive("optim.eps", cfg.optim.eps)
    positive("optim.warmup_steps", cfg.optim.warmup_steps, allow_zero=True)
    positive("eval.grid_prompts", cfg.eval.grid_prompts, allow_zero=True)
    if cfg.eval.num_prompts is not None:
        positive("eval.num_prompts", cfg.eval.num_prompts)
    for i, term in enumerate(cfg.rewards):
        if not math.isfinite(term.weight):
            raise ConfigError(f"rewards[{i}].weight={term.weight} must be a finite number")
    if cfg.train.num_threads is not None:
        positive("train.num_threads", cfg.train.num_threads)
    check_run_name(cfg.train.name)
    cfg.train.async_reward = str(cfg.train.async_reward).lower()  # YAML true/false arrive as "True"/"False"
    choose("train.async_reward", cfg.train.async_reward, ("auto", "true", "false"))
    positive("optim.lr", cfg.optim.lr)
    if not cfg.rewards:
        raise ConfigError("rewards must list at least one reward, e.g. rewards: [{name: shapes}]")
    if cfg.model.true_cfg is not None and cfg.model.family != "flux":
        raise ConfigError(f"model.true_cfg={cfg.model.true_cfg} is FLUX's real CFG; for model.family="
                          f"{cfg.model.family!r} use model.guidance")
    if cfg.train.overwrite and cfg.train.resume:
        raise ConfigError(f"train.overwrite=true replaces the run, train.resume={cfg.train.resume!r} continues "
                          "it: set one of them")
    if not 0.0 <= cfg.train.ema < 1.0:
        raise ConfigError(f"train.ema={cfg.train.ema} must be in [0, 1)")
    built = {kind.section: components.instantiate(kind, getattr(cfg, kind.section))  # each checks its own fields
             for kind in components.KINDS}
    objective = built[components.LOSS.section]
    objective.check_plan(built[components.PLAN.section])  # e.g. a policy objective on ODE rollouts
    objective.check_credit(built[components.CREDIT.section])  # e.g. step-level credit with a leaf objective
    for component in built.values():  # every key read or refused: each component names its unread ones
        unread = component.unread_keys()
        if unread:
            key, why = next(iter(unread.items()))
            raise ConfigError(f"{key} is set but nothing reads it: {why}; remove it (or set what would read it)")
    objective.rollout_guidance(cfg.model.guidance)  # e.g. CFG-free training with a guided rollout
    positive("eval.images_per_prompt", cfg.eval.images_per_prompt)
    positive("eval.batch_size", cfg.eval.batch_size)


def guard_names(cfg: Any) -> list[str]:
    """The names ``eval.guard.reward`` accepts: each eval reward term's label, else its name as written (the terms
    of ``eval.rewards``, else of ``rewards`` when the eval scores with the training rewards)."""
    return [t.label or t.name for t in (cfg.eval.rewards or cfg.rewards)]


def check_guard(cfg: Any) -> None:
    """``eval.guard``: a margin >= 0; with a reward, one of the eval rewards, periodic evals to check it at
    (``eval.every`` or ``eval.every_minutes``) and held-out prompts to evaluate."""
    guard = cfg.eval.guard
    positive("eval.guard.max_drop", guard.max_drop, allow_zero=True)
    if guard.reward is None:
        return
    names = guard_names(cfg)
    if guard.reward not in names:
        whose = "eval.rewards" if cfg.eval.rewards else "rewards (eval.rewards is null: the eval scores with them)"
        raise ConfigError(f"eval.guard.reward={shown(guard.reward)} is not one of the eval rewards"
                          f"{did_you_mean(guard.reward, names)}; accepted: {names} (the terms of {whose}: a term's "
                          "label, else its name as written)")
    if not cfg.eval.every and not cfg.eval.every_minutes:
        raise ConfigError(f"eval.guard.reward={shown(guard.reward)} is checked at the periodic evals, and eval.every=0 "
                          "with eval.every_minutes=0 runs none; accepted: eval.every >= 1 (iterations between evals) "
                          "or eval.every_minutes > 0")
    if not cfg.prompts.eval:
        raise ConfigError(f"eval.guard.reward={shown(guard.reward)} needs held-out prompts to evaluate, and prompts.eval "
                          "is null; accepted: a prompt file or inline 'a|b|c'")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def within(key: str, value: float, low: float, high: float) -> None:
    """``low <= value < high``."""
    if not (math.isfinite(value) and low <= value < high):
        raise ConfigError(f"{key}={value} must be in [{low:g}, {high:g})")


def check_run_name(name: Any) -> None:
    """``train.name`` is one folder name: not empty, not ``.``/``..``, no separator, no NUL (checked at load, and
    again by :class:`~flowrl.run.folder.RunFolder` before anything is written)."""
    text = str(name)
    if text in ("", ".", "..") or any(c in text for c in "/\\\0"):
        raise ConfigError(f"train.name={shown(name)} must be one folder name inside train.output_dir: not empty, "
                          "not '.' or '..', without '/', '\\' or NUL (e.g. train.name=shapes-nft)")
