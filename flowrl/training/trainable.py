"""What a run trains, what its objective starts from and the runner that rolls it out, set up the same way wherever a
copy of the policy is built:
the trainer, and the rollout process of ``train.pipeline=async`` (:mod:`flowrl.training.pipeline`), whose weights
must line up with the trainer's parameter for parameter."""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.config import build
from flowrl.config.schema import ConfigError, ModelSection
from flowrl.core.seeding import derive_seed
from flowrl.models.base import FlowModel
from flowrl.run.checkpoint import load_weights, weights_folder


def setup_trainable(model: FlowModel, section: ModelSection, seed: int) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates, in a fixed order: the whole transformer (``model.full_finetune``, its
    weights in fp32) or the LoRA ``model.lora`` describes (initialised from ``seed``, so two processes that build it
    draw the same adapters). Refuses a setup that trains nothing."""
    torch.manual_seed(derive_seed(seed, "init") % (2**31))  # LoRA init draws from the global RNG
    module = model.trainable
    if section.full_finetune:
        from flowrl.models.dtypes import master_weights_fp32

        master_weights_fp32(model)  # fp32 weights, forward under autocast in model.dtype (no-op in fp32)
        module = model.trainable
        module.requires_grad_(True)
    else:
        build.add_lora(model, section)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("no trainable parameters: check model.lora.targets")
    return params


def rollout_runner(cfg, plan, model, reward, objective, prompts=None, group=None, guidance: float = 1.0):
    """The :class:`~flowrl.rollout.runner.RolloutRunner` of a run of ``cfg``: ``plan`` over ``model``, scored by
    ``reward``, with the objective's reduction and sampling teacher (``prompts``/``group``: the trainer's, to draw
    each iteration's prompt groups; None in a rollout process, which is handed them)."""
    from flowrl.rollout.runner import RolloutRunner

    return RolloutRunner(
        plan,
        model,
        reward,
        prompts,
        group,
        seed=cfg.train.seed,
        guidance=guidance,
        max_batch=cfg.rollout.max_batch,
        chunks=cfg.rollout.chunks,
        reduction=objective.reduction,
        teacher=objective.sampling_teacher(),
        async_reward={"auto": "auto", "true": True, "false": False}[str(cfg.train.async_reward).lower()],
    )


def teacher_weights(objective) -> dict[str, Callable]:
    """``{"teacher_weights": loader}`` for an objective whose teacher starts from a folder's weights (its
    ``teacher_path``: a run folder, a checkpoint or a pipeline folder, resolved and verified here, before any model
    loads), else ``{}``: the keywords of ``objective.setup``."""
    path = objective.describe().teacher_path
    if path is None:
        return {}
    folder = weights_folder(path, "loss.teacher.path")
    return {"teacher_weights": lambda model: load_weights(model, folder)}
