"""The components a config chooses (``rollout.plan``, ``credit.rule``, ``loss.objective``): built from their sections
and checked together once, at load (:meth:`~flowrl.config.schema.TrainConfig.validate` calls :func:`load_components`),
then handed to the run (:func:`take_components`). A config is read by attribute here: this module imports neither
the schema nor the model code."""
from __future__ import annotations

import dataclasses
from typing import Any

from flowrl.config import components
from flowrl.config.checks import check_components


def build_plan(section: Any):
    """The rollout plan ``rollout.plan`` names, built from the section's values of its fields."""
    return components.instantiate(components.PLAN, section)


def build_credit(cfg: Any):
    """The credit rule ``credit.rule`` names."""
    return components.instantiate(components.CREDIT, cfg.credit)


def build_loss(cfg: Any):
    """The objective ``loss.objective`` names, with its rows per training forward (``train.micro_batch``, default
    ``rollout.max_batch``; a policy objective replays the rollout's own forwards of ``rollout.max_batch`` states)."""
    objective = components.instantiate(components.LOSS, cfg.loss)
    objective.micro_batch = int(cfg.train.micro_batch or cfg.rollout.max_batch)
    return objective


def components_key(cfg: Any) -> str:
    """What the components are built from: the rollout, credit and loss sections (and the objective's micro-batch)."""
    return repr([dataclasses.asdict(cfg.rollout), dataclasses.asdict(cfg.credit), dataclasses.asdict(cfg.loss),
                 cfg.train.micro_batch])


def build_and_check(cfg: Any) -> tuple:
    """(plan, credit rule, objective) of ``cfg``, built and checked together (:func:`check_components`)."""
    built = (build_plan(cfg.rollout), build_credit(cfg), build_loss(cfg))
    check_components(cfg, *built)
    return built


def load_components(cfg: Any) -> None:
    """At load: build and check ``cfg``'s components, and keep them beside the config (not a config value) for the
    first :func:`take_components` while its sections stay as they were."""
    object.__setattr__(cfg, "_loaded_components", (components_key(cfg), build_and_check(cfg)))


def take_components(cfg: Any) -> tuple:
    """(plan, credit rule, objective) of ``cfg``: those built and checked when it was loaded, once and only while its
    sections are unchanged; else (a second run of one config, a config changed since) built and checked now. Each
    component is so built and checked once per run, and no two runs share one."""
    loaded = cfg.__dict__.pop("_loaded_components", None)
    if loaded is not None and loaded[0] == components_key(cfg):
        return loaded[1]
    return build_and_check(cfg)
