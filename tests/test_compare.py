"""``flowrl compare``: budgets, seeds, resume, the table and plots, a failing config reported alone."""

from __future__ import annotations

import json

import pytest

from flowrl.commands.compare import budget_overrides, parse_budget, read_run
from flowrl.config.schema import ConfigError, TrainConfig


def test_budgets_turn_into_the_same_work_for_every_config():
    chains = TrainConfig.from_yaml("configs/shapes/grpo.yaml")  # 8 prompts × 8 chains = 64 images per iteration
    tree = TrainConfig.from_yaml("configs/shapes/branchgrpo.yaml")
    assert budget_overrides(chains, *parse_budget("images=9600")) == ["train.max_steps=150"]
    leaves = 4 * 16  # branchgrpo: 4 prompts × 16 leaves
    assert budget_overrides(tree, *parse_budget("images=9600")) == [f"train.max_steps={-(-9600 // leaves)}"]
    assert budget_overrides(chains, *parse_budget("iterations=7")) == ["train.max_steps=7"]
    assert budget_overrides(chains, *parse_budget("minutes=2.5"))[0] == "train.max_minutes=2.5"
    for bad in ("hours=2", "images=", "images=-3", "images=many"):
        with pytest.raises(ConfigError, match="--budget"):
            parse_budget(bad)


def test_read_run_tolerates_a_torn_last_line(tmp_path):
    lines = [
        {"step": 0, "eval/x/accuracy": 0.5},
        {"step": 1, "reward_mean": 0.2, "leaves": 4, "rollout_forwards": 12, "time/rollout": 1.0, "time/update": 0.5},
        {"step": 1, "eval/x/accuracy": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 2, "rew')
    run = read_run(tmp_path)
    assert run["metric"] == "eval/x/accuracy" and run["evals"] == [(0.0, 0.5), (4, 0.75)]
    assert run["final"] == 0.75 and run["seconds_per_iteration"] == 1.5 and run["images"] == 4


def test_read_run_places_evals_on_the_trainers_clock(tmp_path):
    """Evals are placed at the images drawn and the training time (``time/train_total``, evals excluded) of
    the step they follow; the parts' sum stands in for runs logged before that key."""
    lines = [
        {"step": 0, "eval/x/accuracy": 0.5},
        {"step": 1, "reward_mean": 0.2, "leaves": 4, "time/rollout": 1.0, "time/update": 0.5, "time/train_total": 2.0},
        {"step": 2, "reward_mean": 0.3, "leaves": 4, "time/rollout": 1.0, "time/update": 0.5, "time/train_total": 4.5},
        {"step": 2, "eval/x/accuracy": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = read_run(tmp_path)
    assert run["evals_by_time"] == [(0.0, 0.5), (4.5, 0.75)] and run["evals"] == [(0.0, 0.5), (8, 0.75)]
    assert run["train"] == [(2.0, 0.2), (4.5, 0.3)] and run["minutes"] == 4.5 / 60
    assert run["seconds_per_iteration"] == 2.25


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("pipe") / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


@pytest.mark.slow  # seven `flowrl train` processes, two at a time (30–80 s): `pytest -m slow`, run by .ci/run; in the
# default set a compare run is started and its failure recorded (tests/test_outputs_owned.py), the table, status and
# exit status come from run folders (tests/test_compare_noise.py), a run resumes from its checkpoint (test_trainer.py)
def test_compare_runs_reports_and_resumes(tmp_path, pipeline_folder, capsys):
    from flowrl.commands.main import main

    common = [
        f"model.path={pipeline_folder}",
        "model.family=sd3",
        "model.lora.rank=2",
        "rollout.steps=2",
        "rollout.group_size=2",
        "rollout.window.mode=all",
        "prompts.train=a red circle|a blue square",
        "prompts.per_step=2",
        "prompts.eval=a red circle|a dog",
        "eval.steps=2",
        "eval.rewards=null",
        "rewards=[{name: brightness}]",
    ]
    good = tmp_path / "good.yaml"
    good.write_text("loss: {kl_ref: 0}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss: {kl_ref: 0}\n")
    out = tmp_path / "cmp"
    args = [
        "compare",
        str(good),
        f"broken={bad}",
        *common,
        "--set",
        "broken",
        f"prompts.train={tmp_path / 'no_such_prompts.txt'}",  # accepted at load, fails in the run
        "--seeds",
        "0",
        "1",
        "--budget",
        "images=8",
        "--out",
        str(out),
        "--parallel",
        "2",
    ]
    assert main(args) == 1  # the broken config's runs failed: reported, and the exit status says so
    status = json.loads((out / "status.json").read_text())
    assert {k: v["state"] for k, v in status.items()} == {
        "good-s0": "done",
        "good-s1": "done",
        "broken-s0": "failed",
        "broken-s1": "failed",
    }
    assert "no_such_prompts.txt" in " ".join(status["broken-s0"]["last_lines"])
    assert "train.max_steps=2" in status["good-s0"]["command"]  # what was run, for a later report
    table = (out / "results.md").read_text()
    assert "| good | s0: " in table and "| broken | s0: failed, s1: failed |" in table and "Failed runs:" in table
    assert (out / "curves.png").stat().st_size > 0 and len((out / "commands.sh").read_text().splitlines()) == 4
    for seed in (0, 1):  # images=8 with 4 images per iteration: 2 iterations each
        run = read_run(out / "runs" / f"good-s{seed}")
        assert run["iterations"] == 2 and run["images"] == 8 and len(run["evals"]) == 2
    first = read_run(out / "runs" / "good-s0")

    # a killed comparison continues: finished runs are not run again
    before = (out / "runs" / "good-s0" / "metrics.jsonl").read_text()
    status.pop("good-s1")
    (out / "status.json").write_text(json.dumps(status))
    assert main(args) == 1
    assert (out / "runs" / "good-s0" / "metrics.jsonl").read_text() == before
    assert json.loads((out / "status.json").read_text())["good-s1"]["state"] == "done"
    assert read_run(out / "runs" / "good-s1")["iterations"] == 2  # resumed from its checkpoint, not run twice
    (out / "results.md").unlink()
    assert main(args + ["--report-only"]) == 1  # the table from what is there, nothing run
    assert "| good | s0: " in (out / "results.md").read_text()
    assert (out / "runs" / "good-s0" / "metrics.jsonl").read_text() == before
    assert 0.0 <= first["final"] <= 1.0  # brightness of the final eval


def test_mean_curve_of_seeds_with_different_eval_counts_keeps_the_finals():
    from flowrl.commands.compare import mean_curve

    same = mean_curve([[(0, 0.0), (1, 0.2)], [(0, 0.2), (1, 0.4)]])
    assert same == [pytest.approx((0, 0.1)), pytest.approx((1, 0.3))]
    # a wall-time schedule: the second seed got one more eval before its final one
    ragged = mean_curve([[(0, 0.0), (60, 0.1), (300, 0.3)], [(0, 0.0), (60, 0.1), (290, 0.2), (300, 0.5)]])
    assert len(ragged) == 3 and ragged[-1] == pytest.approx((300, 0.4)) and ragged[1] == pytest.approx((60, 0.1))


def test_compare_refuses_a_config_with_an_unregistered_reward_before_any_run(tmp_path, capsys):
    from flowrl.commands.main import main

    out = tmp_path / "cmp"
    args = ["compare", "configs/shapes/nft.yaml", "--set", "nft", "rewards=[{name: no_such_reward}]"]
    assert main([*args, "--seeds", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rewards[0].name='no_such_reward' is not registered" in err and "accepted:" in err
    assert not (out / "runs").exists()  # nothing started
