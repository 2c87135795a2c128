"""``flowrl compare``'s results (:mod:`flowrl.commands.compare` runs the comparison): each run folder's curves and
totals read back, the noise of a final metric and each pair of configs' verdict, and what is written to ``OUT``:
``results.md``, ``curves.png`` and ``commands.sh``."""

from __future__ import annotations

import json
import math
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from flowrl.config.schema import TrainConfig
from flowrl.config.secrets import redact_command


@dataclass
class Run:
    """One (config, seed) of a comparison."""

    label: str
    seed: int
    command: list[str]
    folder: Path

    @property
    def key(self) -> str:
        return f"{self.label}-s{self.seed}"


# ---- reading runs ------------------------------------------------------------------------------
def read_run(folder: Path, metric: str | None = None) -> dict:
    """Curves and totals of one run folder: ``train`` (cumulative seconds, reward) pairs, ``evals`` (images
    drawn, metric) pairs, the final metric, s/iteration, images and rollout forwards."""
    path = folder / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
    metric = metric or _default_metric(records)
    n_key = count_key(metric) if metric else None
    final_n = None
    seconds = images = forwards = 0.0
    train, evals, evals_by_time, at_step = [], [], [], {0: (0.0, 0.0)}
    for r in records:
        if "reward_mean" in r:
            parts = r.get("time/rollout", 0.0) + r.get("time/reward", 0.0) + r.get("time/update", 0.0)
            seconds = r.get("time/train_total", seconds + parts)  # the trainer's own clock where logged
            images += r.get("leaves", 0.0)
            forwards += r.get("rollout_forwards", 0.0)
            train.append((seconds, r["reward_mean"]))
            at_step[int(r["step"])] = (images, seconds)
        elif metric and metric in r:
            drawn, elapsed = at_step.get(int(r["step"]), (images, seconds))
            evals.append((drawn, r[metric]))
            evals_by_time.append((elapsed, r[metric]))
            final_n = r.get(n_key) if n_key else None
    n = len(train)
    return {
        "metric": metric,
        "train": train,
        "evals": evals,
        "evals_by_time": evals_by_time,
        "final": evals[-1][1] if evals else float("nan"),
        "first": evals[0][1] if evals else float("nan"),
        "iterations": n,
        "minutes": seconds / 60,
        "seconds_per_iteration": seconds / n if n else float("nan"),
        "images": images,
        "forwards": forwards,
        "final_n": final_n if final_n is not None or n_key is None or not evals else _eval_images(folder),
    }


def count_key(metric: str) -> str | None:
    """The metric key holding the image count of an accuracy (``eval/shapes/accuracy`` → ``eval/shapes/n``,
    ``…/accuracy/<task>`` → ``…/n/<task>``); None for a metric that is not a pass/fail rate."""
    parts = metric.split("/")
    if "accuracy" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("accuracy")
    return "/".join(parts[:i] + ["n"] + parts[i + 1 :])


def _eval_images(folder: Path) -> float | None:
    """Held-out images of one eval from a run's ``config.yaml`` (prompts × ``eval.images_per_prompt``), or None."""
    try:
        from flowrl.prompts.source import read_prompts

        cfg = TrainConfig.from_yaml(folder / "config.yaml")
        prompts = read_prompts(cfg.prompts.eval, "prompts.eval") if cfg.prompts.eval else []
        prompts = prompts[: cfg.eval.num_prompts] if cfg.eval.num_prompts else prompts
        return float(len(prompts) * cfg.eval.images_per_prompt) or None
    except Exception:  # noqa: BLE001 — a missing or old config: the eval's error is then unknown
        return None


