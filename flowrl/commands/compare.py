"""``flowrl compare``: several configs × seeds under one budget, one folder of plots, a table and commands.

Each (config, seed) is one ``flowrl train`` run in its own process (``OUT/runs/<label>-s<seed>``, with
``train.resume=latest``), one at a time or ``parallel`` at once, each pinned to ``threads`` torch threads.
The budget is the same for every run: ``iterations`` (``train.max_steps``), ``images`` (iterations =
⌈images / leaves per iteration⌉, from the plan's closed-form counts) or ``minutes`` of training
(``train.max_minutes``; evals excluded). ``OUT/status.json`` records every finished or failed run, so a
killed comparison continues where it stopped: finished runs are kept, the others resume from their last
checkpoint. A failing run is reported (its log's last lines) and the others' results are kept. A reward's secret
given as an override (``'eval.rewards=[{…, kwargs: {api_key: …}}]'``) reaches the runs but is written and printed
as ``<redacted>`` (:func:`flowrl.config.secrets.redact_command`): a resumed comparison needs it given again, as a run
does, and a line of ``commands.sh`` run as it stands asks for it.

Written to ``OUT``: ``results.md`` (final held-out metric per seed; per config the mean, the eval's own
standard error from its image count, the spread across seeds and the standard error of the mean;
s/iteration, images, rollout forwards; each pair of configs' difference marked "within noise" or "beyond
noise"; the exact commands), ``curves.png`` (training reward against wall time, the held-out
metric against images drawn and against training wall time; every seed drawn thin and the mean thick), ``commands.sh``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flowrl.commands.common import SEED_MAX, Flag
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.config.secrets import redact_command
from flowrl.run.filenames import unique_names
from flowrl.run.outputs import check_output, unfinished_start

BUDGETS = ("iterations", "images", "minutes")


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


def parse_budget(text: str) -> tuple[str, float]:
    """``iterations=150`` | ``images=9600`` | ``minutes=10`` → (kind, value)."""
    kind, _, value = text.partition("=")
    if kind not in BUDGETS or not value:
        raise ConfigError(f"--budget={text!r} must be KIND=VALUE with KIND one of {list(BUDGETS)}, e.g. images=9600")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"--budget={text!r}: {value!r} is not a number") from None
    if number <= 0:
        raise ConfigError(f"--budget={text!r} must be > 0")
    return kind, number


def budget_overrides(cfg: TrainConfig, kind: str, value: float) -> list[str]:
    """The ``train.*`` overrides that give ``cfg`` the budget (kind, value)."""
    if kind == "iterations":
        return [f"train.max_steps={int(value)}"]
    if kind == "images":
        from flowrl.config import build

        leaves = build.build_plan(cfg.rollout).expected_counts(cfg.prompts.per_step)["leaves"]
        return [f"train.max_steps={math.ceil(value / leaves)}"]
    return [f"train.max_minutes={value:g}", "train.max_steps=1000000"]


def plan_runs(
    entries: list[tuple[str, str, list[str]]], seeds: list[int], budget: tuple[str, float], out: Path, threads: int
) -> list[Run]:
    """The runs of a comparison: ``entries`` are (label, config path, overrides); each is loaded (so a bad
    config fails here, naming it) to turn the budget into its own overrides. A label becomes one folder name of
    at most 40 characters, distinct from the others' (:func:`~flowrl.run.filenames.unique_names`): never a path."""
    loaded = []
    for label, (_, path, overrides) in zip(unique_names([e[0] for e in entries], 40, fallback="config"), entries):
        cfg = TrainConfig.from_yaml(path, overrides)
        loaded.append((label, path, overrides, cfg, budget_overrides(cfg, *budget), max(1, cfg.eval.every or 0)))
    runs = []
    for seed in seeds:  # every config's first seed first: a cut-short comparison still compares
        for label, path, overrides, cfg, extra, every in loaded:
            folder = out / "runs" / f"{label}-s{seed}"
            command = [
                sys.executable,
                "-m",
                "flowrl",
                "train",
                path,
                *overrides,
                *extra,
                f"train.seed={seed}",
                f"train.output_dir={out / 'runs'}",
                f"train.name={label}-s{seed}",
                "train.resume=latest",
                "train.progress=false",
                f"train.num_threads={threads}",
                f"train.checkpoint_every={cfg.train.checkpoint_every or every}",
            ]
            runs.append(Run(label, seed, command, folder))
    return runs


