"""The checks a run makes at load, made by the estimate too: a config ``flowrl train`` refuses before its model loads,
``flowrl bench --estimate`` (and ``train.fit: auto``) refuses with the run's words, first and alone, instead of
estimating it.

What a run checks before its model loads (:class:`~flowrl.training.trainer.Trainer`), and where the estimate does:

- the config's own checks (:meth:`~flowrl.config.schema.TrainConfig.validate`): when the config loads;
- the processes (:func:`check_processes`, first in :func:`~flowrl.estimate.iteration.estimate`): context
  parallelism's degree divides them and ``prompts.per_step`` the data replicas; the sharding settings
  (:func:`check_launch` for a run's own launch, :func:`~flowrl.estimate.sharding.shard_mode` for ``--gpus``/``--shard``)
  and an objective that can run sharded;
- what the adapter refuses when it is built, decided by the architecture (:func:`check_model_options`): the experts of
  a one-expert Wan model, Qwen-Image-Edit-Plus's ``max_images`` and ``condition_area``;
- the prompts and rewards (:func:`check_prompts_and_rewards`): every line of ``prompts.train`` and ``prompts.eval``
  carries source images exactly as the model and rewards need them, at most as many as the model takes
  (Qwen-Image-Edit-Plus: ``model.kwargs.max_images``), each one opening; a video reward of an image model.

Not made here, as they need what an estimate does not build: the rewards themselves (their weights, whether each can
score every prompt, a server that answers), the run folder (``train.resume``, ``train.overwrite``) and a teacher's
weights. A prompt file that is not on this machine is not read (said, not refused: the estimate is made before the
data is where the run will be).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from flowrl.distributed.context_parallel import check_context_parallel, context_degree
from flowrl.errors import ConfigError, shown


def check_processes(cfg, processes: int) -> int:
    """The data replicas of ``cfg`` over ``processes``, after the run's checks: the context-parallel degree divides
    the processes (named as such, before anything else) and ``prompts.per_step`` the replicas."""
    check_context_parallel(cfg, processes)
    replicas = processes // context_degree(cfg.model.context_parallel)
    if processes < 1 or replicas < 1 or cfg.prompts.per_step % replicas:
        raise ConfigError(
            f"prompts.per_step={cfg.prompts.per_step} must be divisible by the data replicas ({max(replicas, 0)} of "
            f"{processes} processes)"
        )
    return replicas


def check_launch(cfg, processes: int) -> None:
    """A run's own launch over ``processes`` (``WORLD_SIZE``), checked as its trainer checks it before the model
    loads: :func:`check_processes` and the sharding settings ``model.shard`` resolves to."""
    from flowrl.distributed.sharding import check_shard_settings, resolve_shard

    check_processes(cfg, processes)
    check_shard_settings(cfg, processes, resolve_shard(cfg.model.shard))


def check_model_options(cfg, arch: dict) -> None:
    """What the ``model.family`` adapter refuses when built from this architecture, refused before any estimate:
    ``model.experts`` (or ``model.kwargs.guidance_2``) on a model of one transformer (only Wan 2.2 A14B has two), and
    an edit adapter's ``max_images`` below 1 or ``condition_area`` below 32 × 32 px."""
    m = cfg.model
    kwargs = dict(m.kwargs or {})
    if not arch.get("transformer_2") and (m.experts is not None or kwargs.get("guidance_2") is not None):
        key, value = ("model.experts", m.experts) if m.experts is not None else ("model.kwargs.guidance_2", None)
        value = m.experts if m.experts is not None else kwargs["guidance_2"]
        raise ConfigError(
            f"{key}={shown(value)} applies to a two-expert Wan 2.2 pipeline (transformer_2 and boundary_ratio: "
            f"Wan2.2-T2V-A14B, Wan2.2-I2V-A14B); {arch['name']} (model.path={shown(m.path)}) has one transformer: "
            "leave it unset"
        )
    sources = source_limits(m.family, kwargs)
    if sources is not None:
        most, area = sources
        if most < 1:
            raise ConfigError(f"model.kwargs.max_images={most}: must be ≥ 1 (the most source images a prompt has)")
        if area < 32 * 32:
            raise ConfigError(
                f"model.kwargs.condition_area={area}: must be ≥ 1024 pixels (32 × 32, the smallest condition image); "
                "the pipeline's is 147456 (384²)"
            )