def noise(finals: list[float], counts: list[float | None], binary: bool) -> dict[str, float]:
    """Noise of one config's final metric over its seeds: ``eval_se`` (one run's eval standard error,
    √(p(1−p)/n) for a pass rate p over n images, RMS over seeds; NaN when not a pass rate or n unknown),
    ``sd``/``lo``/``hi`` (spread across seeds) and ``se``, the standard error of the mean:
    √(Σ eval_se²/k² + sd²/k). The seed spread already holds each run's eval noise, so adding both is on
    the safe side; with one seed only the eval's own error is known."""
    k = len(finals)
    nan = float("nan")
    if not k:
        return {"mean": nan, "eval_se": nan, "n": nan, "sd": nan, "lo": nan, "hi": nan, "se": nan, "k": 0}
    ses = [
        math.sqrt(min(max(p, 0.0), 1.0) * (1 - min(max(p, 0.0), 1.0)) / n) if binary and n else nan
        for p, n in zip(finals, counts)
    ]
    sd = statistics.stdev(finals) if k > 1 else nan
    parts = [sum(s * s for s in ses) / k**2 if all(s == s for s in ses) else nan, sd * sd / k if k > 1 else nan]
    known = [v for v in parts if v == v]
    return {
        "mean": statistics.fmean(finals),
        "eval_se": math.sqrt(statistics.fmean(s * s for s in ses)),
        "n": _mean(n or nan for n in counts),
        "sd": sd,
        "lo": min(finals),
        "hi": max(finals),
        "se": math.sqrt(sum(known)) if known else nan,
        "k": k,
    }


def verdict(a: dict[str, float], b: dict[str, float]) -> tuple[float, float, str]:
    """(Δ = b − a of the means, the noise band 2·√(se_a² + se_b²), "within noise" | "beyond noise" | "noise
    unknown")."""
    delta = b["mean"] - a["mean"]
    band = 2.0 * math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    if band != band or delta != delta:
        return delta, band, "noise unknown"
    return delta, band, "within noise" if abs(delta) < band else "beyond noise"


def _default_metric(records: list[dict]) -> str | None:
    keys = [k for r in records for k in r if k.startswith("eval/")]
    for suffix in ("/accuracy", "_mean"):
        found = [k for k in keys if k.endswith(suffix) and k.count("/") <= 2]
        if found:
            return sorted(found)[0]
    return None


def report(runs: list[Run], status: dict[str, dict], out: Path, metric: str | None = None) -> str:
    """Write ``results.md``, ``curves.png`` and ``commands.sh`` (each run's command as it ran); return the Markdown."""
    labels = list(dict.fromkeys(r.label for r in runs))
    data = {r.key: read_run(r.folder, metric) for r in runs}
    metric = metric or next((d["metric"] for d in data.values() if d["metric"]), "eval metric")
    binary = count_key(metric) is not None
    lines = [
        f"# Comparison ({metric}, final held-out value per seed)",
        "",
        "| config | seeds: start → final | mean final | eval s.e. per run (images) | seed std (min–max) | "
        "s.e. of the mean | mean change | training min | s/iteration | images | rollout forwards |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stats = {}
    for label in labels:
        mine = [r for r in runs if r.label == label]
        ok = [data[r.key] for r in mine if status.get(r.key, {}).get("state") == "done"]
        per_seed = ", ".join(
            f"s{r.seed}: "
            + (
                f"{data[r.key]['first']:.3f} → {data[r.key]['final']:.3f}"
                if status.get(r.key, {}).get("state") == "done"
                else status.get(r.key, {}).get("state", "not run")
            )
            for r in mine
        )
        done = [d for d in ok if d["final"] == d["final"]]
        stats[label] = st = noise([d["final"] for d in done], [d["final_n"] for d in done], binary)
        changes = [d["final"] - d["first"] for d in ok]
        eval_se = f"±{st['eval_se']:.3f} ({st['n']:.0f})" if st["eval_se"] == st["eval_se"] else "n/a"
        spread = f"{st['sd']:.3f} ({st['lo']:.3f}–{st['hi']:.3f})" if st["k"] > 1 else ("one seed" if st["k"] else "—")
        lines.append(
            f"| {label} | {per_seed} | {st['mean']:.3f} | {eval_se} | {spread} | "
            f"{'±%.3f' % st['se'] if st['se'] == st['se'] else 'n/a'} | "
            f"{(statistics.fmean(changes) if changes else float('nan')):+.3f} | "
            f"{_mean(d['minutes'] for d in ok):.1f} | {_mean(d['seconds_per_iteration'] for d in ok):.2f} | "
            f"{_mean(d['images'] for d in ok):.0f} | "
            f"{_mean(d['forwards'] for d in ok):.0f} |"
        )
    lines += [
        "",
        "eval s.e.: √(p(1−p)/n) of a pass rate p over the eval's n images (n/a for a metric that is not one); "
        "s.e. of the mean: √(Σ eval s.e.²/k² + seed std²/k) over the k finished seeds.",
    ]
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :] if stats[a]["k"] and stats[b]["k"]]
    if pairs:
        lines += [
            "",
            "Differences of the mean final value; within noise when |Δ| < 2·√(se_a² + se_b²):",
            "",
            "| pair | Δ mean | 2·√(se_a² + se_b²) | verdict |",
            "|---|---|---|---|",
        ]
        for a, b in pairs:
            delta, band, word = verdict(stats[a], stats[b])
            lines.append(f"| {b} − {a} | {delta:+.3f} | {band:.3f} | {word} |")
    failed = {k: v for k, v in status.items() if v.get("state") == "failed"}
    if failed:
        lines += ["", "Failed runs:"] + [
            f"- {k} (rc {v['rc']}, {v['log']}): {' / '.join(v['last_lines'])}" for k, v in failed.items()
        ]
    commands = [  # as run (status.json), every reward secret redacted (flowrl/config/secrets.py)
        shlex.join(redact_command(status.get(r.key, {}).get("command") or r.command)) for r in runs
    ]
    lines += ["", "Commands:", "", "```bash"] + commands + ["```"]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    (out / "commands.sh").write_text("\n".join(commands) + "\n")
    _plot(runs, data, labels, metric, out / "curves.png")
    return text


