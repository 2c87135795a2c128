"""No silent outcome for eval (issue 47, item 4): an eval reward that fails or is not finite for every image is
reported — a warning naming the reward and the count, ``eval/<name>_failed`` in metrics.jsonl, a line in
``flowrl train``'s closing summary — and ``flowrl eval`` exits with status 3 (it used to end with status 0 and
"eval/nanr_mean: nan → nan (+nan)")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.commands.main import main
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)

PLUGIN = """
import torch
from flowrl_rewards.core.base import Reward


class NanR(Reward):
    name = "nanr"

    def score(self, images, prompts, meta):
        return torch.full((images.shape[0],), float("nan"))


class FirstNan(Reward):
    name = "firstnan"

    def score(self, images, prompts, meta):
        out = images.mean(dim=(1, 2, 3)).clone()
        out[0] = float("nan")
        return out
"""


@pytest.fixture
def plugin(tmp_path) -> Path:
    path = tmp_path / "eval_plugin.py"
    path.write_text(PLUGIN)
    return path


def test_a_train_whose_eval_reward_always_fails_says_so_in_the_log_and_the_summary(
    tiny_folder,
    tmp_path,
    plugin,  # noqa: F811
    capsys,
):
    with pytest.warns(RuntimeWarning) as warned:
        assert (
            main(
                [
                    "train",
                    *tiny_args(
                        tiny_folder, tmp_path, "run", "train.max_steps=1", f"eval.rewards=[{{name: '{plugin}:NanR'}}]"
                    ),
                ]
            )
            == 0
        )
    said = [str(w.message) for w in warned if "eval reward 'nanr'" in str(w.message)]
    assert len(said) == 2 and all("failed or was not finite (NaN or ±inf) for 4 of 4 images" in m for m in said)
    assert "at the eval of step 0" in said[0] and "at the eval of step 1" in said[1]
    out = capsys.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("warning: eval reward 'nanr'")]
    assert summary and "4 images at step 0, 4 images at step 1" in summary[0] and "eval/nanr_failed" in summary[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/nanr_failed"] for r in records if "eval/nanr_failed" in r] == [4.0, 4.0]


def test_flowrl_eval_exits_3_when_an_eval_reward_fails_for_every_image(tiny_folder, tmp_path, plugin, capsys):  # noqa: F811
    assert main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=1", "prompts.eval=null")]) == 0
    evaluate = ["eval", "--checkpoint", str(tmp_path / "run"), "prompts.eval=a red circle|a green square"]
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="'nanr'.*4 of 4 images"):
        rc = main([*evaluate, f"eval.rewards=[{{name: '{plugin}:NanR'}}]", "--out", str(tmp_path / "ev")])
    captured = capsys.readouterr()
    assert rc == 3, captured.err
    assert "eval reward 'nanr' failed or was not finite for every one of the 4 images" in captured.err
    assert "Traceback" not in captured.err
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["eval/nanr_failed"] == 4  # still written
    # some images failing: warned with the count, and the eval still ends with 0
    with pytest.warns(RuntimeWarning, match="'firstnan'.*for 1 of 4 images"):
        assert (
            main(
                [
                    *evaluate,
                    "eval.images_per_prompt=2",
                    "rollout.max_batch=4",
                    f"eval.rewards=[{{name: '{plugin}:FirstNan'}}]",
                ]
            )
            == 0
        )
