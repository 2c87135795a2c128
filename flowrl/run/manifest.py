"""Checkpoint manifests: ``manifest.json`` in every ``checkpoints/step-N/`` lists each file's relative path,
size and sha256. It is written last, inside the temporary folder that is renamed into place, and checked by
every reader of a checkpoint (resume, ``flowrl sample|eval|snr --checkpoint``), so a truncated, overwritten
or zeroed file is a damaged checkpoint named with its file, never weights that load and are wrong.

A checkpoint written before manifests existed (no ``manifest.json`` and no ``manifest`` key in its state)
still loads, with a one-line notice; one whose state says a manifest was written is damaged without it.

The manifests also say what a run wrote, for ``train.overwrite`` (:func:`unwritten`): a file inside
``checkpoints/step-N/`` that its manifest does not list is not the run's, nor is anything in ``samples/`` but the
eval grids, in ``checkpoints/`` but checkpoints, or in ``export/`` but an export's weights and marker."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path, PurePosixPath
from typing import Callable

MANIFEST = "manifest.json"
CHUNK = 8 << 20  # bytes hashed per read: constant memory whatever a file's size

_verified: dict[str, tuple] = {}  # resolved checkpoint folder → fingerprint of what was verified (one hash per process)
_noticed: set[str] = set()


class DamagedCheckpoint(ValueError):
    """A checkpoint that fails verification; the message names the checkpoint and the file."""


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    """The sha256 of ``path`` read in ``chunk``-byte pieces."""
    digest, buffer = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under ``folder`` as a POSIX relative path, sorted; the manifest itself excluded."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            rel = Path(root, name).relative_to(folder).as_posix()
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def sha256_files(paths: list[Path]) -> list[str]:
    """The sha256 of each of ``paths``, several files at once (hashlib lets go of the GIL while it hashes):
    a sharded FLUX transformer is hashed at a multiple of one core's speed."""
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1, len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


