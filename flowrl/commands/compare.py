"""``flowrl compare``: several configs × seeds under one budget, one folder of plots, a table and commands.

Each (config, seed) is one ``flowrl train`` run in its own process (``OUT/runs/<label>-s<seed>``, with
``train.resume=latest``), one at a time or ``parallel`` at once, each pinned to ``threads`` torch threads (an
asynchronous run, ``train.pipeline: async``, splits them between its trainer and its rollout process, at least one
each: with ``threads`` 1 it runs two).
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

The results (reading the runs back, the noise and the report) are :mod:`flowrl.commands.compare_results`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flowrl.commands.common import SEED_MAX, Flag
from flowrl.commands.compare_results import (  # noqa: F401 (re-exported: importers read the results from here)
    Run,
    count_key,
    mean_curve,
    noise,
    read_run,
    report,
    verdict,
)
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.config.secrets import redact_command
from flowrl.run.filenames import unique_names
from flowrl.run.outputs import check_output, unfinished_start

BUDGETS = ("iterations", "images", "minutes")


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
