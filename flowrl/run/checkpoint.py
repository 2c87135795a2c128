"""Atomic checkpoints: ``checkpoints/step-N/`` holds the LoRA in the diffusers format (or the full
transformer), ``trainer_state.pt`` (optimizer, scheduler, EMA, step) and, written last, ``manifest.json``
(every file's size and sha256, :mod:`flowrl.run.manifest`). A folder is written under a temporary name and
renamed into place, so a crash mid-write leaves the previous checkpoint intact; every reader here verifies
the manifest first, so a damaged checkpoint is an error naming its file, never wrong weights."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.errors import ConfigError
from flowrl.run.manifest import MANIFEST, DamagedCheckpoint, verify_checkpoint, write_manifest
from flowrl.run.outputs import Output, check_output, write_marker
from flowrl.run.sharded_checkpoint import is_sharded_checkpoint, read_model

LORA_FILE = "pytorch_lora_weights.safetensors"  # the diffusers LoRA file save_lora writes
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` entry in ``folder`` as (step, path), oldest first. Only whole folders are ever renamed
    to such a name, so one that is not a folder or lacks its state is damage, which the readers report
    (:func:`verify`), not a checkpoint to pass over in silence."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        m = _STEP_DIR.match(child.name)
        if m:
            found.append((int(m.group(1)), child))
    return sorted(found)


def verify(path: Path) -> bool:
    """Check checkpoint ``path`` against its manifest (:func:`flowrl.run.manifest.verify_checkpoint`): True when
    verified, False for a checkpoint written before manifests; raises DamagedCheckpoint naming the file."""
    return verify_checkpoint(Path(path), STATE_FILE, _records_manifest)


def _records_manifest(path: Path) -> bool:
    """Whether the state of checkpoint ``path`` (without a manifest) says one was written; memory-mapped,
    so its tensors are not read. A state that cannot be read at all is damage."""
    try:
        try:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # not the zip format (torch < 1.6) cannot be mapped: read it whole
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 — any failure to unpickle is a damaged file
        raise DamagedCheckpoint(
            f"checkpoint {path} is damaged: {path / STATE_FILE} cannot be read "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        ) from None
    return isinstance(state, dict) and bool(state.get("manifest"))


def write_checkpoint(
    folder: Path, step: int, write_weights: Callable[[Path], None], state: dict[str, Any], keep_last: int
) -> Path:
    """Write ``step-N`` atomically: weights by ``write_weights(tmp_dir)``, then ``state``, then the manifest of
    both; rename; prune."""
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(folder)
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        write_weights(tmp)
        torch.save({**state, "manifest": MANIFEST}, tmp / STATE_FILE)
        write_manifest(tmp)  # last: a folder with a whole manifest was written whole
    except BaseException as e:  # a full disk, an interrupt: the partial folder goes, earlier checkpoints stay
        full = isinstance(e, Exception) and disk_full(e, folder)
        shutil.rmtree(tmp, ignore_errors=True)
        if full or (isinstance(e, (OSError, RuntimeError)) and not isinstance(e, FileNotFoundError)):
            reason = (
                os.strerror(errno.ENOSPC)
                if full
                else e.strerror
                if isinstance(e, OSError) and e.strerror
                else str(e).splitlines()[0]
            )
            raise OSError(
                errno.ENOSPC if full else getattr(e, "errno", None) or 0,
                f"could not write checkpoint {final}: {reason}; the previous checkpoints are intact",
            ) from e
        raise
    if final.exists():  # re-saving the same step: move the old one aside first
        old = folder / f".step-{step}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        remove(old)
    else:
        os.replace(tmp, final)
    if keep_last > 0:
        for _, path in list_checkpoints(folder)[:-keep_last]:
            remove(path)
    return final


def disk_full(error: BaseException, folder: Path) -> bool:
    """Whether a failed write into ``folder`` ran out of space: ENOSPC anywhere in the exception's chain, the text
    safetensors gives for it (``I/O error: No space left on device (os error 28)``), or (torch.save's
    ``unexpected pos``, which names no cause) less than 1 MiB left on the file system."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        e = e.__cause__ or e.__context__
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def remove(path: Path) -> None:
    """Remove a checkpoint entry: a folder, or a file (or link) that took a folder's place."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale(folder: Path) -> list[Path]:
    """Remove the temporary ``.step-N.tmp-PID`` / ``.step-N.old-PID`` folders that killed writes left in
    ``folder`` (one process writes a run's checkpoints, so any other than this process's own is stale)."""
    removed = []
    for child in folder.glob(".step-*"):
        m = re.match(r"^\.step-\d+\.(tmp|old|shards)-(\d+)$", child.name)
        if m and int(m.group(2)) != os.getpid() and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def resolve_resume(spec: str, folder: Path) -> Path | None:
    """``latest`` → newest checkpoint entry in ``folder`` (None if there is none); else a path."""
    if spec == "latest":
        found = list_checkpoints(folder)
        return found[-1][1] if found else None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"train.resume={spec!r} is not a checkpoint folder (no {STATE_FILE} in it)")
    return path


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(checkpoint folder, run folder)`` for a run folder (its newest checkpoint) or a ``checkpoints/step-N``
    folder, verified against its manifest (:func:`verify`: a damaged one raises, naming the file)."""
    path = Path(path)
    if (path / STATE_FILE).is_file() or (_STEP_DIR.match(path.name) and (path.exists() or path.is_symlink())):
        verify(path)
        return path, path.parent.parent
    found = list_checkpoints(path / "checkpoints")
    if not found:
        raise FileNotFoundError(f"--checkpoint {str(path)!r}: no checkpoints/step-N/ folder with {STATE_FILE} in it")
    verify(found[-1][1])
    return found[-1][1], path


