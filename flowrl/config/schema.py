"""Typed configuration: one dataclass per section, YAML files plus ``key=value`` overrides.

``TrainConfig.from_yaml(path, overrides)`` merges the YAML into the schema with OmegaConf; a key
that does not exist fails at once naming the nearest valid key, a value of the wrong type names
the key, the value and the expected type, and semantic checks (choices, ranges) run when the
components are built (they name the key too).

The ``rollout``, ``credit`` and ``loss`` sections belong to the components they select
(``rollout.plan``, ``credit.rule``, ``loss.objective``; see :mod:`flowrl.core.components`): their keys are
the chosen component's dataclass fields, so the schema is assembled per config by
:meth:`TrainConfig.schema` before the YAML is merged into it.

Every field of the schema's own sections carries its help, ``field(..., metadata={"help": ...})``: ``flowrl train
--help`` prints it beside each key's value and docs/keys.md is generated from it (:mod:`flowrl.config.help`, which
also says where the component sections' help comes from).
"""

from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, field, fields, is_dataclass, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from flowrl.config import keys
from flowrl.config.secrets import redacted, refuse_redacted
from flowrl.core import components
from flowrl.errors import ConfigError, shown, shown_message
from flowrl.paths import find_file, where_tried


@dataclass
class LoraSection:
    """``model.lora``: the LoRA adapter trained on the transformer (unless ``model.full_finetune``)."""

    rank: int = field(default=32, metadata={"help": "LoRA rank r of every adapted layer"})
    alpha: float = field(default=64.0, metadata={"help": "LoRA alpha: the update is scaled by alpha / rank"})
    targets: Optional[list[str]] = field(
        default=None,
        metadata={"help": "module names the adapter wraps (peft's target_modules); null = the adapter's defaults"},
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA branch's input"})
    init: str = field(
        default="gaussian",
        metadata={"help": "peft's init_lora_weights: gaussian | default (peft's own) | another it accepts, e.g. pissa"},
    )


@dataclass
class ContextParallelSection:
    """``model.context_parallel``: each sample's token sequence split over ``ulysses`` × ``ring`` processes (diffusers'
    context parallel; docs/video.md); 1 × 1 = off."""

    ulysses: int = field(
        default=1,
        metadata={
            "help": "Ulysses degree: an all-to-all hands each process a share of the heads over the whole sequence"
        },
    )
    ring: int = field(
        default=1, metadata={"help": "ring-attention degree: key/value blocks passed around the processes"}
    )


@dataclass
class ModelSection:
    """``model``: the model trained, its weights, precision, adapter and memory settings (docs/models.md)."""

    family: str = field(
        default="shapes",
        metadata={
            "help": "the model family (its adapter): shapes (the embedded model), sd3, flux, sana, qwen_image, flux2, "
            "wan, zimage, ... (docs/models.md)"
        },
    )
    path: Optional[str] = field(
        default=None, metadata={"help": "hub id or local folder of the pipeline; null = the shipped shapes model"}
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "float32 | bfloat16 | float16: the model's dtype (full fine-tuning in bf16/fp16 keeps fp32 "
            "weights and computes under autocast in it; LoRA adapters stay fp32)"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    guidance: Optional[float] = field(
        default=None,
        metadata={"help": "CFG scale for rollouts (FLUX: the distilled guidance value); null = the model's default"},
    )
    true_cfg: Optional[float] = field(
        default=None, metadata={"help": "FLUX only: real classifier-free guidance scale (1 = off)"}
    )
    height: Optional[int] = field(
        default=None, metadata={"help": "pixel height of the rollouts' images; null = the model's default"}
    )
    width: Optional[int] = field(
        default=None, metadata={"help": "pixel width of the rollouts' images; null = the model's default"}
    )
    max_sequence_length: Optional[int] = field(
        default=None, metadata={"help": "tokens of the encoded prompt; null = the adapter's default"}
    )
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "the LoRA adapter that trains"})
    full_finetune: bool = field(
        default=False, metadata={"help": "train every transformer weight instead of a LoRA adapter (model.lora unread)"}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "recompute transformer blocks' forwards in the backward to save memory"}
    )
    checkpoint_blocks: Optional[int] = field(
        default=None,
        metadata={
            "help": "with gradient_checkpointing: how many transformer blocks recompute their forward in the backward "
            "(the first N in execution order; null = every block); train.fit chooses it"
        },
    )
    compile: str = field(
        default="off",
        metadata={
            "help": "off | regional: torch.compile each transformer block (every block kind compiled once; "
            "flowrl/models/blocks.py)"
        },
    )
    prompt_cache_mb: Optional[float] = field(
        default=1024.0, metadata={"help": "MiB of prompt embeddings kept on the device (LRU); null = unbounded"}
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the adapter's other keywords, e.g. SANA's complex_human_instruction or negative_prompt (passed "
            "through; one the adapter's signature lacks fails at load)"
        },
    )
    shard: str = field(
        default="auto",
        metadata={
            "help": "ddp (every process a full copy, gradients averaged) | fsdp (FSDP2: weights, gradients and "
            "optimizer state sharded over the processes; docs/gpu.md) | auto: fsdp under accelerate's FSDP plugin "
            "(configs/accelerate/fsdp.yaml), else ddp"
        },
    )
    experts: Optional[str] = field(
        default=None,
        metadata={
            "help": "Wan 2.2 A14B's two experts: which trains (high | low | both; the other frozen); null = both "
            "(docs/models/wan.md)"
        },
    )
    context_parallel: ContextParallelSection = field(
        default_factory=ContextParallelSection,
        metadata={"help": "each sample's token sequence split over ulysses × ring processes (docs/video.md)"},
    )
    shard_rollouts: str = field(
        default="per_block",
        metadata={
            "help": "fsdp: per_block (each forward gathers block by block: least memory) | whole (the whole "
            "transformer gathered once around each rollout: faster, a full copy while sampling)"
        },
    )
    offload_encoders: bool = field(
        default=False,
        metadata={"help": "text encoders in CPU memory between uses (moved to the device to encode new prompts)"},
    )
    cudnn_attention: bool = field(
        default=False,
        metadata={
            "help": "CUDA: let torch pick its cuDNN attention kernel (off: its backward failed for FLUX.1-dev on an "
            "H200; flowrl/models/attention.py)"
        },
    )