def source_limits(family: str, kwargs: dict) -> tuple[int, int] | None:
    """(``max_images``, ``condition_area``) of an adapter that takes several source images per prompt, as a run with
    ``model.kwargs`` = ``kwargs`` builds it (the kwargs, else the adapter's defaults); None for any other family."""
    from flowrl.models import model_family

    params = inspect.signature(model_family(family).adapter_class()).parameters
    if "max_images" not in params:
        return None
    values = []
    for key in ("max_images", "condition_area"):
        value = kwargs.get(key, params[key].default)
        try:
            values.append(int(value))
        except (TypeError, ValueError):
            raise ConfigError(f"model.kwargs.{key}={shown(value)} must be a whole number") from None
    return values[0], values[1]


def _reward_stand_in(name: str):
    """What the load checks read of a reward term, from its class alone (no weights loaded): its name as the run
    names it, ``modality`` and ``needs_source_image``, under the class's own name."""
    from flowrl_rewards import Reward
    from flowrl_rewards.core.registry import resolve_reward_class

    cls = resolve_reward_class(name)
    modality = cls.__dict__.get("modality", None)
    modality = modality if isinstance(modality, str) else getattr(cls, "modality", "image")
    needs = getattr(cls, "needs_source_image", False)
    shown_name = cls.name if cls.name != Reward.name else (name.rsplit(":", 1)[-1] if ":" in name else name)
    attrs = {
        "name": shown_name,
        "modality": modality if isinstance(modality, str) else "image",
        "needs_source_image": needs if isinstance(needs, bool) else False,
    }
    return type(cls.__name__, (), attrs)()


def check_prompts_and_rewards(cfg) -> list[str]:
    """The run's prompt and reward checks that need no built reward nor model, with the run's own functions: every
    line of ``prompts.train`` / ``prompts.eval`` carries source images exactly when the model edits or a reward
    compares with one, at most as many as the model takes, each opening
    (:func:`flowrl.prompts.checks.check_prompt_images`); no video reward of an image model
    (:func:`flowrl.training.scoring.check_modality`). Returns notes on what could not be read here (a prompt file
    that is not on this machine)."""
    from flowrl.models import model_family
    from flowrl.prompts.checks import check_prompt_images
    from flowrl.training.scoring import check_modality

    adapter = model_family(cfg.model.family).adapter_class()
    train = SimpleNamespace(terms=[_reward_stand_in(t.name) for t in cfg.rewards])
    held_out = train
    if cfg.eval.rewards:
        held_out = SimpleNamespace(terms=[_reward_stand_in(t.name) for t in cfg.eval.rewards])
    check_modality(
        SimpleNamespace(modality=adapter.modality, family=cfg.model.family),
        [("rewards", train), ("eval.rewards", held_out)],
    )
    sources = source_limits(cfg.model.family, dict(cfg.model.kwargs or {}))
    most = adapter.source_images if sources is None else sources[0]
    notes = []
    specs = (("prompts.train", cfg.prompts.train, train), ("prompts.eval", cfg.prompts.eval, held_out))
    for key, spec, rewards in specs:
        if not spec:
            continue
        try:
            check_prompt_images(
                spec,
                key,
                edits=bool(adapter.takes_source_image),
                family=cfg.model.family,
                rewards=rewards.terms,
                most=most,
            )
        except FileNotFoundError:  # the prompt file: the run reads it where it runs
            notes.append(f"{key}={shown(spec)} is not on this machine: its lines were not checked (a run checks each)")
    return notes
