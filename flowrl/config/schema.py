"""Typed configuration: one dataclass per section, YAML files plus ``key=value`` overrides.

``TrainConfig.from_yaml(path, overrides)`` merges the YAML into the schema with OmegaConf; a key
that does not exist fails at once naming the nearest valid key, a value of the wrong type names
the key, the value and the expected type, and semantic checks (choices, ranges) run when the
components are built (they name the key too).

The ``rollout``, ``credit`` and ``loss`` sections belong to the components they select
(``rollout.plan``, ``credit.rule``, ``loss.objective``; see :mod:`flowrl.core.components`): their keys are
the chosen component's dataclass fields, so the schema is assembled per config by
:meth:`TrainConfig.schema` before the YAML is merged into it.

The schema's own sections are the dataclasses of :mod:`flowrl.config.model_section` and :mod:`flowrl.config.sections`
(re-exported here). Every field of them carries its help, ``field(..., metadata={"help": ...})``: ``flowrl train
--help`` prints it beside each key's value and docs/keys.md is generated from it (:mod:`flowrl.config.help`, which
also says where the component sections' help comes from).
"""

from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from flowrl.config import keys
from flowrl.config.model_section import (  # noqa: F401 (re-exported)
    ContextParallelSection,
    LoraSection,
    ModelSection,
)
from flowrl.config.secrets import redacted, refuse_redacted
from flowrl.config.sections import (  # noqa: F401 (re-exported: importers take the sections from here)
    EvalSection,
    GuardSection,
    OptimSection,
    PromptsSection,
    RewardTerm,
    TrainSection,
)
from flowrl.core import components
from flowrl.errors import ConfigError, shown, shown_message
from flowrl.paths import find_file, where_tried

RolloutSection = components.section_schema(components.PLAN, components.PLAN.default)
CreditSection = components.section_schema(components.CREDIT, components.CREDIT.default)
LossSection = components.section_schema(components.LOSS, components.LOSS.default)