def run_all(runs: list[Run], out: Path, parallel: int = 1) -> dict[str, dict]:
    """Run what ``OUT/status.json`` does not mark finished; returns the status of every run."""
    status_path = out / "status.json"
    status = json.loads(status_path.read_text()) if status_path.is_file() else {}
    todo = [r for r in runs if status.get(r.key, {}).get("state") != "done"]

    def one(run: Run) -> tuple[str, dict]:
        run.folder.parent.mkdir(parents=True, exist_ok=True)
        log = out / "logs" / f"{run.key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(_threads(run.command))}
        command = [
            "train.overwrite=true" if c == "train.resume=latest" and unfinished_start(run.folder) else c
            for c in run.command
        ]  # stopped before its first checkpoint (a resume refuses): start it again
        with log.open("a") as f:
            rc = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, env=env)
        shown = redact_command(run.command)  # status.json keeps the command without its secrets
        if rc == 0:
            return run.key, {"state": "done", "command": shown}
        tail = log.read_text().strip().splitlines()[-5:]
        return run.key, {"state": "failed", "rc": rc, "log": str(log), "last_lines": tail, "command": shown}

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for key, result in pool.map(one, todo):
            status[key] = result
            status_path.write_text(json.dumps(status, indent=2))  # after each run: a kill keeps what finished
    return status


def _threads(command: list[str]) -> int:
    return int(next(c.split("=", 1)[1] for c in command if c.startswith("train.num_threads=")))


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


def compare(
    entries: list[tuple[str, str, list[str]]],
    seeds: list[int],
    budget: str,
    out: str | Path,
    parallel: int = 1,
    threads: int = 1,
    metric: str | None = None,
    run: bool = True,
) -> tuple[str, list[str]]:
    """Plan, run (resuming; ``run=False``: only report what is there) and report a comparison; returns the
    Markdown table and the keys (``label-sSEED``) of the runs that failed. ``out``: new, or a comparison's."""
    out = Path(out)
    runs = plan_runs(entries, seeds, parse_budget(budget), out, threads)
    check_output(out, "flowrl compare", recognise=lambda folder: (folder / "status.json").is_file()).make()
    saved = out / "status.json"
    status = run_all(runs, out, parallel) if run else json.loads(saved.read_text()) if saved.is_file() else {}
    failed = [r.key for r in runs if status.get(r.key, {}).get("state") == "failed"]
    return report(runs, status, out, metric), failed


# ---- the command ----------------------------------------------------------------------------------
FLAGS: list[Flag] = [
    ("--seeds", 0, SEED_MAX, "training seeds"),
    ("--parallel", 1, None, "runs at once"),
    ("--threads", 1, None, "torch threads per run"),
]


def add_parser(sub, epilog: str) -> None:
    """``flowrl compare`` under ``flowrl``'s sub-parsers (``epilog``: unused, it lists config keys)."""
    p = sub.add_parser(
        "compare",
        help="several configs × seeds under one budget: plots, a table, the commands",
        description="Run each CONFIG (or LABEL=CONFIG) with every seed under the same budget, each "
        "run a `flowrl train` process; resumable (OUT/status.json). key=value overrides "
        "apply to every config; --set LABEL key=value to one.",
    )
    p.add_argument("items", nargs="+", metavar="CONFIG|LABEL=CONFIG|key=value")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--budget", default="iterations=150", help="iterations=N | images=N | minutes=N (default iterations=150)"
    )
    p.add_argument(
        "--out", default="runs/compare", help="output folder: new, or an earlier comparison's (default runs/compare)"
    )
    p.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--metric", default=None, help="held-out metric key (default: the first eval/*/accuracy)")
    p.add_argument("--set", nargs=2, action="append", metavar=("LABEL", "KEY=VALUE"), help="an override of one config")
    p.add_argument(
        "--report-only", action="store_true", help="write the table and plots from the runs there, run nothing"
    )
    p.set_defaults(func=run, flags=FLAGS)


# ---- compare ----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(
            f"--seeds {' '.join(map(str, args.seeds))} names a seed twice; each seed is one run per config"
        )
    configs = [w for w in args.items if w.endswith((".yaml", ".yml"))]
    overrides = [w for w in args.items if w not in configs]
    if not configs:
        raise ConfigError("flowrl compare needs at least one CONFIG.yaml (or LABEL=CONFIG.yaml)")
    bad = [w for w in overrides if "=" not in w]
    if bad:
        raise ConfigError(f"{bad[0]!r} is neither a CONFIG.yaml nor a key=value override")
    per_label: dict[str, list[str]] = {}
    for label, item in args.set or []:
        per_label.setdefault(label, []).append(item)
    entries = []
    for spec in configs:
        label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).stem, "", spec)
        entries.append((label, path, overrides + per_label.pop(label, [])))
    if per_label:
        raise ConfigError(
            f"--set names labels {sorted(per_label)} that are not among the configs' labels {[e[0] for e in entries]}"
        )
    text, failed = compare(
        entries,
        args.seeds,
        args.budget,
        args.out,
        parallel=args.parallel,
        threads=args.threads,
        metric=args.metric,
        run=not args.report_only,
    )
    print(text)
    print(f"plots and table in {args.out} (results.md, curves.png, commands.sh)")
    if failed:  # the table is written; the exit status still says that not every run finished
        print(
            f"flowrl compare: {len(failed)} of {len(entries) * len(args.seeds)} runs failed ({', '.join(failed)}); "
            f"their logs' last lines are in {Path(args.out) / 'results.md'}",
            file=sys.stderr,
        )
        return 1
    return 0
