"""FSDP2 in the estimate (``model.shard: fsdp``; docs/estimate.md): what one of N processes holds when each
block of the transformer's block lists and then the transformer itself (the root: embeddings, norms,
``proj_out``) are wrapped by ``fully_shard`` — ⌈rows/N⌉ rows of every parameter (dim-0 shards, padded to that
size), of its gradient and of its AdamW state; buffers whole — and the full-size tensors FSDP2 builds for a
moment: the parameters it all-gathers around a forward and the gradients it reduce-scatters after a block's
backward."""
from __future__ import annotations

from torch import nn

from flowrl.choices import choose
from flowrl.errors import ConfigError

SHARD_MODES = ("ddp", "fsdp")
ASSUMPTION = (
    "model.shard=ddp: every process holds the whole model; fsdp (FSDP2): the transformer's weights, LoRA, "
    "gradients, AdamW state, EMA and the old-policy / reference copies are split over the processes (⌈rows/N⌉ "
    "of each tensor's dim 0, padded), buffers, text encoders, VAE, reward models and an explorer copy are not; "
    "a forward gathers the root and two consecutive blocks (current + prefetched) in model.dtype (shard_rollouts=whole: "
    "the whole transformer during the rollout), a backward holds one block's unsharded gradients twice "
    "(autograd's and the reduce-scatter's input) instead of the whole model's that the DDP update trace counts; the "
    "optimizer step's transient is split like its state"
)


def shard_mode(shard: str, processes: int) -> str:
    """``shard`` (``ddp`` | ``fsdp``) checked against ``processes``: FSDP2 over one process shards nothing."""
    choose("model.shard", shard, SHARD_MODES)
    if shard == "fsdp" and processes < 2:
        raise ConfigError(f"model.shard=fsdp needs at least 2 processes to shard over (got {processes}); "
                          "pass --gpus N (N ≥ 2) or use model.shard=ddp on one GPU")
    return shard


def block_lists(module: nn.Module) -> list[nn.ModuleList]:
    """The transformer's block lists that ``fully_shard`` wraps one block at a time: every ``nn.ModuleList``
    child whose name ends in ``blocks`` (``transformer_blocks``; FLUX's ``single_transformer_blocks`` too)."""
    return [child for name, child in module.named_children()
            if isinstance(child, nn.ModuleList) and name.endswith("blocks")]


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
    """The full-size tensors FSDP2 builds for a moment on ``module`` (the transformer, LoRA attached), in bytes
    at ``dtype_bytes`` per element (the compute dtype, model.dtype):

    - ``gather``: a forward's all-gathered parameters: the root's (held through the forward) and the largest
      two consecutive blocks' (the current block and the prefetched next one: 2× the largest block when the
      blocks are alike);
    - ``rollout``: ``gather``, or every parameter with ``whole_rollouts`` (the transformer gathered once
      around each rollout);
    - ``reduce_scatter``: the largest block's trainable parameters twice (their unsharded gradients and the
      reduce-scatter's input copy) at the end of that block's backward;
    - ``update``: ``gather`` + ``reduce_scatter``.
    """
    blocks = [block for blocks in block_lists(module) for block in blocks]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    current_and_next = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
    largest_trainable = max((sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks),
                            default=0)
    gather = (root + current_and_next) * dtype_bytes
    reduce_scatter = 2 * largest_trainable * dtype_bytes
    everything = sum(p.numel() for p in module.parameters()) * dtype_bytes
    return {"gather": gather, "rollout": everything if whole_rollouts else gather,
            "reduce_scatter": reduce_scatter, "update": gather + reduce_scatter}
