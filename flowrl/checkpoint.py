"""Atomic checkpoints: ``checkpoints/step-N/`` holds the LoRA in the diffusers format (or the full
transformer) and ``trainer_state.pt`` (optimizer, scheduler, EMA, step). A folder is written under a
temporary name and renamed into place, so a crash mid-write leaves the previous checkpoint intact."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def write_checkpoint(folder: Path, step: int, write_weights: Callable[[Path], None], state: dict[str, Any],
                     keep_last: int) -> Path:
    """Write ``step-N`` atomically: weights by ``write_weights(tmp_dir)``, then ``state``; rename; prune."""
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(folder)
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        write_weights(tmp)
        torch.save(state, tmp / STATE_FILE)
    except BaseException as e:  # a full disk, an interrupt: the partial folder goes, earlier checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, FileNotFoundError):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            raise OSError(getattr(e, "errno", None) or 0, f"could not write checkpoint {final} ({reason}); "
                          "the previous checkpoints are intact") from e
        raise
    if final.exists():  # re-saving the same step: move the old one aside first
        old = folder / f".step-{step}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    if keep_last > 0:
        for _, path in list_checkpoints(folder)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def remove_stale(folder: Path) -> list[Path]:
    """Remove the temporary ``.step-N.tmp-PID`` / ``.step-N.old-PID`` folders that killed writes left in
    ``folder`` (one process writes a run's checkpoints, so any other than this process's own is stale)."""
    removed = []
    for child in folder.glob(".step-*"):
        m = re.match(r"^\.step-\d+\.(tmp|old)-(\d+)$", child.name)
        if m and int(m.group(2)) != os.getpid() and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def resolve_resume(spec: str, folder: Path) -> Path | None:
    """``latest`` → newest complete checkpoint in ``folder`` (None if there is none); else a path."""
    if spec == "latest":
        found = list_checkpoints(folder)
        return found[-1][1] if found else None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"train.resume={spec!r} is not a checkpoint folder (no {STATE_FILE} in it)")
    return path


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(checkpoint folder, run folder)`` for a run folder (its newest complete checkpoint) or a
    ``checkpoints/step-N`` folder."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path, path.parent.parent
    found = list_checkpoints(path / "checkpoints")
    if not found:
        raise FileNotFoundError(f"--checkpoint {str(path)!r}: no checkpoints/step-N/ folder with {STATE_FILE} in it")
    return found[-1][1], path


def read_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def save_weights(model, folder: Path) -> None:
    """The trained weights of ``model``: its LoRA in the diffusers format (``pipe.load_lora_weights``
    reads it), or for full fine-tuning the whole transformer (``save_pretrained`` into ``transformer/``)."""
    if model.has_lora:
        model.save_lora(folder)
    else:
        model.trainable.save_pretrained(Path(folder) / "transformer", safe_serialization=True)


def load_weights(model, folder: Path) -> None:
    """Inverse of :func:`save_weights` (in place, so optimizer references stay valid)."""
    folder = Path(folder)
    if (folder / "transformer").is_dir():
        from safetensors.torch import load_file

        files = sorted((folder / "transformer").glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(load_file(f))
        missing, unexpected = model.trainable.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"transformer weights in {folder} do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    else:
        model.load_lora(folder)
