"""``flowrl compare`` reports the noise beside every mean (the eval's own standard error from its image count,
the spread across seeds) and marks differences inside it; a comparison with a failed run exits non-zero after
writing its table. Runs here are hand-made folders of metrics: nothing is trained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flowrl.commands.main import main

N = 480  # held-out images per eval


def make_runs(
    out: Path,
    finals: dict[str, list[float]],
    metric: str = "eval/shapes/accuracy",
    status: dict[str, str] | None = None,
) -> list[str]:
    """Config files and run folders under ``out`` whose final ``metric`` per seed is ``finals[label]``; returns
    the ``flowrl compare`` arguments that report them."""
    configs = []
    for label, values in finals.items():
        config = out.parent / f"{label}.yaml"
        config.write_text("loss: {kl_ref: 0}\n")
        configs.append(str(config))
        for seed, final in enumerate(values):
            run = out / "runs" / f"{label}-s{seed}"
            run.mkdir(parents=True)
            count = {metric.replace("accuracy", "n"): N} if "accuracy" in metric else {}
            lines = [
                {"step": 0, metric: 0.3, **count},
                {"step": 1, "reward_mean": 0.2, "leaves": 64, "time/train_total": 2.0},
                {"step": 2, "reward_mean": 0.3, "leaves": 64, "time/train_total": 4.0},
                {"step": 2, metric: final, **count},
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    states = {f"{label}-s{seed}": {"state": "done"} for label, values in finals.items() for seed in range(len(values))}
    for key, state in (status or {}).items():
        states[key] = (
            {"state": state, "rc": 1, "log": "x.log", "last_lines": ["boom"]} if state == "failed" else {"state": state}
        )
    (out / "status.json").write_text(json.dumps(states))
    seeds = [str(s) for s in range(max(len(v) for v in finals.values()))]
    return ["compare", *configs, "--seeds", *seeds, "--budget", "iterations=2", "--out", str(out), "--report-only"]


def eval_se(p: float) -> float:
    return math.sqrt(p * (1 - p) / N)


def test_the_noise_of_a_config_is_its_eval_error_and_its_seed_spread():
    from flowrl.commands.compare import noise, verdict

    finals = [0.40, 0.41, 0.42]
    st = noise(finals, [N] * 3, binary=True)
    assert st["mean"] == pytest.approx(0.41) and st["sd"] == pytest.approx(0.01)
    assert (st["lo"], st["hi"], st["k"], st["n"]) == (0.40, 0.42, 3, N)
    assert st["eval_se"] == pytest.approx(math.sqrt(sum(eval_se(p) ** 2 for p in finals) / 3))
    assert st["se"] == pytest.approx(math.sqrt(sum(eval_se(p) ** 2 for p in finals) / 9 + 0.01**2 / 3))
    one = noise([0.5], [N], binary=True)  # one seed: the eval's own error alone
    assert one["se"] == pytest.approx(eval_se(0.5)) and math.isnan(one["sd"])
    dense = noise([0.2, 0.3], [None, None], binary=False)  # not a pass rate: the seed spread alone
    assert math.isnan(dense["eval_se"]) and dense["se"] == pytest.approx(statistics_sd([0.2, 0.3]) / math.sqrt(2))
    close = noise([0.42, 0.43, 0.41], [N] * 3, binary=True)
    delta, band, word = verdict(st, close)
    assert delta == pytest.approx(0.01) and band == pytest.approx(2 * math.hypot(st["se"], close["se"]))
    assert word == "within noise"
    assert verdict(st, noise([0.60, 0.61, 0.62], [N] * 3, binary=True))[2] == "beyond noise"
    assert verdict(noise([0.2], [None], False), noise([0.3], [None], False))[2] == "noise unknown"


def statistics_sd(values: list[float]) -> float:
    import statistics

    return statistics.stdev(values)


def test_results_mark_differences_inside_the_noise(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = make_runs(out, {"a": [0.40, 0.41, 0.42], "b": [0.42, 0.43, 0.41], "c": [0.60, 0.61, 0.62]})
    assert main(args) == 0
    table = (out / "results.md").read_text()
    assert "eval s.e. per run (images)" in table and "seed std (min–max)" in table
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    assert "| 0.410 | ±0.022 (480) | 0.010 (0.400–0.420) | ±0.014 |" in row_a, row_a
    assert "| b − a | +0.010 |" in table and "| within noise |" in table.split("| b − a |")[1].splitlines()[0]
    assert "| c − a | +0.200 |" in table and "beyond noise" in table.split("| c − a |")[1].splitlines()[0]
    assert "beyond noise" in table.split("| c − b |")[1].splitlines()[0]


def test_a_metric_that_is_not_a_pass_rate_uses_the_seed_spread(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = make_runs(out, {"a": [0.50, 0.52], "b": [0.51, 0.53]}, metric="eval/brightness_mean")
    assert main(args) == 0
    table = (out / "results.md").read_text()
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    assert "| n/a | 0.014 (0.500–0.520) | ±0.010 |" in row_a, row_a
    assert "within noise" in table.split("| b − a |")[1].splitlines()[0]


def test_compare_exits_non_zero_after_writing_its_table_when_a_run_failed(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = make_runs(out, {"a": [0.40, 0.41], "b": [0.42, 0.43]}, status={"b-s1": "failed"})
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "1 of 4 runs failed (b-s1)" in captured.err and "| b | s0: 0.300 → 0.420, s1: failed |" in captured.out
    table = (out / "results.md").read_text()
    assert "Failed runs:" in table and "b-s1" in table
    assert "one seed" in next(line for line in table.splitlines() if line.startswith("| b |"))


def test_the_report_lists_each_run_as_it_was_run_not_as_this_call_would_run_it(tmp_path, capsys):
    """Two `flowrl compare` calls into one folder with different budgets, then one report over both."""
    out = tmp_path / "cmp"
    args = make_runs(out, {"a": [0.40], "b": [0.42]})
    status = json.loads((out / "status.json").read_text())
    ran = ["python", "-m", "flowrl", "train", "b.yaml", "train.max_minutes=5.2", "train.seed=0"]
    status["b-s0"]["command"] = ran
    (out / "status.json").write_text(json.dumps(status))
    assert main(args) == 0
    commands = (out / "commands.sh").read_text().splitlines()
    assert commands[1] == " ".join(ran)  # b's own budget, not this report's iterations=2
    assert "train.max_steps=2" in commands[0]  # a run without a recorded command: as this call plans it
    assert " ".join(ran) in (out / "results.md").read_text()
