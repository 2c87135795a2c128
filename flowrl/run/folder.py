"""A run's folder ``<train.output_dir>/<train.name>/`` and what protects it: one process owns it at a time
(an OS lock, :class:`FolderLock`); a taken name is continued (``train.resume``) or replaced
(``train.overwrite``, only a folder that is a run), never silently reused; a start that fails or is stopped
before its first iteration leaves nothing; resume picks the newest intact checkpoint and names every
setting that changed since it was written (docs/reliability.md). The lock is :mod:`flowrl.run.folder_lock`, what a
resume may change :mod:`flowrl.run.config_changes`."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from flowrl.config.checks import check_run_name
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.distributed.process_group import ProcessGroup
from flowrl.errors import shown
from flowrl.run.checkpoint import list_checkpoints, load_weights, read_state, remove, resolve_resume, write_checkpoint
from flowrl.run.config_changes import RESUME_FREE, SHAPE_KEYS, config_changes  # noqa: F401 (re-exported)
from flowrl.run.folder_lock import FolderLock  # noqa: F401 (re-exported)
from flowrl.run.manifest import DamagedCheckpoint, unwritten, written_summary
from flowrl.run.metrics_log import MetricsLog
from flowrl.run.outputs import LOCK_FILE, MARKER, RUN_ENTRIES, check_output, logged_records  # noqa: F401 (re-exported)
from flowrl.run.sharded_checkpoint import SHARDED_DIR, is_sharded_checkpoint, save_shards
from flowrl.run.signals import abort_on_terminate, signals_ignored

DAMAGE = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError)  # an unreadable checkpoint


class RunFolder:
    def __init__(self, cfg: TrainConfig, group: ProcessGroup):
        check_run_name(cfg.train.name)
        self.cfg, self.group = cfg, group
        self.path = Path(cfg.train.output_dir) / cfg.train.name
        self.lock = FolderLock(self.path)
        self.claimed = False  # whether this run has checked (or replaced) the folder

    # ---- the name -------------------------------------------------------------------------------
    def check_name(self) -> None:
        """Refuse a folder that already holds a run unless ``train.resume`` or ``train.overwrite`` is set."""
        t = self.cfg.train
        held = [name for name in ("metrics.jsonl", "checkpoints") if (self.path / name).exists()]
        if held and not t.resume and not t.overwrite:
            raise ConfigError(
                f"train.name={t.name!r}: {self.path} already holds a run ({', '.join(held)}); continue "
                "it with train.resume=latest, choose another train.name, or replace it with "
                "train.overwrite=true"
            )

    def is_run(self) -> bool:
        """Whether the folder is a flowrl run that ``train.overwrite`` may remove: it holds a config.yaml and a
        metrics.jsonl, or nothing but what a run writes (:data:`RUN_ENTRIES`)."""
        names = {p.name for p in self.path.iterdir()}
        return {"config.yaml", "metrics.jsonl"} <= names or names <= RUN_ENTRIES

    def foreign_entries(self) -> list[str]:
        """What the folder holds that a run does not write, at every depth, sorted, folders with a trailing ``/``: its
        entries that are not :data:`RUN_ENTRIES` (nor the tensorboard tracker's folder named after the run, which holds
        only event files), and inside the run's own entries what its manifests do not list
        (:func:`flowrl.run.manifest.unwritten`: ``samples/my_figure.png``, ``checkpoints/step-1/notes.txt``)."""

        def tracker(entry: Path) -> bool:
            return (
                entry.name == self.cfg.train.name
                and entry.is_dir()
                and all(p.is_dir() or p.name.startswith("events.out.tfevents") for p in entry.rglob("*"))
            )

        top = [
            p.name + ("/" if p.is_dir() else "")
            for p in self.path.iterdir()
            if p.name not in RUN_ENTRIES and not tracker(p)
        ]
        return sorted(top + unwritten(self.path, MARKER))

    def replace(self) -> None:
        """``train.overwrite``: empty the folder (the lock file stays, held), refusing one that is not a run, and a run
        folder that holds anything a run does not write (a benchmark's output, a rollout store, a note, a figure put
        into ``samples/``), listed. Says what it removed."""
        if not self.is_run():
            raise ConfigError(
                f"train.overwrite=true: {self.path} is not a flowrl run (it holds no config.yaml and "
                "metrics.jsonl); nothing was deleted. Choose another train.name or move it away"
            )
        foreign = self.foreign_entries()
        if foreign:
            listed = ", ".join(foreign[:20]) + (f", … ({len(foreign) - 20} more)" if len(foreign) > 20 else "")
            raise ConfigError(
                f"train.overwrite=true: {self.path} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
                f"that a run does not write: {listed}; nothing was deleted (an overwrite removes the whole folder). "
                "Move them out of the run folder, or choose another train.name"
            )
        removed = [child for child in self.path.iterdir() if child.name != LOCK_FILE]
        said = written_summary(self.path)
        for child in removed:
            remove(child)
        if removed:  # said: an earlier run's records and checkpoints are gone
            print(f"train.overwrite=true: removed the earlier run in {self.path} ({said})", flush=True)

    def _agree(self, error: Exception | None) -> None:
        """Raise ``error`` on the main process, a ConfigError on the others, when the main process failed."""
        if self.group.sum(error is not None) > 0:
            raise error or ConfigError(f"the main process could not claim the run folder {self.path}")

    def _take(self) -> tuple[list[Path], bool, set[str]]:
        """The main process: make the folder (and missing parents), lock it, check the name and, with
        ``train.overwrite``, empty it. Returns (the folders it made, whether it holds only this run, the
        names in it now)."""
        made = [p for p in (self.path, *self.path.parents) if not p.exists() and not p.is_symlink()][::-1]
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_dir():
            raise ConfigError(
                f"train.name={self.cfg.train.name!r}: {self.path} is a file, not a run folder; "
                "choose another train.name"
            )
        # flowrl/run/outputs.py's rule: a new folder, a run (train.overwrite refuses anything else itself), nothing
        # inside another run's entries, no parent that is a file
        check_output(
            self.path,
            "flowrl train",
            f"train.name={self.cfg.train.name!r} ({self.path})",
            recognise=lambda _: self.cfg.train.overwrite or self.is_run(),
        )
        self.path.mkdir(parents=True, exist_ok=True)
        holder = self.lock.acquire()
        if holder is not None:
            raise ConfigError(
                f"train.name={self.cfg.train.name!r}: {self.path} is in use by another flowrl process "
                f"({holder}); one process owns a run folder at a time, whatever train.resume or "
                "train.overwrite say. Wait for it to end, stop it, or choose another train.name"
            )
        try:
            own = self.path in made
            if not self.claimed:
                self.check_name()
                if self.cfg.train.overwrite:
                    self.replace()
                    own = True
            return made, own, {p.name for p in self.path.iterdir()}
        except BaseException:  # a refused name or overwrite: the folder as it was, lock released
            if self.path in made:
                self._remove(made, set(), True)
            self.lock.release()
            raise

    @contextlib.contextmanager
    def claim(self, step: Callable[[], int]) -> Iterator[None]:
        """Own the folder for one ``train()`` call: the main process locks it before looking at or writing
        anything (a second process of the same name is refused, naming the holder), checks the name and
        empties it with ``train.overwrite`` on the first call. A call that fails or is stopped (Ctrl-C twice,
        SIGTERM during the start) before its first iteration finishes (``step()`` still 0) removes what it
        created: the folder when it made it or replaced a run, else the entries that were not there."""
        main = self.group.is_main
        with abort_on_terminate():
            made, own, before, error = [], False, set(), None
            if main:
                try:
                    made, own, before = self._take()
                except Exception as e:  # noqa: BLE001 — handed to every process by _agree
                    error = e
            self._agree(error)
            if not main and not self.claimed:
                self.check_name()
            self.claimed = True
            try:
                self.group.wait()
                start = step()
                try:
                    yield
                except BaseException as e:
                    if main and start == step() == 0:
                        self._remove(made, before, own)
                        if isinstance(e, KeyboardInterrupt):
                            print(
                                f"stopped before the first iteration finished: removed what this start created "
                                f"in {self.path}",
                                file=sys.stderr,
                            )
                    raise
            finally:
                if main:
                    self.lock.release()

    def _remove(self, made: list[Path], before: set[str], own: bool) -> None:
        """Remove what a failed start created: the whole folder when it is this run's alone, else its new
        entries; then the parent folders it made, when empty. Signals wait until it is done."""
        with signals_ignored():
            if own:
                children = list(self.path.iterdir()) if self.path.is_dir() else []
            else:
                children = [p for p in self.path.iterdir() if p.name not in before and p.name != LOCK_FILE]
            for child in children:
                if child.name != LOCK_FILE:
                    remove(child)
            if own:
                self.lock.release()
                with contextlib.suppress(OSError):
                    self.path.rmdir()
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when empty

    # ---- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def save(self, step: int, write_weights: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """``checkpoints/step-N`` written atomically; the oldest beyond ``train.keep_last`` pruned."""
        return write_checkpoint(self.checkpoints, step, write_weights, state, self.cfg.train.keep_last)

    def save_sharded(
        self, step: int, shards: dict, write_weights: Callable[[Path], None], state: dict[str, Any]
    ) -> Path | None:
        """``checkpoints/step-N`` of a sharded run (:mod:`flowrl.run.sharded_checkpoint`), every process calling:
        each writes its ``shards`` into a staging folder named by the main process, which then writes the
        checkpoint atomically (:meth:`save`) with the shards moved inside. The path, on the main process."""
        staging = self.checkpoints / f".step-{step}.shards-{self.group.broadcast(os.getpid())}"
        error, path = None, None
        try:
            save_shards(shards, staging, self.group.dist_group)
        except Exception as e:  # noqa: BLE001 — agreed on below, so no process waits for another forever
            error = e
        self.group.wait()
        if self.group.is_main and error is None:

            def write(folder: Path) -> None:
                os.replace(staging, folder / SHARDED_DIR)
                write_weights(folder)

            try:
                path = self.save(step, write, state)
            except Exception as e:  # noqa: BLE001
                error = e
        if self.group.is_main and staging.exists():  # shards a failed write left behind
            remove(staging)
        if self.group.sum(error is not None) > 0:
            raise error or OSError(
                f"another process could not write its shards of checkpoint step-{step}; the "
                "previous checkpoints are intact"
            )
        return path

    def read_intact(self, path: Path, model, weights_finite: Callable[[], bool], sharded=None) -> dict[str, Any]:
        """The state of checkpoint ``path`` with its weights loaded into ``model``, after checking its settings
        against this run's (:meth:`check_changes`); raises a :data:`DAMAGE` error when it is unreadable or
        its weights are not finite, a ConfigError when this run refuses it. ``sharded``: a sharded run's
        ``read(path, state) -> state`` that loads the shards (every process calls it)."""
        state = read_state(path)
        self.check_changes(state.get("config"), path)
        written_sharded = is_sharded_checkpoint(path)
        if written_sharded != (sharded is not None):
            was, now = ("fsdp", "ddp") if written_sharded else ("ddp", "fsdp")
            raise ConfigError(
                f"cannot resume from {path}: it was written with model.shard={was}, this run has "
                f"model.shard={now}; resume with model.shard={was}"
                + (" (or `flowrl export` its weights and start a new run from them)" if written_sharded else "")
            )
        if sharded is not None:
            state = sharded(path, state)
        else:
            load_weights(model, path / "live" if (path / "live").is_dir() else path)
        if not weights_finite():
            raise ValueError("its weights are not finite")
        return state

    def find_resume(self, spec: str, read: Callable[[Path], dict]) -> tuple[Path, dict] | None:
        """``train.resume``: a checkpoint folder, or ``latest`` — the newest intact checkpoint of the run; one
        that ``read`` finds damaged is reported and the one before it tried. The main process prints the
        checkpoint and step it continues from. None: nothing to resume (said; refused when the run has logged
        records, :meth:`nothing_to_resume`)."""
        if spec != "latest":
            path = resolve_resume(spec, self.checkpoints)
            try:
                return self._resuming(path, read(path))
            except ConfigError:
                raise
            except ValueError as e:
                raise ValueError(f"train.resume={spec!r}: {e}") from None
        found = [path for _, path in list_checkpoints(self.checkpoints)]
        for i in reversed(range(len(found))):
            try:
                return self._resuming(found[i], read(found[i]))
            except ConfigError:  # a refusal (e.g. another LoRA rank), not damage
                raise
            except DAMAGE as e:
                then = f"falling back to the one before it, {found[i - 1]}" if i else "there is none before it"
                what = (
                    str(e)
                    if isinstance(e, DamagedCheckpoint)
                    else f"checkpoint {found[i]} is damaged ({str(e).splitlines()[0][:300]})"
                )
                warnings.warn(f"{what}; {then}", RuntimeWarning, stacklevel=2)
        if found:
            raise ValueError(
                f"train.resume='latest': every checkpoint in {self.checkpoints} is damaged; "
                "nothing was changed (move the folder away to start afresh)"
            )
        self.nothing_to_resume()
        return None

    def _resuming(self, path: Path, state: dict) -> tuple[Path, dict]:
        """(path, state) of the checkpoint a resume continues from, said in one line by the main process."""
        if self.group.is_main:
            print(f"resuming from {path} at step {int(state.get('step', 0))}", flush=True)
        return path, state

    def nothing_to_resume(self) -> None:
        """``train.resume=latest`` without a checkpoint: refused (ConfigError naming ``train.overwrite``) when
        ``metrics.jsonl`` holds records of a start that ended before its first checkpoint (a ``kill -9``), which
        a start afresh would erase; else the main process says it starts at step 0."""
        records = logged_records(self.path / "metrics.jsonl")
        if records:
            steps = max((r["step"] for r in records if isinstance(r.get("step"), (int, float))), default=0)
            raise ConfigError(
                f"train.resume=latest: {self.path} has no checkpoint to continue from, but its "
                f"metrics.jsonl holds {len(records)} records (up to step {steps}) of a start that ended "
                "before its first checkpoint; nothing was changed. Start it again with "
                "train.overwrite=true (its records are replaced), or choose another train.name"
            )
        if self.group.is_main:
            print(f"train.resume=latest: no checkpoint in {self.checkpoints}; starting at step 0", flush=True)

    def check_changes(self, saved: dict | None, path: Path) -> None:
        """Name every setting that changed since checkpoint ``path`` was written: a warning, or a ConfigError
        for one that changes the trained weights' shapes (:data:`~flowrl.run.config_changes.SHAPE_KEYS`)."""
        if not isinstance(saved, dict):
            return
        changes = config_changes(saved, self.cfg.to_dict())
        listed = "; ".join(f"{k}: {shown(old, 60)} → {shown(new, 60)}" for k, old, new in changes)
        shaped = [k for k, _, _ in changes if k in SHAPE_KEYS or k.startswith("model.lora.targets")]
        if shaped:
            raise ConfigError(
                f"cannot resume from {path}: {', '.join(shaped)} changed ({listed}); the checkpoint's "
                "weights have other shapes. Resume with the saved values or start a new train.name"
            )
        if changes and self.group.is_main:
            warnings.warn(f"resuming from {path} with changed settings: {listed}", RuntimeWarning, stacklevel=4)

    # ---- metrics ------------------------------------------------------------------------------------
    def metrics(self, resume_step: int | None) -> MetricsLog | None:
        """The main process's ``metrics.jsonl`` (kept up to ``resume_step`` when resuming, else emptied)."""
        return MetricsLog(self.path / "metrics.jsonl", resume_step=resume_step) if self.group.is_main else None

    def finished(self, log: MetricsLog | None, step: int, has_eval: bool) -> bool:
        """Whether ``log`` ends with ``step``'s final record (its closing eval, or the step itself without eval
        prompts), on any process: resuming a finished run again adds nothing."""
        records = log.read() if log is not None else []
        done = (
            bool(records)
            and records[-1]["step"] == step
            and (not has_eval or any(k.startswith("eval/") for k in records[-1]))
        )
        return self.group.sum(done) > 0