def write_manifest(folder: Path) -> Path:
    """Hash every file in ``folder`` and write ``folder/manifest.json`` (the last file of a checkpoint)."""
    names = checkpoint_files(folder)
    digests = sha256_files([folder / rel for rel in names])
    files = [
        {"path": rel, "size": (folder / rel).stat().st_size, "sha256": digest} for rel, digest in zip(names, digests)
    ]
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": 1, "algorithm": "sha256", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_manifest(folder: Path) -> list[dict]:
    """The entries of ``folder``'s manifest; a manifest that cannot be read or parsed is damage."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
        entries = data["files"]
        if data.get("algorithm") != "sha256" or not isinstance(entries, list):
            raise ValueError("not a sha256 manifest")
        for e in entries:
            rel = PurePosixPath(e["path"])
            if rel.is_absolute() or ".." in rel.parts or not isinstance(e["size"], int) or len(e["sha256"]) != 64:
                raise ValueError(f"bad entry {e!r}"[:200])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(
            f"checkpoint {folder} is damaged: its manifest {path} cannot be read ({type(e).__name__}: {str(e)[:160]})"
        ) from None
    return entries


def verify_checkpoint(folder: Path, state_file: str, recorded: Callable[[Path], bool]) -> bool:
    """Check checkpoint ``folder`` against its manifest: True when verified, False for a checkpoint written
    before manifests (no ``manifest.json``, and ``recorded(folder)`` — whether its state says a manifest was
    written — False; a one-line notice the first time). Raises :class:`DamagedCheckpoint` naming the file
    for a folder that is not a folder, a manifest missing where one was written, a listed file that is
    missing, or a size or sha256 that differs. A folder verified before in this process and unchanged since
    (the same sizes, inodes and modification times) is not hashed again."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "missing" if not folder.exists() and not folder.is_symlink() else "not a folder"
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it is {what}")
    if not (folder / MANIFEST).exists():
        if not (folder / state_file).is_file():
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {folder / state_file} is missing")
        key = str(folder.resolve())
        if key not in _noticed:
            if recorded(folder):
                raise DamagedCheckpoint(
                    f"checkpoint {folder} is damaged: {folder / MANIFEST} is missing (the "
                    "checkpoint was written with one)"
                )
            _noticed.add(key)
            warnings.warn(
                f"checkpoint {folder} has no {MANIFEST} (written before manifests): loaded unverified",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    entries = read_manifest(folder)
    if not any(e["path"] == state_file for e in entries):
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: its manifest does not list {state_file}")
    key, fingerprint = str(folder.resolve()), _fingerprint(folder, entries)
    if fingerprint is not None and _verified.get(key) == fingerprint:
        return True
    for e in entries:  # sizes first: a truncated file is named without hashing anything
        path = folder / e["path"]
        if not path.is_file():
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {path} is missing")
        size = path.stat().st_size
        if size != e["size"]:
            raise DamagedCheckpoint(
                f"checkpoint {folder} is damaged: {path} has {size:,} bytes, its manifest "
                f"says {e['size']:,} (truncated or overwritten)"
            )
    for e, digest in zip(entries, sha256_files([folder / e["path"] for e in entries])):
        if digest != e["sha256"]:
            raise DamagedCheckpoint(
                f"checkpoint {folder} is damaged: the content of {folder / e['path']} does not "
                "match its sha256 in the manifest"
            )
    _verified[key] = _fingerprint(folder, entries)
    return True


def _fingerprint(folder: Path, entries: list[dict]) -> tuple | None:
    """What a re-verification would have to re-read: the manifest's and each file's (size, inode, mtime)."""
    try:
        stats = [os.stat(folder / MANIFEST)] + [os.stat(folder / e["path"]) for e in entries]
    except OSError:
        return None
    return tuple((s.st_size, s.st_ino, s.st_mtime_ns) for s in stats)


# ---- what a run wrote ----------------------------------------------------------------------------------------
SAMPLE_GRID = re.compile(r"^(before|after|step-\d+)(_[a-z0-9_]+)?\.(png|gif)$")
"""The eval grids a run writes into ``samples/`` (flowrl/training/evaluation.py: ``before.png``, ``step-000040.png``,
``after_default.png``; a video's as ``.gif``)."""
_STEP = re.compile(r"^step-\d+$")
_PARTIAL = re.compile(r"^\.step-\d+\.(tmp|old|shards)-\d+$")  # what a killed checkpoint write leaves
WEIGHT_FILES = (".safetensors", ".pt", ".bin", ".json", ".distcp")
"""What a checkpoint without a manifest (written before manifests, or cut short) and an export hold: weights, their
configs, the trainer's state, DCP shards (and their ``.metadata``)."""


def _files(folder: Path) -> list[str]:
    """Every file, link and empty folder under ``folder`` as a POSIX relative path (links not followed), sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = [d for d in dirs if d not in links]
        empty = [] if dirs or files or links or root == str(folder) else [""]
        for name in [*files, *links, *empty]:
            found.append(Path(root, name).relative_to(folder).as_posix() + ("/" if name == "" else ""))
    return sorted(found)


def _weights(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name == ".metadata" or name.endswith(WEIGHT_FILES)


def unlisted(checkpoint: Path) -> list[str]:
    """The paths inside ``checkpoint`` (relative) that it did not write: with a manifest, every file it does not list;
    without one, anything that is not weights or state (:data:`WEIGHT_FILES`)."""
    files = [f for f in _files(checkpoint) if f != MANIFEST]
    if (checkpoint / MANIFEST).is_file():
        try:
            listed = {e["path"] for e in read_manifest(checkpoint)}
        except DamagedCheckpoint:
            listed = None
        if listed is not None:
            return [f for f in files if f not in listed]
    return [f for f in files if not _weights(f) or os.path.islink(checkpoint / f)]


def unwritten(run: Path, marker: str) -> list[str]:
    """What is inside the run folder ``run``'s own entries that the run (or ``flowrl export``, whose marker file is
    ``marker``) did not write, as paths relative to ``run`` (folders with a trailing ``/``), sorted: ``samples/``
    holds eval grids (:data:`SAMPLE_GRID`); ``checkpoints/`` holds ``step-N`` checkpoints (each as its manifest says,
    :func:`unlisted`) and what a killed write left; ``export/`` an export's weights and marker."""
    out: list[str] = []
    samples, checkpoints, export = run / "samples", run / "checkpoints", run / "export"
    if samples.is_dir() and not samples.is_symlink():
        out += [f"samples/{f}" for f in _files(samples) if "/" in f.rstrip("/") or not SAMPLE_GRID.match(f)]
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for entry in sorted(checkpoints.iterdir()):
            rel = f"checkpoints/{entry.name}"
            if entry.is_symlink() or not entry.is_dir():
                if not _STEP.match(entry.name):  # a file named step-N is damage, which the readers report
                    out.append(rel)
            elif _STEP.match(entry.name):
                out += [f"{rel}/{f}" for f in unlisted(entry)]
            elif _PARTIAL.match(entry.name):
                out += [f"{rel}/{f}" for f in _files(entry) if not _weights(f) or f.endswith("/")]
            else:
                out.append(rel + "/")
    if export.is_dir() and not export.is_symlink():
        out += [f"export/{f}" for f in _files(export) if f != marker and (not _weights(f) or f.endswith("/"))]
    return sorted(out)


def written_summary(run: Path) -> str:
    """What a run folder holds, in a few words (what ``train.overwrite`` says it removed): ``config.yaml,
    metrics.jsonl (12 records), 2 checkpoints (step-4, step-8), 3 sample grids``."""
    from flowrl.run.outputs import logged_records

    words = [name for name in ("config.yaml", "reward_curve.png") if (run / name).is_file()]
    if (run / "metrics.jsonl").is_file():
        words.append(f"metrics.jsonl ({len(logged_records(run / 'metrics.jsonl'))} records)")
    checkpoints = run / "checkpoints"
    steps = sorted(
        (p.name for p in checkpoints.iterdir() if _STEP.match(p.name)) if checkpoints.is_dir() else [],
        key=lambda name: int(name.split("-")[1]),
    )
    if steps:
        shown = ", ".join(steps[:5]) + (", …" if len(steps) > 5 else "")
        words.append(f"{len(steps)} checkpoint{'s' if len(steps) != 1 else ''} ({shown})")
    grids = [p for p in (run / "samples").iterdir() if p.is_file()] if (run / "samples").is_dir() else []
    if grids:
        words.append(f"{len(grids)} sample grid{'s' if len(grids) != 1 else ''}")
    if (run / "export").is_dir():
        words.append("export/")
    return ", ".join(words) or "nothing but empty folders"
