"""A guard against reward hacking (``eval.guard``): checked at load; a guard reward that falls by more than its margin
stops the run with a checkpoint and exit status 4, named in stdout, metrics.jsonl and the closing summary; a resume
refuses to train on past the stop until the margin allows it, measuring from the same start. The training reward's
held-out mean beside the eval rewards in the summary and in reward_curve.png. On the shapes model, tiny settings."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.commands.main import main
from flowrl.commands.summary import eval_summary
from flowrl.config.schema import ConfigError, GuardSection, TrainConfig
from flowrl.training.guard import EvalGuard

PLUGIN = '''
import torch
from flowrl_rewards.core.base import Reward


class Counting(Reward):
    """The training reward: brightness, counting its calls."""
    name = "counting"
    calls = 0

    def score(self, images, prompts, meta):
        type(self).calls += 1
        return images.mean(dim=(1, 2, 3))


class Level(Reward):
    """A guard reward that falls by 0.1 with every call of the training reward: it only ever goes down."""
    name = "level"

    def score(self, images, prompts, meta):
        return torch.full((images.shape[0],), 1.0 - 0.1 * Counting.calls)
'''


def tiny(plugin: Path, out: Path, *extra: str) -> list[str]:
    """``flowrl train`` of the shapes GRPO preset cut to seconds, trained on ``Counting``, evaluated (every
    iteration) with ``Level`` (label ``level``) and the strict shapes checker, guarded by ``level``."""
    return [
        "train",
        "configs/shapes/grpo.yaml",
        "prompts.per_step=2",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.mode=all",
        "eval.num_prompts=2",
        "eval.steps=2",
        "eval.images_per_prompt=1",
        "eval.grid_prompts=2",
        "train.max_steps=3",
        f"train.output_dir={out}",
        "train.name=run",
        "train.progress=false",
        "train.num_threads=1",
        "eval.every=1",
        f"rewards=[{{name: '{plugin}:Counting'}}]",
        f"eval.rewards=[{{name: '{plugin}:Level', label: level}}, {{name: shapes, kwargs: {{mode: strict}}}}]",
        "eval.guard.reward=level",
        *extra,
    ]


@pytest.fixture
def plugin(tmp_path) -> Path:
    path = tmp_path / "guard_plugin.py"
    path.write_text(PLUGIN)
    return path


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- at load ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["eval.guard.reward=levl", "eval.every=2"],
            ["eval.guard.reward='levl'", "did you mean 'level'", "'level'", "'shapes'"],
        ),
        (["eval.guard.reward=level", "eval.guard.max_drop=-0.1", "eval.every=2"], ["eval.guard.max_drop=-0.1", ">= 0"]),
        (["eval.guard.reward=level"], ["eval.guard.reward='level'", "eval.every=0", "eval.every >= 1"]),
        (["eval.guard.reward=level", "eval.every=2", "prompts.eval=null"], ["prompts.eval is null"]),
        (
            ["eval.guard.reward=brightness", "eval.every=2", "eval.rewards=null", "rewards=[{name: shapes}]"],
            ["'brightness'", "accepted: ['shapes']", "eval.rewards is null"],
        ),
    ],
)
def test_guard_settings_are_checked_at_load_naming_key_value_and_what_is_accepted(overrides, words):
    base = ["eval.rewards=[{name: brightness, label: level}, {name: shapes}]"]
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml("configs/shapes/nft.yaml", base + overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    ok = TrainConfig.from_yaml(
        "configs/shapes/nft.yaml", base + ["eval.guard.reward=level", "eval.every=5", "eval.guard.max_drop=0"]
    )
    assert ok.eval.guard == GuardSection(reward="level", max_drop=0.0, relative=False)


def test_a_bad_guard_is_exit_status_2_before_anything_is_written(tmp_path, capsys):
    assert main(["train", "eval.guard.reward=nope", "eval.every=1", f"train.output_dir={tmp_path / 'runs'}"]) == 2
    assert "eval.guard.reward='nope'" in capsys.readouterr().err and not (tmp_path / "runs").exists()


# ---- the guard itself ------------------------------------------------------------------------------------------
def test_the_guard_trips_below_its_threshold_absolute_or_relative_and_keeps_its_state():
    multi = SimpleNamespace(terms=[SimpleNamespace(name="level"), SimpleNamespace(name="shapes")])  # the Scorer port
    guard = EvalGuard.build(GuardSection(reward="plug.py:Level", max_drop=0.1), ["plug.py:Level", "shapes"], multi)
    assert guard.metric == "eval/level_mean"  # the name as written → the built term's metric
    assert guard.observe(0, {"step": 0, "eval/level_mean": 0.5}) == {
        "guard/start": 0.5,
        "guard/threshold": pytest.approx(0.4),
        "guard/tripped": 0.0,
    }
    assert guard.observe(1, {"eval/level_mean": 0.41})["guard/tripped"] == 0.0 and guard.stop is None
    out = guard.observe(2, {"eval/level_mean": 0.39})
    assert out["guard/tripped"] == 1.0 and guard.stop["now"] == 0.39 and guard.stop["step"] == 2
    assert "fell from 0.5000 at the start to 0.3900 at step 2" in out["guard/stopped"]
    assert "eval.guard.max_drop=0.1" in out["guard/stopped"]

    relative = EvalGuard(GuardSection(reward="level", max_drop=0.1, relative=True), "eval/level_mean")
    relative.observe(0, {"eval/level_mean": -2.0})
    assert relative.threshold(-2.0) == pytest.approx(-2.2)  # 10% of |start| below it
    assert relative.observe(1, {"eval/level_mean": -2.1})["guard/tripped"] == 0.0
    assert relative.observe(2, {"eval/level_mean": -2.3})["guard/tripped"] == 1.0

    again = EvalGuard(GuardSection(reward="level", max_drop=0.1), "eval/level_mean")
    again.load_state_dict(guard.state_dict())
    assert again.starts["eval/level_mean"] == 0.5 and again.resume_refusal() is not None  # the trip stands
    wider = EvalGuard(GuardSection(reward="level", max_drop=0.2), "eval/level_mean")
    wider.load_state_dict(guard.state_dict())
    assert wider.resume_refusal() is None and wider.stop is None and "within eval.guard.max_drop=0.2" in wider.note
    with pytest.raises(ConfigError, match="accepted: \\['x', 'y', 'z'\\]"):
        EvalGuard.build(GuardSection(reward="nope"), ["x", "y", "z"], multi)


# ---- end to end ------------------------------------------------------------------------------------------------
def test_a_falling_guard_reward_stops_the_run_with_status_4_and_a_resume_does_not_train_past_it(
    plugin, tmp_path, capsys
):
    runs = tmp_path / "runs"
    assert main(tiny(plugin, runs)) == 4
    out = capsys.readouterr().out
    run = runs / "run"
    evals = [r for r in records(run) if "eval/level_mean" in r]
    start, now = evals[0]["eval/level_mean"], evals[-1]["eval/level_mean"]
    assert [r["step"] for r in evals] == [0, 1] and start - now > 0.05  # stopped at the first periodic eval
    assert max(r["step"] for r in records(run)) == 1  # no iteration after the trip, no closing eval
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    trip = evals[-1]
    assert trip["guard/tripped"] == 1.0 and trip["guard/start"] == start and evals[0]["guard/tripped"] == 0.0
    for text in (trip["guard/stopped"], out):  # metrics.jsonl and stdout: the reward, both values, the margin
        assert "eval/level_mean" in text and f"{start:.4f}" in text and f"{now:.4f}" in text
        assert "eval.guard.max_drop=0.05" in text
    assert "stopped by the eval guard at step 1" in out and "exit status 4" in out  # the closing summary
    # the training reward held out, beside the eval rewards
    assert "eval/train/counting/mean" in trip and "eval/train/shapes/mean" not in trip
    assert "training  counting" in out and "eval      level" in out and "level fell" in out
    assert (run / "reward_curve.png").stat().st_size > 0

    # a resume refuses at once while the trip stands, writing nothing
    before = (run / "metrics.jsonl").read_text()
    assert main(tiny(plugin, runs, "train.resume=latest")) == 4
    out = capsys.readouterr().out
    assert "raise eval.guard.max_drop above" in out and "eval.guard.reward=null" in out
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]

    # a margin that allows the drop trains on, measuring from the same start
    assert main(tiny(plugin, runs, "train.resume=latest", "eval.guard.max_drop=100")) == 0
    assert "training on past the eval guard's stop at step 1" in capsys.readouterr().out
    later = [r for r in records(run) if "eval/level_mean" in r and r["step"] > 1]
    assert [r["step"] for r in later] == [2, 3] and all(r["guard/start"] == start for r in later)
    assert all(r["guard/tripped"] == 0.0 for r in later)


# ---- the closing summary and the reward curve ------------------------------------------------------------------
FIRST = {
    "step": 0,
    "eval/guidance": 1.0,
    "eval/train/shapes/mean": 0.40,
    "eval/shapes_mean": 0.50,
    "eval/pickscore_mean": 21.0,
}
LAST = {
    "step": 9,
    "eval/guidance": 1.0,
    "eval/train/shapes/mean": 0.60,
    "eval/shapes_mean": 0.45,
    "eval/pickscore_mean": 21.5,
}


def test_the_summary_sets_the_training_reward_beside_every_eval_reward():
    lines = eval_summary(FIRST, LAST)
    start = lines.index("training reward against the eval rewards (held-out means at guidance 1, before → after):")
    assert lines[start + 1 : start + 4] == [
        "  training  shapes     0.4000 → 0.6000  (+0.2000)",
        "  eval      pickscore  21.0000 → 21.5000  (+0.5000)",
        "  eval      shapes     0.5000 → 0.4500  (-0.0500)",
    ]
    assert "the training reward rose while shapes fell" in lines[start + 4]
    same = {k: v for k, v in LAST.items() if "/train/" not in k}  # eval.rewards null: one reward, no table
    assert not any("training reward against" in line for line in eval_summary(FIRST, same))


def test_the_reward_curve_puts_the_eval_rewards_on_their_own_panel_with_the_guard():
    from flowrl.training.metrics import reward_curve_figure

    rows = [{"step": s, "reward_mean": 0.1 * s} for s in range(1, 6)]
    evals = [
        {**FIRST, "guard/threshold": 0.45, "guard/tripped": 0.0},
        {**LAST, "step": 5, "guard/threshold": 0.45, "guard/tripped": 1.0},
    ]
    fig = reward_curve_figure(rows + evals)
    top, bottom = fig.axes
    labels = lambda ax: [line.get_label() for line in ax.get_lines()]  # noqa: E731
    assert "train reward" in labels(top) and "eval/train/shapes/mean" in labels(top)
    assert {"eval/shapes_mean", "eval/pickscore_mean", "eval guard threshold", "stopped by the eval guard"} <= set(
        labels(bottom)
    )
    assert not any(label.startswith("eval/") and "/train/" not in label for label in labels(top))
    single = reward_curve_figure(rows + [{k: v for k, v in r.items() if "/train/" not in k} for r in evals])
    assert len(single.axes) == 1 and "eval/shapes_mean" in labels(single.axes[0])