@dataclass
class RewardTerm:
    """One reward of ``rewards`` (or ``eval.rewards``): the rewards are combined into one score per sample
    (docs/rewards.md)."""

    name: str = field(
        default=MISSING,
        metadata={"help": 'registry name, "package.module:Class" or "path/to/file.py:Class" (required)'},
    )
    weight: float = field(default=1.0, metadata={"help": "its weight in the sum of the rewards"})
    label: Optional[str] = field(
        default=None, metadata={"help": "metric name (to use one reward twice with different kwargs); null = its name"}
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the reward's settings (its constructor's keywords) and the combiner's frame_stride; each key "
            "checked at load (flowrl train --help lists them with their defaults)"
        },
    )
    timeout: Optional[float] = field(
        default=None,
        metadata={"help": "seconds one call may take; past it that call's scores are NaN (reward_failed); null = none"},
    )


@dataclass
class OptimSection:
    """``optim``: the optimizer (AdamW) and its learning-rate schedule."""

    lr: float = field(default=3e-4, metadata={"help": "AdamW's learning rate (after warm-up)"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "AdamW's betas [β1, β2]"})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW's decoupled weight decay"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW's epsilon"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear learning-rate warm-up"})
    schedule: str = field(
        default="constant",
        metadata={
            "help": "constant | linear | cosine: the learning rate over the run's optimizer steps (train.max_steps × "
            "train.inner_epochs × train.updates_per_epoch)"
        },
    )
    grad_clip: float = field(default=1.0, metadata={"help": "the largest gradient norm (clipped to it)"})
    use_8bit: bool = field(
        default=False, metadata={"help": "bitsandbytes' 8-bit AdamW (pip install 'flowrl-align[quant]')"}
    )
    loss_scaling: str = field(
        default="auto",
        metadata={"help": "dynamic loss scaling: auto (on when the transformer computes in fp16) | true | false"},
    )


