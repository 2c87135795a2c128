"""The checks at load of ``train.pipeline`` and its keys (docs/pipeline.md): what an asynchronous run needs that a
config alone says, before any model loads. What needs the built run (a model given in code, sharded training) is
refused by :func:`flowrl.training.pipeline.check_pipeline`."""

from __future__ import annotations

from typing import Any

from flowrl.core.choices import choose
from flowrl.errors import ConfigError

PIPELINES = ("sync", "async")
# objectives whose loss reads the sampling policy's weights themselves (not values the rollout recorded), so they
# cannot train on a forest sampled by older weights: objective → why
ON_POLICY_ONLY = {
    "grpo_guard": "its normalised ratio needs the transition means of the weights that sampled the forest, which "
    "the rollout does not record: it takes them from the policy at the start of each iteration",
}


def check_pipeline_config(cfg: Any) -> None:
    """``train.pipeline`` among :data:`PIPELINES`; its counts in range; with ``async`` and a staleness above 0, no
    objective of :data:`ON_POLICY_ONLY` and no adaptive prompt sampling (each batch depends on the spreads of the
    iteration before it); the async-only keys unset under ``sync``."""
    t = cfg.train
    choose("train.pipeline", t.pipeline, PIPELINES)
    for key, value, least in (
        ("train.max_staleness", t.max_staleness, 0),
        ("train.rollout_processes", t.rollout_processes, 0),
        ("train.rollout_threads", t.rollout_threads, 1),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{key}={value} must be >= {least}")
    if t.pipeline == "sync":
        for key, value in (
            ("train.rollout_threads", t.rollout_threads),
            ("train.rollout_processes", t.rollout_processes),
        ):
            if value:
                raise ConfigError(
                    f"{key}={value} is set but nothing reads it: it applies to train.pipeline='async' (the pipeline is "
                    "'sync')"
                )
        return
    if t.max_staleness == 0:
        return
    objective = str(cfg.loss.objective)
    if objective in ON_POLICY_ONLY:
        raise ConfigError(
            f"loss.objective={objective!r} cannot train off-policy ({ON_POLICY_ONLY[objective]}), but "
            f"train.pipeline='async' with train.max_staleness={t.max_staleness} samples each forest from weights "
            f"{t.max_staleness} update(s) old; use train.max_staleness=0 or train.pipeline='sync'"
        )
    if getattr(cfg.prompts, "sampling", "epoch") == "adaptive":
        raise ConfigError(
            f"prompts.sampling='adaptive' draws each batch from the reward spreads of the iteration before it, but "
            f"train.pipeline='async' with train.max_staleness={t.max_staleness} decides a batch "
            f"{t.max_staleness + 1} iterations ahead; use prompts.sampling='epoch', train.max_staleness=0 or "
            "train.pipeline='sync'"
        )