@dataclass
class TrainConfig:
    """The whole run. ``rollout``/``credit``/``loss`` hold the default components' sections here; a
    config that selects others is loaded into :meth:`schema`'s subclass with their sections."""

    model: ModelSection = field(default_factory=ModelSection, metadata={"help": ModelSection.__doc__})
    rollout: RolloutSection = field(
        default_factory=RolloutSection,
        metadata={"help": "the rollout plan (rollout.plan) and its keys: how each iteration samples its forests"},
    )
    rewards: list[RewardTerm] = field(
        default_factory=lambda: [RewardTerm(name="shapes")],
        metadata={"help": "the reward terms scored on every sample, combined by their weights (docs/rewards.md)"},
    )
    reward_normalize: str = field(
        default="none", metadata={"help": "none | batch | group: how MultiReward combines several rewards"}
    )
    credit: CreditSection = field(
        default_factory=CreditSection,
        metadata={"help": "the credit rule (credit.rule) and its keys: advantages from the rewards"},
    )
    loss: LossSection = field(
        default_factory=LossSection,
        metadata={"help": "the objective (loss.objective) and its keys: the loss the update minimises"},
    )
    optim: OptimSection = field(default_factory=OptimSection, metadata={"help": OptimSection.__doc__})
    prompts: PromptsSection = field(default_factory=PromptsSection, metadata={"help": PromptsSection.__doc__})
    eval: EvalSection = field(default_factory=EvalSection, metadata={"help": EvalSection.__doc__})
    train: TrainSection = field(default_factory=TrainSection, metadata={"help": TrainSection.__doc__})

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def schema(cls, plan: str | None = None, rule: str | None = None, objective: str | None = None) -> type:
        """The TrainConfig subclass whose ``rollout``/``credit``/``loss`` sections are the schemas of
        the named components (defaults: chains, group, clipped)."""
        return _schema(
            plan or components.PLAN.default, rule or components.CREDIT.default, objective or components.LOSS.default
        )

    @classmethod
    def from_yaml(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "TrainConfig":
        """Schema ← YAML file (optional) ← ``key=value`` overrides; returns a validated TrainConfig."""
        loaded = None
        if path is not None:
            found = find_file(path)
            if found is None:
                raise ConfigError(f"config file {str(path)!r} does not exist (looked in {where_tried(path)})")
            path = found
            loaded = keys.load_yaml(path)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        if loaded is not None:
            _check_sections(loaded, path)
        schema = cls.schema(**keys.selected_components(loaded, overrides or []))
        base = _defaults(schema)  # shared: read here, copied by the merge
        try:  # the file, then each override (one may index into a list: rewards.1.kwargs.x=…), every key checked
            base = keys.merge_layers(base, loaded, path, list(overrides or []), schema)
        except ValidationError as e:
            raise ConfigError(f"config key {e.full_key!r}: {shown_message(str(e.msg).splitlines()[0])}") from None
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from None
        missing = OmegaConf.missing_keys(base)
        if missing:
            raise ConfigError(f"config keys {sorted(missing)} must be set")
        cfg = OmegaConf.to_object(base)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Every value, with the rewards' secrets redacted (:mod:`flowrl.config.secrets`): what checkpoints, run folders
        and trackers keep."""
        return redacted(asdict(self))

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"rollout.kernel": "flow_grpo", ...}`` with lists and None as strings (for trackers' hparams)."""

        def flat(tree: Any, prefix: str) -> dict[str, Any]:
            if isinstance(tree, dict):
                return {
                    k: v
                    for key, sub in tree.items()
                    for k, v in flat(sub, f"{prefix}.{key}" if prefix else key).items()
                }
            return {prefix: tree if isinstance(tree, (int, float, str, bool)) else str(tree)}

        return flat(self.to_dict(), "")

    def to_yaml(self) -> str:
        """The config as YAML (``runs/<name>/config.yaml``), the rewards' secrets redacted."""
        return OmegaConf.to_yaml(OmegaConf.create(self.to_dict()))

    def validate(self) -> None:
        """Checks that need no model: choices and ranges, each naming its key (:mod:`flowrl.config.checks`)."""
        from flowrl.config.bounds import check_sizes
        from flowrl.config.checks import check_config, check_guard, positive
        from flowrl.config.chosen import load_components
        from flowrl.config.pipeline import check_pipeline_config

        check_config(self)
        refuse_redacted(asdict(self))  # a run's saved config used again: its secrets are asked for again
        load_components(self)  # the plan, credit rule and objective, built and checked once, kept for the trainer
        check_sizes(self)  # step counts within their stated maxima (flowrl/config/bounds.py)
        check_guard(self)  # eval.guard: its reward among the eval rewards, periodic evals to check it at
        check_pipeline_config(self)  # train.pipeline=async: its keys, and what cannot train off-policy
        if self.train.max_failed_iterations < 1:
            raise ConfigError(
                f"train.max_failed_iterations={self.train.max_failed_iterations} must be >= 1 "
                "(iterations in a row with every reward failed before the run stops)"
            )
        for key, terms in (("rewards", self.rewards), ("eval.rewards", self.eval.rewards or [])):
            for i, term in enumerate(terms):
                if term.timeout is not None:
                    positive(f"{key}[{i}].timeout", term.timeout)  # seconds


def _check_sections(loaded: Any, path: Path) -> None:
    """A config file is a mapping, and each section (``model``, ``rollout``, …) a mapping too."""
    tree = OmegaConf.to_container(loaded)
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{path}: a config is a mapping of sections (model:, rollout:, loss:, …), got a {type(tree).__name__}"
        )
    mappings = {
        f.name for f in fields(TrainConfig) if f.default_factory is not NO_DEFAULT and is_dataclass(f.default_factory())
    }
    for key, value in tree.items():
        if key in mappings and value is not None and not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} in {path} is a section of keys ({key}.…), got {shown(value)}")
        if key in ("rewards",) and value is not None and not isinstance(value, list):
            raise ConfigError(
                f"config key 'rewards' in {path} is a list of rewards, e.g. [{{name: shapes}}], got {shown(value)}"
            )


@lru_cache(maxsize=None)
def _defaults(schema: type) -> Any:
    """``OmegaConf.structured(schema)``, built once per schema (15 ms, a third of a config's load) and never
    changed: :meth:`TrainConfig.from_yaml` merges into a copy of it."""
    return OmegaConf.structured(schema)


@lru_cache(maxsize=None)
def _schema(plan: str, rule: str, objective: str) -> type:
    sections = {
        kind.section: components.section_schema(kind, name)
        for kind, name in zip(components.KINDS, (plan, rule, objective))
    }
    if (plan, rule, objective) == tuple(k.default for k in components.KINDS):
        return TrainConfig
    return make_dataclass(
        "TrainConfig",
        [(name, schema, field(default_factory=schema)) for name, schema in sections.items()],
        bases=(TrainConfig,),
    )