def _mean(values) -> float:
    values = [v for v in values if v == v]
    return statistics.fmean(values) if values else float("nan")


def _plot(runs: list[Run], data: dict, labels: list[str], metric: str, path: Path) -> None:
    """Three panels: training reward against training wall time, the held-out metric against images drawn
    and against training wall time (evals excluded); every seed thin, the mean of the seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, images_ax, time_ax) = plt.subplots(1, 3, figsize=(15, 4), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, label in enumerate(labels):
        colour = colours[i % len(colours)]
        mine = [data[r.key] for r in runs if r.label == label]
        for d in mine:
            if d["train"]:
                xs, ys = zip(*d["train"])
                w = max(1, len(ys) // 15)
                smooth = [statistics.fmean(ys[max(0, j - w + 1) : j + 1]) for j in range(len(ys))]
                reward_ax.plot([x / 60 for x in xs], smooth, color=colour, lw=0.8, alpha=0.45)
        _seeds_and_mean(images_ax, [d["evals"] for d in mine], colour, label)
        _seeds_and_mean(time_ax, [[(x / 60, y) for x, y in d["evals_by_time"]] for d in mine], colour, label)
        reward_ax.plot([], [], color=colour, label=label)
    reward_ax.set(xlabel="training wall time (min)", ylabel="training reward (moving mean)")
    images_ax.set(xlabel="images drawn", ylabel=metric)
    time_ax.set(xlabel="training wall time (min, evals excluded)", ylabel=metric)
    for ax in (reward_ax, images_ax, time_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _seeds_and_mean(ax, curves: list[list[tuple[float, float]]], colour: str, label: str) -> None:
    """Each seed's (x, y) points thin, and their pointwise mean thick (``mean_curve``)."""
    curves = [c for c in curves if c]
    for c in curves:
        ax.plot(*zip(*c), "o-", color=colour, lw=0.8, ms=3, alpha=0.45)
    if curves:
        ax.plot(*zip(*mean_curve(curves)), "o-", color=colour, lw=2.2, label=f"{label} (mean of {len(curves)})")


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Pointwise mean of the seeds' (x, y) curves: the first ``m - 1`` points (``m`` the fewest) and every
    seed's last point (its final eval). With equal counts that is every point; evals on a wall-time schedule
    can give a seed one more eval just before the budget's end, which is left out."""
    m = min(len(c) for c in curves)
    aligned = [c[: m - 1] + [c[-1]] for c in curves]
    return [(statistics.fmean(c[j][0] for c in aligned), statistics.fmean(c[j][1] for c in aligned)) for j in range(m)]