@dataclass
class PromptsSection:
    """``prompts``: the training and held-out prompts and how each iteration draws them."""

    train: str = field(
        default="configs/shapes/prompts/train.txt",
        metadata={"help": 'training prompts: a .txt file (one per line) or inline "a|b|c"'},
    )
    eval: Optional[str] = field(
        default="configs/shapes/prompts/eval.txt",
        metadata={"help": "held-out prompts for evals, in the same forms; null = no held-out prompts"},
    )
    per_step: int = field(default=8, metadata={"help": "prompt groups per iteration over all processes"})
    sampling: str = field(
        default="epoch",
        metadata={"help": "epoch (seeded permutations) | adaptive (∝ recent reward spread per difficulty key)"},
    )
    difficulty_key: str = field(
        default="prompt", metadata={"help": "adaptive: pool statistics by prompt | shapes_task | module:function"}
    )
    adaptive_floor: float = field(
        default=0.1, metadata={"help": "adaptive: least draw weight of a key, relative to an average one"}
    )
    adaptive_decay: float = field(
        default=0.7, metadata={"help": "adaptive: weight of the old spread in each key's moving average"}
    )


@dataclass
class GuardSection:
    """``eval.guard``: a guard against reward hacking. At every eval after the first, the held-out mean of one eval
    reward (``eval/<name>_mean``, the main pass) is compared with its value at the start (the eval before training);
    when it falls by more than ``max_drop`` the run saves a checkpoint and stops (``flowrl train`` exits with
    status 4). One mapping rather than flat ``eval.guard_*`` keys: its settings mean something only together,
    ``reward: null`` turns the whole guard off, and ``flowrl train --help`` lists them as one block."""

    reward: Optional[str] = field(
        default=None,
        metadata={"help": "an eval reward term (its label, else its name as written); null = no guard"},
    )
    max_drop: float = field(
        default=0.05, metadata={"help": "the largest fall below the start value allowed (>= 0; in the reward's units)"}
    )
    relative: bool = field(
        default=False, metadata={"help": "true: max_drop is a fraction of |start value| (0.1 = a 10% fall)"}
    )


@dataclass
class EvalSection:
    """``eval``: held-out evals of ``prompts.eval`` (ODE samples from fixed seeds, scored by ``eval.rewards``)."""

    every: int = field(default=0, metadata={"help": "iterations between evals (0 = only at start and end)"})
    every_minutes: float = field(
        default=0.0,
        metadata={"help": "also evaluate each time this much training time has passed (evals excluded; 0 = off)"},
    )
    at_start: bool = field(default=True, metadata={"help": "evaluate before the first iteration (the start values)"})
    steps: int = field(default=20, metadata={"help": "sampling steps of each eval image (an ODE from its seed)"})
    guidance: Optional[float] = field(
        default=None, metadata={"help": "null = the guidance the policy samples with (the rollouts')"}
    )
    default_guidance: bool = field(
        default=True,
        metadata={"help": "also evaluate at the model's default guidance when it differs (eval_default/*)"},
    )
    images_per_prompt: int = field(
        default=2, metadata={"help": "images per held-out prompt, each from its own seed set"}
    )
    rewards: Optional[list[RewardTerm]] = field(
        default=None, metadata={"help": "the eval's reward terms (as rewards); null = the training rewards"}
    )
    num_prompts: Optional[int] = field(
        default=None, metadata={"help": "held-out prompts evaluated (the first N); null = all eval prompts"}
    )
    grid_prompts: int = field(
        default=16, metadata={"help": "prompts whose images make each eval's sample grid (samples/step-N.png)"}
    )
    height: Optional[int] = field(
        default=None,
        metadata={"help": "pixels of the eval's images (and grids, benchmarks, flowrl sample); null = the model's"},
    )
    width: Optional[int] = field(
        default=None,
        metadata={
            "help": "pixel width of the eval's images, as eval.height (a transformer that accepts both sizes "
            "evaluates at another resolution); null = the model's"
        },
    )
    seed: int = field(default=1234, metadata={"help": "seed of the held-out images' noise (the same at every eval)"})
    guard: GuardSection = field(
        default_factory=GuardSection,
        metadata={"help": "stop when an eval reward falls (needs eval.every; docs/reliability.md)"},
    )


