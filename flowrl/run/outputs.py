"""Where a command may write: the one rule for every path a user names for output (``export --out``,
``sample --out``, ``eval --out``, ``eval --benchmark … --out``, ``compare --out``, ``data fetch --out``, and
``train.output_dir`` / ``train.name``).

    target = check_output(args.out, "flowrl export")     # before any model time: refuses, naming the path
    ...
    target.make()                                       # the folder (and parents), with its marker when new

A command writes into a folder it creates (new, or existing and empty) or one it recognises as its own: a
marker it wrote there (``.flowrl-output.json`` naming the command) or, for folders written before markers,
the command's own recognition (a run folder's files, a comparison's ``status.json``, a prompt set's
``manifest.json``). Anything else is refused with a message naming the path: an existing file, ``.`` or
``..``, a folder the command did not write (a command whose nature is to add files, ``mode="adds"``, adds to
one without replacing anything), a run folder or any path inside one (its ``checkpoints/``, but also a new
``bench/`` beside them: ``train.overwrite`` replaces the run's folder, and nothing else may live there; only
``export`` may write its run's ``export/``). Nothing here moves or removes anything.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flowrl.errors import ConfigError

MARKER = ".flowrl-output.json"
LOCK_FILE = ".flowrl.lock"
# What a run writes into its folder (and its tensorboard tracker's folder, named after the run): a folder holding only
# these (or a config.yaml and a metrics.jsonl) is a run; train.overwrite replaces one that holds nothing else, and no
# other command writes anywhere inside a run folder.
RUN_ENTRIES = {"config.yaml", "metrics.jsonl", "reward_curve.png", "samples", "checkpoints", "export", LOCK_FILE}
_STEP = re.compile(r"^step-\d+$")
MODES = ("own", "new", "adds")


@dataclass
class Output:
    """A checked output folder: ``state`` is ``new`` (absent), ``empty``, ``own`` (the command's, from before)
    or ``adds`` (a folder the command adds files to without having made it); ``mode`` as :func:`check_output`."""

    path: Path
    command: str
    state: str
    mode: str = "own"

    def make(self) -> Path:
        """Create the folder (and missing parents) and, when it is new or was empty, its marker (not for a command
        that adds files, ``mode="adds"``: it needs none to add to a folder again)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.state in ("new", "empty") and self.mode != "adds":
            write_marker(self.path, self.command)
        return self.path


def write_marker(folder: Path, command: str) -> None:
    """``folder/.flowrl-output.json``: which flowrl command wrote the folder, and when."""
    record = {"command": command, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid()}
    (Path(folder) / MARKER).write_text(json.dumps(record) + "\n")


def marker_command(folder: Path) -> str | None:
    """The command named by ``folder``'s marker, or None (no marker, or one that cannot be read)."""
    try:
        record = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record.get("command") if isinstance(record, dict) and isinstance(record.get("command"), str) else None


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a flowrl run: a config.yaml with a metrics.jsonl, a run's lock file, or
    ``checkpoints/step-N`` entries."""
    if (folder / LOCK_FILE).is_file() or ((folder / "config.yaml").is_file() and (folder / "metrics.jsonl").is_file()):
        return True
    checkpoints = folder / "checkpoints"
    try:
        return checkpoints.is_dir() and any(_STEP.match(p.name) for p in checkpoints.iterdir())
    except OSError:
        return False


def logged_records(path: Path) -> list[dict]:
    """The whole records of a run's metrics.jsonl (a torn line skipped), read without changing it; [] when absent."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def unfinished_start(folder: Path) -> bool:
    """Whether run folder ``folder`` holds logged records but no checkpoint: a start stopped (``kill -9``) before its
    first checkpoint, which ``train.resume=latest`` refuses to continue (its records would be erased)."""
    checkpoints = Path(folder) / "checkpoints"
    saved = checkpoints.is_dir() and any(_STEP.match(p.name) for p in checkpoints.iterdir())
    return not saved and bool(logged_records(Path(folder) / "metrics.jsonl"))


def check_output(
    path: str | Path,
    command: str,
    label: str = "--out",
    *,
    mode: str = "own",
    recognise: Callable[[Path], bool] | None = None,
    run_entry: str | None = None,
) -> Output:
    """The rule, checked without writing anything: ``path`` may be written by ``command`` (e.g. ``"flowrl export"``)
    when it is new, an empty folder, or one of the command's own (its marker, or ``recognise(path)`` for folders
    written before markers). ``mode``: ``own`` (those), ``new`` (an own folder is refused too: the command
    would replace its files) or ``adds`` (any folder that is not a run's: files are added, never replaced).
    ``run_entry``: the one entry of a run folder the command writes (``export``), and nothing else inside a
    run. Else a ConfigError that starts with ``label`` and names the path and what is accepted."""
    if mode not in MODES:
        raise ValueError(f"check_output: mode={mode!r} must be one of {MODES}")
    path = Path(path)
    where = f"{label}={str(path)!r}" if label.startswith("-") and " " not in label else label  # a flag, or said whole
    if path.name in ("", ".", ".."):
        if path.name == "..":
            what = "a parent folder"
        elif path.anchor and path == Path(path.anchor):  # '/' (its name is empty, as the working directory's)
            what = f"the file system's root {path.anchor!r}"
        else:
            what = "the working directory"
        raise ConfigError(
            f"{where} names {what}, which {command} did not create and never writes into; accepted: "
            "the name of a new folder (or an empty one)"
        )
    _check_ancestors(path, where, command, run_entry)
    own_entry = run_entry is not None and path.name == run_entry and is_run_folder(path.parent)
    if not (path.exists() or path.is_symlink()):
        return Output(path, command, "new", mode)
    if not path.is_dir():
        raise ConfigError(
            f"{where} is an existing file, not a folder; {command} writes a folder and never replaces "
            "a file: name a new folder"
        )
    if recognise is None and is_run_folder(path):
        raise ConfigError(
            f"{where} is a flowrl run folder; {command} writes into a folder of its own, never into a "
            "run's: name a new folder"
        )
    if not any(path.iterdir()):
        return Output(path, command, "empty", mode)
    written_by = marker_command(path)
    if written_by == command or own_entry or (recognise is not None and recognise(path)):
        if mode == "new":
            raise ConfigError(
                f"{where} holds an earlier {command}, whose files this one would replace; nothing was "
                "changed: name a new folder (or move that one away)"
            )
        return Output(path, command, "own", mode)
    if mode == "adds" and written_by is None:
        return Output(path, command, "adds", mode)
    who = (
        f"written by {written_by}"
        if written_by
        else f"not written by {command}" + ("" if recognise is not None else f" (it holds no {MARKER})")
    )
    raise ConfigError(
        f"{where} is an existing folder {who}; {command} never replaces what it did not write, so "
        "nothing was changed: name a new folder, an empty one, or an earlier output of "
        f"{command}"
    )


def _check_ancestors(path: Path, where: str, command: str, run_entry: str | None) -> None:
    """No parent of ``path`` is a file, and ``path`` lies inside no run folder (:func:`is_run_folder`), at any depth:
    a run's folder is the run's alone (``train.overwrite`` replaces it). ``run_entry``: the one entry the command
    writes directly inside its run (``export``)."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise ConfigError(f"{where}: {parent} is a file, not a folder; name a folder whose parents are folders")
            break
    resolved = path.resolve()
    for parent in resolved.parents:
        if not is_run_folder(parent):
            continue
        if run_entry is not None and resolved == parent / run_entry:
            continue
        entry = resolved.relative_to(parent).parts[0]
        inside = f"its {entry}/" if entry in RUN_ENTRIES else f"{resolved.relative_to(parent)}, not one of its entries"
        raise ConfigError(
            f"{where} lies inside the run folder {parent} ({inside}), which {command} never writes"
            f"{f' except its own {run_entry}/' if run_entry else ''}: a run's folder is the run's alone, "
            "and a later train.overwrite=true of that run would delete it; nothing was changed: name a "
            "folder outside the run"
        )
