"""The checks a loaded :class:`~flowrl.config.schema.TrainConfig` passes before anything is built: choices and
ranges of every section, each failure a :class:`ConfigError` naming the key, the value and what is
accepted; the chosen components check their own fields when instantiated here."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable

from flowrl.config.bounds import PEAK_TFLOPS
from flowrl.config.secrets import HEADERS, SECRET_NAMES, is_secret
from flowrl.core.choices import check_known, choose, nearest, refuse_key
from flowrl.core.components import component_fields
from flowrl.errors import ConfigError, shown
from flowrl.models.dtypes import DTYPES
from flowrl.prompts.source import check_adaptive_settings

REWARD_NORMALIZE = ("none", "batch", "group")  # how MultiReward combines several rewards


def check_config(cfg: Any) -> None:
    """Every check of ``cfg``'s own sections that needs no model (a TrainConfig, read by attribute: flowrl.config.schema
    calls this module, which never imports it); raises ConfigError at the first failure. Nothing is changed. The
    chosen components are checked when built (:func:`check_components`, from
    :func:`flowrl.config.chosen.load_components`).
    The keys of the free-form mappings are checked here too, against what reads them: ``model.kwargs`` against the
    adapter's keywords, ``rewards[i].kwargs`` against each reward's settings (:func:`check_free_keys`)."""
    check_model_section(cfg.model)
    check_loop_sections(cfg)
    check_free_keys(cfg)


def check_free_keys(cfg: Any) -> None:
    """The keys the schema leaves to what reads them, checked against it without building it: ``model.kwargs`` against
    the adapter's signature (:func:`check_model_kwargs`), every ``rewards[i].kwargs`` and ``eval.rewards[i].kwargs``
    against that reward's settings (:func:`check_reward_terms`)."""
    check_model_kwargs(cfg.model)
    check_reward_terms(cfg)


ADAPTER_KEYS = ("guidance", "true_cfg", "height", "width", "max_sequence_length", "experts")
"""``model.*`` keys that :func:`flowrl.config.build.build_model` passes to the adapter when set."""
MODEL_OWNED = ("path", "device", "dtype", "gradient_checkpointing") + ADAPTER_KEYS
"""Adapter keywords ``model.*`` keys set: ``model.kwargs`` may not set them too."""


def check_model_kwargs(m: Any) -> None:
    """``model.kwargs``: no key that ``model.*`` sets itself, and every key a keyword of the ``model.family`` adapter
    (its loader's or ``from_pretrained``'s signature and the adapter's ``__init__`` they pass the rest to:
    :func:`flowrl.models.adapter_keywords`), checked before any weight loads."""
    from flowrl.core.registry import LOAD_ERRORS
    from flowrl.models import adapter_keywords

    extra = dict(m.kwargs or {})
    owned = [k for k in extra if k in MODEL_OWNED]
    if owned:
        raise ConfigError(f"model.kwargs.{owned[0]} has its own key: set model.{owned[0]} instead")
    if m.experts is not None:
        choose("model.experts", m.experts, ("high", "low", "both"))
    if not extra and m.experts is None:
        return
    try:
        keywords = adapter_keywords(m.family)
    except ConfigError:
        raise
    except LOAD_ERRORS as e:
        raise ConfigError(f"model.family={shown(m.family)}: {e}") from None
    if keywords is None:  # the adapter takes any keyword
        return
    if m.experts is not None and "experts" not in keywords:
        raise ConfigError(
            f"model.experts={shown(m.experts)} chooses the trained expert of a two-expert pipeline (Wan 2.2 A14B, "
            f"model.family=wan or wan_i2v); the model.family={m.family!r} adapter has none: leave it null"
        )
    accepted = [k for k in keywords if k not in MODEL_OWNED]
    for k, v in extra.items():
        check_known(
            [k],
            accepted,
            f"the model.family={m.family!r} adapter",
            prefix="model.kwargs.",
            value=v,
            secret=looks_secret(k, accepted),
            note=" (its other keywords are model.* keys)",
        )


def check_reward_terms(cfg: Any) -> None:
    """Every term of ``rewards`` and ``eval.rewards``: its name resolves (a ``module:Class`` plugin is imported, not
    built) and each key of its ``kwargs`` is one of that reward's settings or the combiner's
    (:func:`flowrl_rewards.core.registry.check_reward_kwargs`), each failure naming ``rewards[i].kwargs.<key>``."""
    from flowrl.core.registry import LOAD_ERRORS
    from flowrl_rewards.core.registry import check_reward_kwargs

    for section, terms in (("rewards", cfg.rewards), ("eval.rewards", cfg.eval.rewards or [])):
        for i, term in enumerate(terms):
            try:  # a refusal names a secret-looking key, never its value (nested settings too: gdro_corrected's)
                given = dict(term.kwargs or {})
                check_reward_kwargs(term.name, given, key=f"{section}[{i}].kwargs", term=True, secret=looks_secret)
            except ConfigError:
                raise
            except LOAD_ERRORS as e:  # a plugin that does not import, or is not a Reward (named in the message)
                raise ConfigError(str(e)) from None


