"""The components a config chooses (``rollout.plan``, ``credit.rule``, ``loss.objective``): built from their sections
and checked together. At load (:meth:`~flowrl.config.schema.TrainConfig.validate` calls :func:`load_components`) they
are built, checked and let go, so a bad key fails before any model loads; a run builds its own
(:func:`build_components`), from the sections as they are then. A config never carries built components, and no two
runs share one. A config is read by attribute here: this module imports neither the schema nor the model code."""

from __future__ import annotations

from typing import Any, NamedTuple

from flowrl.config.checks import check_components
from flowrl.core import components


class Components(NamedTuple):
    """What one run is made of, beside its model and rewards."""

    plan: Any
    credit: Any
    objective: Any


def build_plan(section: Any):
    """The rollout plan ``rollout.plan`` names, built from the section's values of its fields."""
    return components.instantiate(components.PLAN, section)


def build_credit(cfg: Any):
    """The credit rule ``credit.rule`` names."""
    return components.instantiate(components.CREDIT, cfg.credit)


def build_loss(cfg: Any):
    """The objective ``loss.objective`` names, with its rows per training forward, its declared ``micro_batch``
    (``train.micro_batch``, default ``rollout.max_batch``; a policy objective replays the rollout's own forwards of
    ``rollout.max_batch`` states)."""
    objective = components.instantiate(components.LOSS, cfg.loss)
    objective.micro_batch = int(cfg.train.micro_batch or cfg.rollout.max_batch)  # a field of every Objective
    return objective


def build_components(cfg: Any) -> Components:
    """(plan, credit rule, objective) of ``cfg``, built and checked together (:func:`check_components`)."""
    built = Components(build_plan(cfg.rollout), build_credit(cfg), build_loss(cfg))
    check_components(cfg, *built)
    return built


def load_components(cfg: Any) -> None:
    """At load: build and check ``cfg``'s components (a ConfigError naming the key), keeping nothing."""
    build_components(cfg)
