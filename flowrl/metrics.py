"""Run outputs: ``metrics.jsonl`` (one JSON object per iteration or eval), trackers, the reward curve."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends JSON lines to ``path``; on resume keeps only lines with ``step <= resume_step``."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            kept = [json.dumps(r) for r in self.read() if r.get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (float(v) if hasattr(v, "item") else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """The records; a line that is not a JSON object (torn by a kill mid-write) is skipped with a warning
        naming the file and line."""
        if not self.path.exists():
            return []
        records = []
        for i, line in enumerate(self.path.read_text(errors="replace").splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                warnings.warn(f"{self.path} line {i + 1} is not a metrics record (torn by an interrupted write?); "
                              "skipped", RuntimeWarning, stacklevel=2)
                continue
            records.append(record)
        return records


def plot_reward_curve(records: list[dict[str, Any]], out: Path, key: str = "reward_mean") -> None:
    """PNG of the training reward per iteration (and eval points, when present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r[key]) for r in records if key in r and r[key] is not None and not math.isnan(r[key])]
    evals = {k for r in records for k in r if k.startswith(("eval/", "eval_default/")) and k.endswith("_mean")}
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.5, label="train reward")
        if len(train) >= 5:
            w = max(2, len(train) // 10)
            ys = [sum(y for _, y in train[max(0, i - w + 1):i + 1]) / len(train[max(0, i - w + 1):i + 1]) for i in range(len(train))]
            ax.plot([s for s, _ in train], ys, lw=2, label=f"train reward (mean of {w})")
    for k in sorted(evals):
        pts = [(r["step"], r[k]) for r in records if k in r]
        ax.plot(*zip(*pts), "o-", label=k)
    base = next((r for r in records if any(k.startswith("eval_default/") for k in r)), None)
    if base is not None and base.get("step") == 0:  # the untouched model at its default guidance: the bar to beat
        for k in sorted(k for k in evals if k.startswith("eval_default/") and k in base):
            g = base.get("eval_default/guidance")
            ax.axhline(base[k], ls="--", lw=1, color="gray",
                       label=f"base model, guidance {g:g}" if g is not None else "base model, default guidance")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
