"""Checkpoints of a sharded run (``model.shard: fsdp``): ``checkpoints/step-N/sharded/`` is a torch distributed
checkpoint (DCP: one file per process and ``.metadata``), beside the usual ``trainer_state.pt`` and the
manifest that covers every file (:mod:`flowrl.run.checkpoint`).

What the shards hold (names as an unsharded module names them, so any layout reads them back):

- ``model``: the trained parameters (a LoRA's, or every one of full fine-tuning; frozen ones are rebuilt);
- ``optim``: the AdamW state by parameter name;
- ``extra``: every sharded tensor of the trainer state (the EMA, an old policy's copy), by its path in that
  state (:func:`split_sharded`); ``trainer_state.pt`` keeps the rest, written by the main process.

Writing: every process writes its shards into ``.step-N.shards-PID`` (the main process's PID, agreed by
broadcast), then the main process moves them into the checkpoint folder it writes atomically
(:func:`flowrl.run.checkpoint.write_checkpoint`); a crash on the way leaves a stale folder that the next save
removes, and the previous checkpoints intact. Reading back: under sharding by every process (resume, DCP
reshards to this run's layout); without sharding in one process, no process group needed (:func:`read_model`:
``flowrl export``, ``flowrl sample``, a teacher's path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHARDED_DIR = "sharded"
EMA = "ema"  # the trainer state's key of the EMA weights (a list in trainable-parameter order)


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


def split_sharded(tree: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` (nested dicts and lists) without its sharded tensors (DTensors, replaced by None) and those
    tensors by their path (``"ema/3"``, ``"objective/old/0"``)."""
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any, where: str) -> Any:
        if hasattr(node, "full_tensor"):  # a DTensor
            found[where] = node
            return None
        if isinstance(node, dict):
            return {k: walk(v, f"{where}/{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{where}/{i}" if where else str(i)) for i, v in enumerate(node))
        return node

    return walk(tree, path), found


def merge_sharded(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_sharded`: ``tree`` with ``tensors`` put back at their paths."""

    def walk(node: Any, where: str) -> Any:
        if where in tensors:
            return tensors[where]
        if isinstance(node, dict):
            return {k: walk(v, f"{where}/{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{where}/{i}" if where else str(i)) for i, v in enumerate(node))
        return node

    return walk(tree, "")


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def shards_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, torch.Tensor]) -> dict:
    """What every process writes: its shards of the trained parameters, the optimizer state and ``extra``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(module, options=_options()),
        "optim": get_optimizer_state_dict(module, optimizer, options=_options()),
        "extra": dict(extra),
    }


def save_shards(shards: dict, folder: Path, process_group=None) -> None:
    """Write ``shards`` (:func:`shards_of`) into ``folder``; every process of ``process_group`` (None: every launched
    process) calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(shards, checkpoint_id=str(folder), process_group=process_group)


def load_shards(
    folder: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, torch.Tensor],
    process_group=None,
) -> dict[str, torch.Tensor]:
    """Load checkpoint shards ``folder`` into the sharded ``module`` and ``optimizer`` (every process of
    ``process_group`` calls it; None: every launched process) and return ``extra`` (this run's tensors, the layout to
    read into) filled with the saved values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    shards = shards_of(module, optimizer, extra)
    dcp.load(
        shards, checkpoint_id=str(folder), process_group=process_group
    )  # every trained parameter's value, or an error naming the absent one
    # not strict: the frozen parameters (a LoRA's base, an old policy's adapter) were never saved, so a strict load
    # counts them missing; nothing unexpected can come, the keys being this module's own
    set_model_state_dict(module, shards["model"], options=_options(strict=False))
    set_optimizer_state_dict(module, optimizer, shards["optim"], options=_options())
    return shards["extra"]


def read_model(model, folder: Path, live: bool = False) -> None:
    """Load the trained weights of sharded checkpoint ``folder`` into the unsharded ``model`` (its LoRA added
    as the run added it) in one process: the EMA weights where the run kept an EMA (as the consolidated
    weights of an unsharded checkpoint are), else, or with ``live``, the weights training had reached."""
    import warnings

    import torch.distributed.checkpoint as dcp

    module = model.trainable
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    state = {n: t.detach().clone() for n, t in module.state_dict().items() if n in set(names)}
    missing = sorted(set(names) - set(state))
    if missing:
        raise ValueError(f"trained parameters without a value in the model's state dict: {missing[:5]}")
    reader = dcp.FileSystemReader(str(Path(folder) / SHARDED_DIR))
    stored = set(reader.read_metadata().state_dict_metadata)
    wanted = {f"model.{n}" for n in names}
    if not wanted <= stored:
        absent = sorted(k[len("model.") :] for k in wanted - stored)
        raise ValueError(f"sharded checkpoint {folder} has no weights for {absent[:5]} (another LoRA or model?)")
    load = {"model": state}
    use_ema = not live and any(k.startswith(f"extra.{EMA}/") for k in stored)
    if use_ema:
        load["extra"] = {f"{EMA}/{i}": state[n].clone() for i, n in enumerate(names)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(load, storage_reader=reader, no_dist=True)
    if use_ema:
        for i, n in enumerate(names):
            state[n] = load["extra"][f"{EMA}/{i}"]
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"sharded checkpoint {folder}: weights the model does not have: {unexpected[:5]}")
