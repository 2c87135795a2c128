"""A model with a run's trained weights: the config of a run folder or checkpoint (or of a config file), the
model it builds with the checkpoint's weights and the guidance its policy was trained to sample with. What
``flowrl sample``, ``flowrl eval`` (``--benchmark`` too) and ``flowrl export`` load. And a run's model over random
weights of a stored architecture (:func:`random_model`: the GPU check's real-size models)."""

from __future__ import annotations

from flowrl.config.schema import TrainConfig
from flowrl.paths import DEFAULT_CONFIG


def run_config(run: str | None, config: str | None, overrides: list[str]):
    """(config, checkpoint folder or None) of a run folder or checkpoint (its config.yaml unless ``config``
    names one), or of a config (the shapes preset by default)."""
    from flowrl.run.checkpoint import find_checkpoint

    ckpt = None
    if run is not None:
        ckpt, run_dir = find_checkpoint(run)
        config = config or str(run_dir / "config.yaml")
    return TrainConfig.from_yaml(config or DEFAULT_CONFIG, overrides), ckpt


def load_model(cfg: TrainConfig, ckpt, device=None):
    """(model, policy guidance): ``cfg``'s model on ``device`` (default ``model.device``) with the weights of
    ``ckpt`` and the guidance its policy was trained to sample with (None without a checkpoint, or for one
    that does not record it)."""
    from flowrl.config import build
    from flowrl.run.checkpoint import load_weights, read_state

    model = build.build_model(cfg.model, device)
    if ckpt is None:
        return model, None
    if not cfg.model.full_finetune:
        build.add_lora(model, cfg.model)
    load_weights(model, ckpt)
    return model, read_state(ckpt).get("policy_guidance")


def model_from_run(run: str | None, config: str | None, overrides: list[str]):
    """(config, model, policy guidance) for a run folder or checkpoint, or for a config (guidance None)."""
    cfg, ckpt = run_config(run, config, overrides)
    return (cfg, *load_model(cfg, ckpt))


def random_model(section, device, arch: dict):
    """The :class:`~flowrl.models.base.FlowModel` of the ``model`` section ``section`` (its LoRA not yet attached,
    as :func:`flowrl.config.build.build_model` returns it) over :func:`flowrl.models.random_init.random_pipeline` of
    ``arch`` (a stored architecture, :func:`flowrl.models.architectures.load_arch`, or
    :func:`flowrl.models.random_init.tiny_arch`), built on ``device``."""
    import torch

    from flowrl.config import build
    from flowrl.models.random_init import random_section

    return build.build_model(random_section(section, arch), torch.device(device))
