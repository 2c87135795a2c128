"""The schema's own sections but ``model`` (:mod:`flowrl.config.model_section`): ``rewards[i]``, ``optim``,
``prompts``, ``eval`` (and ``eval.guard``), ``train``, one dataclass each, every field with its help
(``field(..., metadata={"help": ...})``: ``flowrl train --help`` prints it beside each key's value and docs/keys.md is
generated from it). :mod:`flowrl.config.schema` puts them together into :class:`~flowrl.config.schema.TrainConfig` and
re-exports them (``from flowrl.config.schema import TrainSection``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


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