def weights_folder(path: str | Path, key: str) -> Path:
    """The folder holding the model weights that config key ``key`` names: a folder with ``transformer/`` (a pipeline
    or a full fine-tuning checkpoint) or a LoRA safetensors file, a ``checkpoints/step-N`` folder, or a run folder
    (its newest checkpoint, verified); else a ConfigError naming ``key`` and what is accepted."""
    folder = Path(path)
    accepted = "a flowrl run folder, a checkpoints/step-N folder, or a folder with transformer/ (a diffusers pipeline)"
    if not folder.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is not a folder; accepted: {accepted}")
    if (folder / "transformer").is_dir() or any(folder.glob("*lora*.safetensors")):
        return folder
    try:
        return find_checkpoint(folder)[0]
    except FileNotFoundError:
        raise ConfigError(
            f"{key}={str(path)!r} holds no model: no transformer/ folder, no LoRA safetensors and no "
            f"checkpoints/step-N/; accepted: {accepted}"
        ) from None


def read_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``, after verifying the checkpoint (:func:`verify`)."""
    verify(path)
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)


def checkpoint_root(folder: Path) -> Path | None:
    """The checkpoint that weights folder ``folder`` belongs to (itself, or its parent for ``live/``); None
    for a folder that is no flowrl checkpoint (e.g. a LoRA from elsewhere)."""
    for root in (folder, folder.parent) if folder.name == "live" else (folder,):
        if (root / STATE_FILE).exists() or (root / MANIFEST).exists():
            return root
    return None


def save_weights(model, folder: Path, whole: dict[str, torch.Tensor] | None = None) -> None:
    """The trained weights of ``model``: its LoRA in the diffusers format (``pipe.load_lora_weights``
    reads it), or for full fine-tuning the whole transformer (``save_pretrained`` into ``transformer/``).
    ``whole``: those weights already gathered (:func:`flowrl.distributed.sharding.full_state`; a sharded model's own
    tensors cannot be written), else read from the model."""
    if model.has_lora:
        model.save_lora(folder, layers=whole)
    elif whole is None:
        model.trainable.save_pretrained(Path(folder) / "transformer", safe_serialization=True)
    else:  # what save_pretrained writes: the config and one safetensors file, diffusers' names
        from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        target = Path(folder) / "transformer"
        model.trainable.save_config(target)
        save_file(
            {k: v.contiguous() for k, v in whole.items()}, target / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"}
        )


def load_weights(model, folder: Path) -> None:
    """Inverse of :func:`save_weights` (in place, so optimizer references stay valid), from a verified
    checkpoint (:func:`verify`)."""
    folder = Path(folder)
    root = checkpoint_root(folder)
    if root is not None:
        verify(root)
    elif not folder.is_dir():
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it is not a folder")
    if (
        root is not None
        and is_sharded_checkpoint(root)
        and not (folder / "transformer").is_dir()
        and not (folder / LORA_FILE).is_file()
        and not (folder / "transformer_2" / LORA_FILE).is_file()  # Wan 2.2's low-noise expert alone
    ):
        read_model(model, root, live=folder.name == "live")  # full fine-tuning sharded: its DCP shards
    elif (folder / "transformer").is_dir():
        from safetensors.torch import load_file

        files = sorted((folder / "transformer").glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(load_file(f))
        missing, unexpected = model.trainable.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"transformer weights in {folder} do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    else:
        model.load_lora(folder)


def check_export_target(target: Path, label: str = "--out") -> Output:
    """Where ``flowrl export`` (and a sharded run's ``export/``) may write (:mod:`flowrl.run.outputs`): a new or empty
    folder, an earlier export (its marker), or a run's own ``export/``; never anything else inside a run folder,
    an existing file, ``.`` or a folder of the user's."""
    return check_output(target, "flowrl export", label, run_entry="export")


def write_export(target: Path, write_weights: Callable[[Path], None], label: str = "--out") -> Path:
    """Write ``target`` (consolidated weights, :func:`save_weights`, and the export's marker) atomically: into a
    temporary folder beside it, then renamed into place; an earlier export (:func:`check_export_target`: nothing
    else is accepted) is moved aside and removed only after."""
    target = Path(target)
    check_export_target(target, label)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_weights(tmp)
        write_marker(tmp, "flowrl export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    return target
