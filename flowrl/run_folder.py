"""A run's folder ``<train.output_dir>/<train.name>/`` and what protects it: a taken name is continued
(``train.resume``) or replaced (``train.overwrite``), never silently reused; a start that fails before its
first iteration leaves nothing; resume picks the newest intact checkpoint and names every setting that
changed since it was written (docs/reliability.md)."""
from __future__ import annotations

import contextlib
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from flowrl.checkpoint import list_checkpoints, load_weights, read_state, resolve_resume, write_checkpoint
from flowrl.config import ConfigError, TrainConfig
from flowrl.errors import shown
from flowrl.metrics import MetricsLog
from flowrl.process_group import ProcessGroup

# Keys a resumed run may change freely (how long, how often, where it logs, how it evaluates), and keys that
# decide the shapes of the trained weights (a resume that changes one cannot load its checkpoint).
RESUME_FREE = ("train.resume", "train.overwrite", "train.max_steps", "train.max_minutes", "train.progress",
               "train.num_threads", "train.log_with", "train.checkpoint_every", "train.keep_last",
               "train.async_reward", "model.device", "eval.")
SHAPE_KEYS = ("model.family", "model.path", "model.full_finetune", "model.lora.rank", "model.lora.targets",
              "model.height", "model.width")


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every dotted key that differs between two
    :meth:`TrainConfig.to_dict` trees, except :data:`RESUME_FREE` ones; a key only one side has shows
    ``None`` on the other."""
    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}.{key}" if prefix else str(key)).items()}
        return {prefix: tree}

    a, b = flat(saved), flat(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not any(k == f or (f.endswith(".") and k.startswith(f)) for f in RESUME_FREE)]


DAMAGE = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError)  # an unreadable checkpoint


class RunFolder:
    def __init__(self, cfg: TrainConfig, group: ProcessGroup):
        self.cfg, self.group = cfg, group
        self.path = Path(cfg.train.output_dir) / cfg.train.name
        self.claimed = False  # whether this run has checked (or replaced) the folder

    # ---- the name -------------------------------------------------------------------------------
    def check_name(self) -> None:
        """Refuse a folder that already holds a run unless ``train.resume`` or ``train.overwrite`` is set."""
        t = self.cfg.train
        held = [name for name in ("metrics.jsonl", "checkpoints") if (self.path / name).exists()]
        if held and not t.resume and not t.overwrite:
            raise ConfigError(f"train.name={t.name!r}: {self.path} already holds a run ({', '.join(held)}); continue "
                              "it with train.resume=latest, choose another train.name, or replace it with "
                              "train.overwrite=true")

    @contextlib.contextmanager
    def claim(self, step: Callable[[], int]) -> Iterator[None]:
        """Hold the folder for one ``train()`` call: checked, and emptied first with ``train.overwrite``, on the
        first call; removed again when this call created it and fails before the first iteration (``step()``
        still 0): a failed start leaves nothing."""
        if not self.claimed:  # a second train() call continues what the first one wrote
            self.check_name()
            if self.group.is_main and self.cfg.train.overwrite and self.path.exists():
                shutil.rmtree(self.path)
            self.claimed = True
        self.group.wait()
        fresh, start = not self.path.exists(), step()
        try:
            yield
        except Exception:
            if self.group.is_main and fresh and start == step() == 0:
                shutil.rmtree(self.path, ignore_errors=True)
            raise

    # ---- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def save(self, step: int, write_weights: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """``checkpoints/step-N`` written atomically; the oldest beyond ``train.keep_last`` pruned."""
        return write_checkpoint(self.checkpoints, step, write_weights, state, self.cfg.train.keep_last)

    def read_intact(self, path: Path, model, weights_finite: Callable[[], bool]) -> dict[str, Any]:
        """The state of checkpoint ``path`` with its weights loaded into ``model``, after checking its settings
        against this run's (:meth:`check_changes`); raises a :data:`DAMAGE` error when it is unreadable or
        its weights are not finite, a ConfigError when this run refuses it."""
        state = read_state(path)
        self.check_changes(state.get("config"), path)
        load_weights(model, path / "live" if (path / "live").is_dir() else path)
        if not weights_finite():
            raise ValueError("its weights are not finite")
        return state

    def find_resume(self, spec: str, read: Callable[[Path], dict]) -> tuple[Path, dict] | None:
        """``train.resume``: a checkpoint folder, or ``latest`` — the newest intact checkpoint of the run; one
        that ``read`` finds damaged is reported and the one before it tried. None: nothing to resume."""
        if spec != "latest":
            path = resolve_resume(spec, self.checkpoints)
            try:
                return path, read(path)
            except ConfigError:
                raise
            except ValueError as e:
                raise ValueError(f"train.resume={spec!r}: {e}") from None
        found = list_checkpoints(self.checkpoints)
        for _, path in reversed(found):
            try:
                return path, read(path)
            except ConfigError:  # a refusal (e.g. another LoRA rank), not damage
                raise
            except DAMAGE as e:
                warnings.warn(f"checkpoint {path} is damaged ({str(e).splitlines()[0][:200]}); trying the one before it",
                              RuntimeWarning, stacklevel=2)
        if found:
            raise ValueError(f"train.resume='latest': every checkpoint in {self.checkpoints} is damaged; "
                             "nothing was changed (move the folder away to start afresh)")
        return None

    def check_changes(self, saved: dict | None, path: Path) -> None:
        """Name every setting that changed since checkpoint ``path`` was written: a warning, or a ConfigError
        for one that changes the trained weights' shapes (:data:`~flowrl.config.SHAPE_KEYS`)."""
        if not isinstance(saved, dict):
            return
        changes = config_changes(saved, self.cfg.to_dict())
        listed = "; ".join(f"{k}: {shown(old, 60)} → {shown(new, 60)}" for k, old, new in changes)
        shaped = [k for k, _, _ in changes if k in SHAPE_KEYS or k.startswith("model.lora.targets")]
        if shaped:
            raise ConfigError(f"cannot resume from {path}: {', '.join(shaped)} changed ({listed}); the checkpoint's "
                              "weights have other shapes. Resume with the saved values or start a new train.name")
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
        done = bool(records) and records[-1]["step"] == step and (
            not has_eval or any(k.startswith("eval/") for k in records[-1]))
        return self.group.sum(done) > 0