SECRET_LOOKALIKE = 0.75
"""How close (difflib's ratio) a key, or a word of it, must come to a secret's name (:data:`SECRET_NAMES`) to look
like one: ``api_kye`` (0.86), ``pasword`` (0.93), ``tokn`` (0.89)."""


def _secret_name(name: str) -> bool:
    return is_secret(name) or str(name).lower() == HEADERS


def looks_secret(key: str, accepted: Iterable[str] = ()) -> bool:
    """Whether a setting named ``key`` holds, or looks like it holds, a secret: its name says so
    (:func:`flowrl.config.secrets.is_secret`, or ``headers``), it or a word of it comes near a secret's name
    (``api_kye``, ``openai_pasword``), or the accepted setting a refusal would suggest for it is one (``did you mean
    'api_key'?``). An ``*_env`` setting names a variable, not a secret. A refusal names such a key, never its value."""
    lowered = str(key).lower()
    if _secret_name(key):
        return True
    if lowered.endswith("_env"):
        return False
    words = [w for w in re.split(r"[^a-z0-9]+", lowered) if w]
    pieces = {lowered, *words, *("_".join(words[i : i + 2]) for i in range(len(words) - 1))}
    names = (*SECRET_NAMES, HEADERS)
    if any(difflib.get_close_matches(p, names, n=1, cutoff=SECRET_LOOKALIKE) for p in pieces):
        return True
    suggested = nearest(key, accepted)  # the suggestion a refusal would make (the one rule)
    return suggested is not None and _secret_name(suggested)


def check_model_section(m: Any) -> None:
    """``model.*``: the family, dtype, sharding, device, sizes, guidance and LoRA shape."""
    if ":" not in m.family:  # else an out-of-tree adapter, checked when it is imported
        from flowrl.models import MODEL_FAMILIES

        choose("model.family", m.family, tuple(MODEL_FAMILIES))
    choose("model.dtype", m.dtype, tuple(DTYPES))
    choose("model.shard", m.shard, ("auto", "ddp", "fsdp"))
    choose("model.shard_rollouts", m.shard_rollouts, ("per_block", "whole"))
    choose("model.compile", off_as_written(m.compile), ("off", "regional"))
    if off_as_written(m.compile) == "regional":
        from flowrl.models.blocks import check_compile_backend

        check_compile_backend()  # FLOWRL_COMPILE_BACKEND, before the model loads
    if m.checkpoint_blocks is not None:
        positive("model.checkpoint_blocks", m.checkpoint_blocks, allow_zero=True)
        if not m.gradient_checkpointing:
            raise ConfigError(
                f"model.checkpoint_blocks={m.checkpoint_blocks} is set but nothing reads it: "
                "model.gradient_checkpointing is false; set it true (or checkpoint_blocks null)"
            )
    positive("model.context_parallel.ulysses", m.context_parallel.ulysses)
    positive("model.context_parallel.ring", m.context_parallel.ring)
    positive("model.lora.rank", m.lora.rank)
    positive("model.lora.alpha", m.lora.alpha)
    within("model.lora.dropout", m.lora.dropout, 0.0, 1.0)
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(m.device)):
        raise ConfigError(f"model.device={shown(m.device)} is not supported; accepted: auto, cpu, mps, cuda, cuda:N")
    for key in ("guidance", "true_cfg"):
        if getattr(m, key) is not None:
            positive(f"model.{key}", getattr(m, key), allow_zero=True)
    for key in ("height", "width", "max_sequence_length", "prompt_cache_mb"):
        if getattr(m, key) is not None:
            positive(f"model.{key}", getattr(m, key))
    if m.true_cfg is not None and m.family not in ("flux", "flux_kontext"):
        raise ConfigError(
            f"model.true_cfg={m.true_cfg} is FLUX's real CFG; for model.family={m.family!r} use model.guidance"
        )


