"""FSDP2 in the estimate (``model.shard: fsdp``; docs/estimate.md): what one of N processes holds when
:class:`flowrl.distributed.sharding.Sharding` wraps each block of the transformer's block lists and then the transformer
itself (the root: embeddings, norms, ``proj_out``) with ``fully_shard`` — ⌈rows/N⌉ rows of every parameter
(dim-0 shards, padded to that size), of its gradient and of its AdamW state; buffers whole — and the full-size
tensors FSDP2 builds for a moment: the parameters it all-gathers around a forward and the gradients it
reduce-scatters after a block's backward."""

from __future__ import annotations

from torch import nn

from flowrl.core.choices import choose
from flowrl.distributed.sharding import check_shard_settings, resolve_shard
from flowrl.errors import ConfigError
from flowrl.estimate.phases import phase_traces
from flowrl.estimate.trace import Trace
from flowrl.models.blocks import block_lists

SHARD_MODES = ("ddp", "fsdp")
ASSUMPTION = (
    "model.shard=ddp: every process holds the whole model; fsdp (FSDP2): the transformer's weights, LoRA, "
    "gradients, AdamW state, EMA and the old-policy / reference copies are split over the processes (⌈rows/N⌉ "
    "of each tensor's dim 0, padded), buffers, text encoders, VAE, reward models, an explorer copy and the "
    "prompt cache are not; the shards of trainable weights are fp32 as unsharded (LoRA; full fine-tuning's master "
    "weights and their frozen copies), a forward gathers the root and two consecutive blocks (current + prefetched) in "
    "model.dtype (shard_rollouts=whole: the whole transformer during the rollout); backward holds one block's "
    "unsharded gradients and their fp32 reduce-scatter input, not the whole model's (traced with each gradient "
    "dropped once accumulated); the optimizer step's transient is split like its state; all-gather / "
    "reduce-scatter time is not counted"
)


def shard_mode(cfg, shard: str | None, processes: int) -> str:
    """The sharding an estimate of ``cfg`` over ``processes`` assumes: ``shard`` (``ddp`` | ``fsdp``), else
    ``cfg.model.shard`` (``auto``: as the run would resolve it here, :func:`flowrl.distributed.sharding.resolve_shard`);
    ``fsdp`` refused where a run refuses it (:func:`flowrl.distributed.sharding.check_shard_settings`; one process here
    names ``--gpus``)."""
    mode = resolve_shard(cfg.model.shard if shard is None else shard)
    choose("model.shard", mode, SHARD_MODES)
    if mode == "fsdp" and processes < 2:
        raise ConfigError(
            f"model.shard=fsdp needs at least 2 processes to shard over (got {processes}): pass "
            "--gpus N (N ≥ 2), or model.shard=ddp for one GPU"
        )
    check_shard_settings(cfg, processes, mode)
    return mode


def held_bytes(tensors, shards: int = 1, itemsize: int | None = None) -> int:
    """Bytes one of ``shards`` processes holds of ``tensors`` sharded on dim 0: a [R, ...] tensor of n elements
    keeps ⌈R/shards⌉·n/R of them (FSDP2 pads every rank's shard to that; the last ranks hold fewer unpadded
    rows), a 0-dim tensor all; ``shards`` 1: the tensors' bytes. ``itemsize``: bytes per element instead of
    the dtype's (AdamW 8-bit state: 1)."""
    total = 0
    for t in tensors:
        size = t.element_size() if itemsize is None else itemsize
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        total += (-(-rows // shards) if t.dim() else 1) * per_row * size
    return total


def fsdp_transients(module: nn.Module, dtype_bytes: int, whole_rollouts: bool) -> dict[str, int]:
    """The full-size tensors FSDP2 builds for a moment on ``module`` (the transformer, LoRA attached), in bytes;
    gathered in the compute dtype (``dtype_bytes`` per element, model.dtype), gradients reduced in fp32:

    - ``gather``: a forward's all-gathered parameters: the root's (gathered through the forward and through the
      backward) and the largest two consecutive blocks' (the current block and the prefetched next one: 2× the
      largest block when the blocks are alike);
    - ``rollout``: ``gather``, or every parameter with ``whole_rollouts`` (the transformer gathered once
      around each rollout);
    - ``reduce_scatter``: the largest block's trainable parameters' unsharded gradients (compute dtype) and the
      fp32 reduce-scatter input they are copied into, at the end of that block's backward;
    - ``update``: ``gather`` + ``reduce_scatter``.
    """
    blocks = block_lists(module)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    current_and_next = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
    largest_trainable = max(
        (sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks), default=0
    )
    gather = (root + current_and_next) * dtype_bytes
    reduce_scatter = largest_trainable * (dtype_bytes + 4)
    everything = sum(p.numel() for p in module.parameters()) * dtype_bytes
    return {
        "gather": gather,
        "rollout": everything if whole_rollouts else gather,
        "reduce_scatter": reduce_scatter,
        "update": gather + reduce_scatter,
    }


def sharded_update_traces(*args) -> dict[str, Trace]:
    """The ``update`` / ``update_checkpointed`` traces of :func:`phase_traces` (same arguments) as FSDP2 runs them
    (``sharded``): the parameters gathered in ``model.dtype`` and every gradient dropped as soon as backward has
    accumulated it (FSDP2 never holds the whole model's gradients: a block's are reduce-scattered and freed as
    backward leaves it, :func:`fsdp_transients`; the sharded ones are static)."""
    traces = phase_traces(*args, True)
    return {k: traces[k] for k in ("update", "update_checkpointed")}
