"""What a resumed run may change: the settings that changed since a checkpoint was written (:func:`config_changes`),
except those a resume may change freely (:data:`RESUME_FREE`); :data:`SHAPE_KEYS` change the trained weights' shapes,
so :class:`~flowrl.run.folder.RunFolder` refuses a resume that changes one."""

from __future__ import annotations

from typing import Any

# Keys a resumed run may change freely (how long, how often, where it logs, how it evaluates), and keys that
# decide the shapes of the trained weights (a resume that changes one cannot load its checkpoint).
RESUME_FREE = (
    "train.resume",
    "train.overwrite",
    "train.max_steps",
    "train.max_minutes",
    "train.progress",
    "train.num_threads",
    "train.log_with",
    "train.checkpoint_every",
    "train.keep_last",
    "train.async_reward",
    "model.device",
    "eval.",
)
SHAPE_KEYS = (
    "model.family",
    "model.path",
    "model.full_finetune",
    "model.lora.rank",
    "model.lora.targets",
    "model.height",
    "model.width",
)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every dotted key that differs between two
    :meth:`TrainConfig.to_dict` trees, except :data:`RESUME_FREE` ones; a key only one side has shows
    ``None`` on the other."""

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {
                k: v
                for key, sub in tree.items()
                for k, v in flat(sub, f"{prefix}.{key}" if prefix else str(key)).items()
            }
        return {prefix: tree}

    a, b = flat(saved), flat(current)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not any(k == f or (f.endswith(".") and k.startswith(f)) for f in RESUME_FREE)
    ]