def check_loop_sections(cfg: Any) -> None:
    """The loop's own sections: rewards, optim, prompts, rollout's loop keys, eval and train."""
    choose("reward_normalize", cfg.reward_normalize, REWARD_NORMALIZE)
    if not cfg.rewards:
        raise ConfigError("rewards must list at least one reward, e.g. rewards: [{name: shapes}]")
    for i, term in enumerate(cfg.rewards):
        if not math.isfinite(term.weight):
            raise ConfigError(f"rewards[{i}].weight={term.weight} must be a finite number")
    check_optim(cfg.optim)
    positive("prompts.per_step", cfg.prompts.per_step)
    choose("prompts.sampling", cfg.prompts.sampling, ("epoch", "adaptive"))
    check_adaptive_settings(cfg.prompts.adaptive_floor, cfg.prompts.adaptive_decay)
    positive("rollout.max_batch", cfg.rollout.max_batch)
    positive("rollout.chunks", cfg.rollout.chunks)
    for key in ("every", "every_minutes", "grid_prompts"):
        positive(f"eval.{key}", getattr(cfg.eval, key), allow_zero=True)
    for key in ("steps", "images_per_prompt"):
        positive(f"eval.{key}", getattr(cfg.eval, key))
    for key in ("num_prompts", "height", "width"):  # None: all prompts, the model's size
        if getattr(cfg.eval, key) is not None:
            positive(f"eval.{key}", getattr(cfg.eval, key))
    check_train(cfg.train)


def check_optim(o: Any) -> None:
    """``optim.*``: the schedule, loss scaling, rates, betas and clipping."""
    choose("optim.schedule", o.schedule, ("constant", "linear", "cosine"))
    choose("optim.loss_scaling", str(o.loss_scaling).lower(), ("auto", "true", "false"))  # YAML true/false too
    positive("optim.lr", o.lr)
    positive("optim.grad_clip", o.grad_clip)  # ≤ 0 would reverse or zero every update
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    positive("optim.eps", o.eps)
    positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers, e.g. [0.9, 0.999]")
    for i, beta in enumerate(o.betas):
        within(f"optim.betas[{i}]", beta, 0.0, 1.0)


def check_train(t: Any) -> None:
    """``train.*``: logging, step and time limits, checkpoints, threads, the run's name, resume and EMA."""
    choose("train.log_with", t.log_with, ("none", "tensorboard", "wandb"))
    choose("train.async_reward", str(t.async_reward).lower(), ("auto", "true", "false"))  # YAML true/false too
    for key in ("max_steps", "max_minutes", "checkpoint_every", "keep_last"):
        positive(f"train.{key}", getattr(t, key), allow_zero=True)
    positive("train.inner_epochs", t.inner_epochs)
    positive("train.updates_per_epoch", t.updates_per_epoch)
    if t.num_threads is not None:
        positive("train.num_threads", t.num_threads)
    check_fit_keys(t)
    check_run_name(t.name)
    if t.overwrite and t.resume:
        raise ConfigError(
            f"train.overwrite=true replaces the run, train.resume={t.resume!r} continues it: set one of them"
        )
    if not 0.0 <= t.ema < 1.0:
        raise ConfigError(f"train.ema={t.ema} must be in [0, 1)")


def off_as_written(value: Any) -> str:
    """A switch's value as the user wrote it: YAML (and so ``key=off`` on the command line) reads a bare ``off`` as
    false, which a string key then holds as ``"False"``."""
    return "off" if str(value) == "False" else str(value)


FIT_KEYS = (
    "rollout.max_batch",
    "train.micro_batch",
    "model.gradient_checkpointing",
    "model.checkpoint_blocks",
    "model.offload_encoders",
)
"""The keys ``train.fit: auto`` chooses (:mod:`flowrl.estimate.fit`); ``train.fit_keep`` may name any of them."""


def check_fit_keys(t: Any) -> None:
    """``train.fit``, ``train.memory_fraction``, ``train.fit_keep``, ``train.micro_batch`` and ``train.peak_tflops``."""
    choose("train.fit", off_as_written(t.fit), ("off", "auto"))
    if not 0.0 < t.memory_fraction <= 1.0:
        raise ConfigError(
            f"train.memory_fraction={t.memory_fraction} must be in (0, 1] (the share of the device's "
            "memory the predicted peak may use)"
        )
    for key in t.fit_keep:
        choose("train.fit_keep", key, FIT_KEYS)
    if t.fit_keep and off_as_written(t.fit) == "off":
        raise ConfigError(
            f"train.fit_keep={list(t.fit_keep)} is set but nothing reads it: train.fit=off chooses nothing to keep; "
            "set train.fit=auto (or remove train.fit_keep)"
        )
    if t.micro_batch is not None:
        positive("train.micro_batch", t.micro_batch)
    if t.peak_tflops is not None:
        low, high = PEAK_TFLOPS
        positive("train.peak_tflops", t.peak_tflops)
        if not low <= t.peak_tflops <= high:
            raise ConfigError(
                f"train.peak_tflops={t.peak_tflops:g} must be in [{low:g}, {high:,g}] (TFLOP/s: the device's bf16 "
                "peak, which perf/mfu divides by; from a GFLOP/s, a small CPU, to 10 PFLOP/s, several times any "
                "GPU's), or null for the GPU table's (flowrl/estimate/gpus.py)"
            )


