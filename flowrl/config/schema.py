"""Typed configuration: one dataclass per section, YAML files plus ``key=value`` overrides.

``TrainConfig.from_yaml(path, overrides)`` merges the YAML into the schema with OmegaConf; a key
that does not exist fails at once naming the nearest valid key, a value of the wrong type names
the key, the value and the expected type, and semantic checks (choices, ranges) run when the
components are built (they name the key too).

The ``rollout``, ``credit`` and ``loss`` sections belong to the components they select
(``rollout.plan``, ``credit.rule``, ``loss.objective``; see :mod:`flowrl.core.components`): their keys are
the chosen component's dataclass fields, so the schema is assembled per config by
:meth:`TrainConfig.schema` before the YAML is merged into it.
"""

from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from flowrl.config import keys
from flowrl.config.secrets import redacted, refuse_redacted
from flowrl.core import components
from flowrl.errors import ConfigError, shown, shown_message
from flowrl.paths import find_file, where_tried


@dataclass
class LoraSection:
    rank: int = 32
    alpha: float = 64.0
    targets: Optional[list[str]] = None  # None → the adapter's defaults
    dropout: float = 0.0
    init: str = "gaussian"


@dataclass
class ContextParallelSection:
    """``model.context_parallel``: each sample's token sequence split over ``ulysses`` × ``ring`` processes (diffusers'
    context parallel; docs/video.md); 1 × 1 = off."""

    ulysses: int = 1  # Ulysses degree: an all-to-all hands each process a share of the heads over the whole sequence
    ring: int = 1  # ring-attention degree: key/value blocks passed around the processes


@dataclass
class ModelSection:
    family: str = "shapes"  # shapes | sd3 | flux | sana
    path: Optional[str] = None  # hub id or local folder; None → the shipped shapes model
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    guidance: Optional[float] = (
        None  # CFG scale for rollouts (FLUX: the distilled guidance value); None → model default
    )
    true_cfg: Optional[float] = None  # FLUX only: real classifier-free guidance scale (1 = off)
    height: Optional[int] = None
    width: Optional[int] = None
    max_sequence_length: Optional[int] = None
    lora: LoraSection = field(default_factory=LoraSection)
    full_finetune: bool = False
    gradient_checkpointing: bool = False
    checkpoint_blocks: Optional[int] = None  # with gradient_checkpointing: how many transformer blocks recompute their
    # forward in the backward (the first N in execution order; null = every block); train.fit chooses it
    compile: str = "off"  # off | regional: torch.compile each transformer block (every block kind compiled once;
    # flowrl/models/blocks.py)
    prompt_cache_mb: Optional[float] = 1024.0  # prompt embeddings kept on the device (LRU); null = unbounded
    kwargs: dict[str, Any] = field(default_factory=dict)  # the adapter's other keywords, e.g. SANA's
    # complex_human_instruction or negative_prompt (passed through; one the adapter's signature lacks fails at load)
    shard: str = "auto"  # ddp (every process a full copy, gradients averaged) | fsdp (FSDP2: weights, gradients and
    # optimizer state sharded over the processes; docs/gpu.md) | auto: fsdp under accelerate's FSDP plugin
    # (configs/accelerate/fsdp.yaml), else ddp
    experts: Optional[str] = None  # Wan 2.2 A14B's two experts: which trains (high | low | both; the other frozen);
    # null = both (docs/models/wan.md)
    context_parallel: ContextParallelSection = field(default_factory=ContextParallelSection)
    shard_rollouts: str = "per_block"  # fsdp: per_block (each forward gathers block by block: least memory) |
    # whole (the whole transformer gathered once around each rollout: faster, a full copy while sampling)
    offload_encoders: bool = (
        False  # text encoders in CPU memory between uses (moved to the device to encode new prompts)
    )
    cudnn_attention: bool = False  # CUDA: let torch pick its cuDNN attention kernel (off: its backward failed for
    # FLUX.1-dev on an H200; flowrl/models/attention.py)


@dataclass
class RewardTerm:
    name: str = MISSING  # registry name, "package.module:Class" or "path/to/file.py:Class"
    weight: float = 1.0
    label: Optional[str] = None  # metric name (to use one reward twice with different kwargs)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward's settings (its constructor's keywords) and the
    # combiner's frame_stride; each key checked at load (flowrl train --help lists them with their defaults)
    timeout: Optional[float] = None  # seconds one call may take; past it that call's scores are NaN (reward_failed)


@dataclass
class OptimSection:
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | linear | cosine
    grad_clip: float = 1.0
    use_8bit: bool = False
    loss_scaling: str = "auto"  # dynamic loss scaling: auto (on when the transformer computes in fp16) | true | false


@dataclass
class PromptsSection:
    train: str = "configs/shapes/prompts/train.txt"  # a .txt file (one per line) or inline "a|b|c"
    eval: Optional[str] = "configs/shapes/prompts/eval.txt"
    per_step: int = 8  # prompt groups per iteration over all processes
    sampling: str = "epoch"  # epoch (seeded permutations) | adaptive (∝ recent reward spread per difficulty key)
    difficulty_key: str = "prompt"  # adaptive: pool statistics by prompt | shapes_task | module:function
    adaptive_floor: float = 0.1  # adaptive: least draw weight of a key, relative to an average one
    adaptive_decay: float = 0.7  # adaptive: weight of the old spread in each key's moving average