@dataclass
class TrainSection:
    """``train``: the loop: its length, checkpoints, logging, the run folder and the rollout pipeline."""

    name: str = field(default="run", metadata={"help": "the run's name: its folder is train.output_dir/train.name"})
    output_dir: str = field(default="runs", metadata={"help": "folder that holds the run folders"})
    seed: int = field(
        default=0, metadata={"help": "the run's seed: prompt order, rollout noise, draws (any layout draws the same)"}
    )
    max_steps: int = field(default=100, metadata={"help": "iterations to train (rollout, credit, update each)"})
    max_minutes: float = field(
        default=0.0,
        metadata={"help": "stop after this much training time (evals excluded); 0 = only max_steps"},
    )
    inner_epochs: int = field(default=1, metadata={"help": "passes of the update over each iteration's forest"})
    updates_per_epoch: int = field(default=1, metadata={"help": "optimizer steps per pass over an iteration's edges"})
    checkpoint_every: int = field(default=0, metadata={"help": "iterations between checkpoints (0 = only at the end)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints kept (older ones deleted; 0 = keep all)"})
    resume: Optional[str] = field(
        default=None, metadata={"help": '"latest" or a checkpoint folder to continue from; null = a new run'}
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "replace an earlier run of the same name (else starting under a taken name is refused)"},
    )
    ema: float = field(default=0.0, metadata={"help": "EMA decay of trainable weights for eval/saving (0 = off)"})
    ema_warmup: bool = field(
        default=False,
        metadata={"help": "decay min((1+s)/(10+s), ema) after optimizer step s (DiffusionNFT's eval EMA)"},
    )
    log_with: str = field(default="none", metadata={"help": "tracker beside metrics.jsonl: none | tensorboard | wandb"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar over the iterations"})
    num_threads: Optional[int] = field(default=None, metadata={"help": "torch CPU threads (null = torch's default)"})
    async_reward: str = field(
        default="auto",
        metadata={"help": "score rewards in a background thread: auto (on with CUDA) | true | false"},
    )
    max_failed_iterations: int = field(
        default=3,
        metadata={"help": "iterations in a row with every reward failed (all NaN) before the run stops"},
    )
    micro_batch: Optional[int] = field(
        default=None,
        metadata={
            "help": "rows per training forward of an objective that trains on leaves (forward process: NFT, AWM, "
            "DPO, ...); null = rollout.max_batch. A policy objective replays the rollout's forwards"
        },
    )
    fit: str = field(
        default="off",
        metadata={
            "help": "off | auto: choose rollout.max_batch, train.micro_batch, gradient checkpointing per block and "
            "text-encoder offload from the estimate for the device at hand, before any weight loads "
            "(docs/estimate.md)"
        },
    )
    memory_fraction: float = field(
        default=0.9, metadata={"help": "fit: the share of the device's memory the predicted peak may use"}
    )
    fit_keep: list[str] = field(
        default_factory=list,
        metadata={
            "help": "fit: keys it must leave as the config sets them (key=value overrides on the command line are "
            "kept too)"
        },
    )
    peak_tflops: Optional[float] = field(
        default=None,
        metadata={"help": "the device's bf16 peak for perf/mfu; null = the table's (measured where known)"},
    )
    pipeline: str = field(
        default="sync",
        metadata={
            "help": "sync: rollout, then update | async: the next forests are sampled and scored in their own "
            "process(es) while the update runs, from weights at most train.max_staleness updates old "
            "(docs/pipeline.md)"
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "async: forest k is sampled from the weights after update max(0, k - max_staleness); 0 waits for "
            "every update (the serial schedule)"
        },
    )
    rollout_processes: int = field(
        default=0,
        metadata={
            "help": "async under accelerate launch/torchrun: the last N launched processes roll out, the others "
            "train; 0 = each trainer starts one rollout process beside itself"
        },
    )
    rollout_threads: Optional[int] = field(
        default=None,
        metadata={
            "help": "async on CPU: torch threads of the rollout process, the trainer keeps the rest (at least 1 "
            "each); null = half of train.num_threads, or of the cores"
        },
    )
    push_to_hub: Optional[str] = field(
        default=None,
        metadata={
            "help": "a Hub repo id: when the run ends, its weights exported to runs/<name>/export/ with a model card "
            "and uploaded (checked before training; docs/sharing.md); null = no upload"
        },
    )


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
