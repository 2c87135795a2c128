"""The ``model`` section of a config (:class:`ModelSection`) and the sections below it (``model.lora``,
``model.context_parallel``), each field with its help (``field(..., metadata={"help": ...})``, as in
:mod:`flowrl.config.sections`); :mod:`flowrl.config.schema` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


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