def check_components(cfg: Any, plan: Any, credit: Any, objective: Any) -> None:
    """The chosen plan, credit rule and objective of ``cfg`` (each checked its own fields when constructed), checked
    together: the objective against the plan and the credit rule, every key read or refused, the guidance. The
    objective is read through what it declares (:meth:`~flowrl.objectives.base.Objective.describe`)."""
    facts = objective.describe()
    facts.check_plan(plan)  # e.g. a policy objective on ODE rollouts
    plan.check_reward_normalize(cfg.reward_normalize)  # e.g. probed states need unnormalised rewards
    facts.check_credit(credit)  # e.g. step-level credit with a leaf objective
    for component in (plan, credit, objective):  # every key read or refused: each component names its unread ones
        unread = component.unread_keys()
        if unread:
            key, why = next(iter(unread.items()))
            read = [f"{component.config_key}.{f.name}" for f in component_fields(type(component))]
            refuse_key(
                key,
                [k for k in read if k not in unread],
                problem=f"is set but nothing reads it: {why}; remove it (or set what would read it)",
                suggest=False,
            )
    facts.rollout_guidance(cfg.model.guidance)  # e.g. CFG-free training with a guided rollout
    micro = cfg.train.micro_batch
    if micro is not None and facts.trains_on == "edges" and micro != cfg.rollout.max_batch:
        raise ConfigError(
            f"train.micro_batch={micro}: loss.objective replays the rollout's edges in the rollout's "
            f"own forwards (rollout.max_batch={cfg.rollout.max_batch} states each, so a replay equals "
            "its rollout); accepted: null or the same value as rollout.max_batch"
        )


def guard_names(cfg: Any) -> list[str]:
    """The names ``eval.guard.reward`` accepts: each eval reward term's label, else its name as written (the terms
    of ``eval.rewards``, else of ``rewards`` when the eval scores with the training rewards)."""
    return [t.label or t.name for t in (cfg.eval.rewards or cfg.rewards)]


def check_guard_reward(reward: str, names: list[str], whose: str = "eval.rewards") -> None:
    """``eval.guard.reward`` one of ``names`` (:func:`guard_names`: the eval reward terms as written in ``whose``),
    else refused as every key is (:func:`refuse_key`). The one check of it: at load (:func:`check_guard`), and by
    :meth:`flowrl.training.guard.EvalGuard.build` against the same names when a guard is built without a config."""
    if reward not in names:
        refuse_key(
            "eval.guard.reward",
            names,
            f"the eval rewards (the terms of {whose}: a term's label, else its name as written)",
            value=reward,
            problem="is not one of",
            near=reward,
        )


def check_guard(cfg: Any) -> None:
    """``eval.guard``: a margin >= 0; with a reward, one of the eval rewards, periodic evals to check it at
    (``eval.every`` or ``eval.every_minutes``) and held-out prompts to evaluate."""
    guard = cfg.eval.guard
    positive("eval.guard.max_drop", guard.max_drop, allow_zero=True)
    if guard.reward is None:
        return
    whose = "eval.rewards" if cfg.eval.rewards else "rewards (eval.rewards is null: the eval scores with them)"
    check_guard_reward(guard.reward, guard_names(cfg), whose)
    if not cfg.eval.every and not cfg.eval.every_minutes:
        raise ConfigError(
            f"eval.guard.reward={shown(guard.reward)} is checked at the periodic evals, and eval.every=0 "
            "with eval.every_minutes=0 runs none; accepted: eval.every >= 1 (iterations between evals) "
            "or eval.every_minutes > 0"
        )
    if not cfg.prompts.eval:
        raise ConfigError(
            f"eval.guard.reward={shown(guard.reward)} needs held-out prompts to evaluate, and prompts.eval "
            "is null; accepted: a prompt file or inline 'a|b|c'"
        )


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    """``value`` is a finite number, > 0 (or >= 0 with ``allow_zero``); the error says which of the two it is not."""
    if not math.isfinite(value):
        raise ConfigError(
            f"{key}={value} must be a finite number {'>= 0' if allow_zero else '> 0'} (inf and nan are "
            "not limits flowrl can check against)"
        )
    if value < 0 or (value == 0 and not allow_zero):
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
        raise ConfigError(
            f"train.name={shown(name)} must be one folder name inside train.output_dir: not empty, "
            "not '.' or '..', without '/', '\\' or NUL (e.g. train.name=shapes-nft)"
        )
