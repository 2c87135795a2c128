"""What a run shows of its metrics: eval grids to the trackers and the reward curve (``reward_curve.png``); the
metrics themselves are appended to ``metrics.jsonl`` by :class:`flowrl.run.metrics_log.MetricsLog`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def log_grid_image(accelerator, log_with: str, tag: str, image, step: int) -> None:
    """One PIL image (an eval's labelled grid) to accelerate's tracker ``log_with`` at ``step`` under ``tag``:
    tensorboard's ``add_images`` (one HWC image), wandb's ``wandb.Image``; nothing for ``none``."""
    if log_with == "none":
        return
    tracker = accelerator.get_tracker(log_with)
    if log_with == "tensorboard":
        import numpy as np

        tracker.log_images({tag: np.asarray(image.convert("RGB"))[None]}, step=step, dataformats="NHWC")
    else:
        tracker.log_images({tag: [image]}, step=step)


def _is_train_key(key: str) -> bool:
    """A training reward term's held-out mean (``eval/train/<name>/mean``,
    :func:`flowrl.training.evaluation.train_key`)."""
    return key.startswith(("eval/train/", "eval_default/train/")) and key.endswith("/mean")


def _points(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]


def _plot_train(ax, records: list[dict[str, Any]], key: str) -> None:
    """The training reward per iteration and its running mean."""
    train = _points(records, key)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.5, label="train reward")
        if len(train) >= 5:
            w = max(2, len(train) // 10)
            ys = [
                sum(y for _, y in train[max(0, i - w + 1) : i + 1]) / len(train[max(0, i - w + 1) : i + 1])
                for i in range(len(train))
            ]
            ax.plot([s for s, _ in train], ys, lw=2, label=f"train reward (mean of {w})")


def _plot_evals(ax, records: list[dict[str, Any]], keys: list[str]) -> None:
    """Each eval key at its evals (before, periodic, after), and the untouched model at its default guidance (the
    step-0 ``eval_default/`` values) as dashed lines: the bar to beat."""
    for k in keys:
        pts = _points(records, k)
        if pts:
            ax.plot(*zip(*pts), "o-", label=k)
    base = next((r for r in records if any(k.startswith("eval_default/") for k in r)), None)
    if base is not None and base.get("step") == 0:
        for k in (k for k in keys if k.startswith("eval_default/") and k in base):
            g = base.get("eval_default/guidance")
            ax.axhline(
                base[k],
                ls="--",
                lw=1,
                color="gray",
                label=f"base model, guidance {g:g}" if g is not None else "base model, default guidance",
            )


def _plot_guard(axes, guard_ax, records: list[dict[str, Any]]) -> None:
    """The eval guard (``eval.guard``): its threshold on ``guard_ax``, and the step where it tripped on every axis."""
    threshold = next((r["guard/threshold"] for r in records if "guard/threshold" in r), None)
    if threshold is not None:
        guard_ax.axhline(threshold, ls=":", lw=1.5, color="red", label="eval guard threshold")
    for r in records:
        if r.get("guard/tripped") == 1:
            for ax in axes:
                ax.axvline(r["step"], color="red", lw=1, label="stopped by the eval guard" if ax is guard_ax else None)


def reward_curve_figure(records: list[dict[str, Any]], key: str = "reward_mean"):
    """The reward curve of a run's records: the training reward per iteration with the eval rewards' means at each
    eval. When the evals score other rewards than the training one (``eval.rewards``: the training reward's held-out
    means are then ``eval/train/<name>/mean``), two panels sharing the iteration axis, each on its own scale: the
    training reward (per iteration and held out) above, the eval rewards below; the eval guard's threshold and
    trip, when set, on the eval panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in records for k in r}
    evals = sorted(k for k in keys if k.startswith(("eval/", "eval_default/")) and k.endswith("_mean"))
    held_out = sorted(k for k in keys if _is_train_key(k))
    if held_out:
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(6, 5.5), dpi=120)
        _plot_train(top, records, key)
        _plot_evals(top, records, held_out)
        _plot_evals(bottom, records, evals)
        top.set_ylabel("training reward")
        bottom.set_ylabel("eval rewards")
        axes = [top, bottom]
    else:
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        _plot_train(ax, records, key)
        _plot_evals(ax, records, evals)
        ax.set_ylabel("reward")
        axes = [ax]
    _plot_guard(axes, axes[-1], records)
    axes[-1].set_xlabel("iteration")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_reward_curve(records: list[dict[str, Any]], out: Path, key: str = "reward_mean") -> None:
    """PNG of :func:`reward_curve_figure`: the training reward per iteration, the eval rewards at each eval."""
    import matplotlib.pyplot as plt

    fig = reward_curve_figure(records, key)
    fig.savefig(out)
    plt.close(fig)