@dataclass
class GuardSection:
    """``eval.guard``: a guard against reward hacking. At every eval after the first, the held-out mean of one eval
    reward (``eval/<name>_mean``, the main pass) is compared with its value at the start (the eval before training);
    when it falls by more than ``max_drop`` the run saves a checkpoint and stops (``flowrl train`` exits with
    status 4). One mapping rather than flat ``eval.guard_*`` keys: its settings mean something only together,
    ``reward: null`` turns the whole guard off, and ``flowrl train --help`` lists them as one block."""

    reward: Optional[str] = None  # an eval reward term (its label, else its name as written); null = no guard
    max_drop: float = 0.05  # the largest fall below the start value allowed (>= 0; in the reward's units)
    relative: bool = False  # true: max_drop is a fraction of |start value| (0.1 = a 10% fall)


@dataclass
class EvalSection:
    every: int = 0  # iterations between evals (0 = only at start and end)
    every_minutes: float = 0.0  # also evaluate each time this much training time has passed (evals excluded; 0 = off)
    at_start: bool = True
    steps: int = 20
    guidance: Optional[float] = None  # None → the guidance the policy samples with (the rollouts')
    default_guidance: bool = True  # also evaluate at the model's default guidance when it differs (eval_default/*)
    images_per_prompt: int = 2  # images per held-out prompt, each from its own seed set
    rewards: Optional[list[RewardTerm]] = None  # None → the training rewards
    num_prompts: Optional[int] = None  # None → all eval prompts
    grid_prompts: int = 16
    height: Optional[int] = None  # pixels of the eval's images (and grids, benchmarks, flowrl sample); None → model's
    width: Optional[int] = None  # a transformer that accepts both sizes evaluates at another resolution
    seed: int = 1234
    guard: GuardSection = field(default_factory=GuardSection)  # stop when an eval reward falls (needs eval.every)


@dataclass
class TrainSection:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    max_steps: int = 100
    max_minutes: float = 0.0  # stop after this much training time (evals excluded); 0 = only max_steps
    inner_epochs: int = 1
    updates_per_epoch: int = 1  # optimizer steps per pass over an iteration's edges
    checkpoint_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    resume: Optional[str] = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # replace an earlier run of the same name (else starting under a taken name is refused)
    ema: float = 0.0  # EMA decay of trainable weights for eval/saving (0 = off)
    ema_warmup: bool = False  # decay min((1+s)/(10+s), ema) after optimizer step s (DiffusionNFT's eval EMA)
    log_with: str = "none"  # none | tensorboard | wandb
    progress: bool = True
    num_threads: Optional[int] = None  # torch CPU threads (None = torch default)
    async_reward: str = "auto"  # score rewards in a background thread: auto (on with CUDA) | true | false
    max_failed_iterations: int = 3  # iterations in a row with every reward failed (all NaN) before the run stops
    micro_batch: Optional[int] = None  # rows per training forward of an objective that trains on leaves (forward
    # process: NFT, AWM, DPO, ...); null = rollout.max_batch. A policy objective replays the rollout's forwards
    fit: str = "off"  # off | auto: choose rollout.max_batch, train.micro_batch, gradient checkpointing per block and
    # text-encoder offload from the estimate for the device at hand, before any weight loads (docs/estimate.md)
    memory_fraction: float = 0.9  # fit: the share of the device's memory the predicted peak may use
    fit_keep: list[str] = field(default_factory=list)  # fit: keys it must leave as the config sets them (key=value
    # overrides on the command line are kept too)
    peak_tflops: Optional[float] = (
        None  # the device's bf16 peak for perf/mfu; null = the table's (measured where known)
    )
    pipeline: str = "sync"  # sync: rollout, then update | async: the next forests are sampled in their own
    # process(es) while the update runs, from weights at most train.max_staleness updates old (docs/pipeline.md)
    max_staleness: int = 1  # async: forest k is sampled from the weights after update k - max_staleness (0: serial)
    rollout_processes: int = 0  # async under accelerate/torchrun: launched processes that roll out (the rest train);
    # 0 = one rollout process started beside each trainer on this machine
    rollout_threads: Optional[int] = None  # async on CPU: torch threads of the rollout process (None: half of
    # train.num_threads, or of the cores; the update keeps the rest)
    push_to_hub: Optional[str] = None  # a Hub repo id: at the end of the run, export and upload with a model card


RolloutSection = components.section_schema(components.PLAN, components.PLAN.default)
CreditSection = components.section_schema(components.CREDIT, components.CREDIT.default)
LossSection = components.section_schema(components.LOSS, components.LOSS.default)


@dataclass
class TrainConfig:
    """The whole run. ``rollout``/``credit``/``loss`` hold the default components' sections here; a
    config that selects others is loaded into :meth:`schema`'s subclass with their sections."""

    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    rewards: list[RewardTerm] = field(default_factory=lambda: [RewardTerm(name="shapes")])
    reward_normalize: str = "none"  # none | batch | group: how MultiReward combines several rewards
    credit: CreditSection = field(default_factory=CreditSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    prompts: PromptsSection = field(default_factory=PromptsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    train: TrainSection = field(default_factory=TrainSection)

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
        try:
            layers = []
            if loaded is not None:
                keys.check_file_keys_under_overridden_components(loaded, path, overrides or [], schema)
                keys.check_keys(keys.dotted(OmegaConf.to_container(loaded)), f" in {path}", schema)
                layers.append(loaded)
            if overrides:
                keys.check_keys([item.split("=", 1)[0] for item in overrides], "", schema)
                layers.append(OmegaConf.from_dotlist(list(overrides)))
            if layers:
                base = OmegaConf.merge(base, *layers)
                keys.keep_strings_as_written(base, overrides or [])
        except (ConfigKeyError, ConfigAttributeError) as e:
            raise ConfigError(keys.unknown_key_message(e, schema)) from None
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
