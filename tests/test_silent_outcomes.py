"""No silent outcome: file names made from prompts stay inside --out and are written as they are drawn; a
run whose every reward fails stops (exit 3) naming the reward; a hung reward times out into reward_failed;
a prompt set smaller than one iteration's draw warns; numeric flags are range-checked by name."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from test_faults import tiny_args, tiny_folder  # noqa: F401 — the module-scoped tiny SD3 folder fixture

from flowrl.commands.main import main

PLUGIN = """
import time

import torch
from flowrl_rewards.core.base import Reward


class NanReward(Reward):
    name = "nan_reward"

    def score(self, images, prompts, meta):
        return torch.full((images.shape[0],), float("nan"))


class Hang(Reward):
    name = "hang"
    calls = 0

    def score(self, images, prompts, meta):
        type(self).calls += 1
        if type(self).calls == 1 or self.always:
            time.sleep(30)  # a reward server that accepted the request and never answers
        return images.mean(dim=(1, 2, 3))

    def __init__(self, always: bool = True):
        self.always = always
"""


@pytest.fixture
def plugin(tmp_path) -> Path:
    path = tmp_path / "silent_plugin.py"
    path.write_text(PLUGIN)
    return path


def _iterations(run: Path) -> list[dict]:
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward_mean" in r]


# ---- file names made from prompts ---------------------------------------------------------------------------
SAMPLE = ["--config", "configs/shapes/grpo.yaml", "--num", "1", "--steps", "2"]


def test_prompts_with_separators_are_sampled_into_out(tiny_folder, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "deep" / "out"
    rc = main(
        [
            "sample",
            *SAMPLE,
            "--prompt",
            "a red/blue circle",
            "--prompt",
            "../escaped",
            "--prompt",
            "/etc/x",
            "--out",
            str(out),
            f"model.path={tiny_folder}",
            "model.family=sd3",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    written = sorted(p.name for p in out.iterdir())
    assert written == ["000-a_red_blue_circle.png", "001-escaped.png", "002-etc_x.png", "grid.png"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in out.iterdir())
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["out"]  # nothing beside --out

    # a second sample into the same folder never overwrites what is there: its names get a counter
    rc = main(
        [
            "sample",
            *SAMPLE,
            "--prompt",
            "../escaped",
            "--out",
            str(out),
            f"model.path={tiny_folder}",
            "model.family=sd3",
        ]
    )
    assert rc == 0 and (out / "000-escaped.png").is_file() and (out / "grid-2.png").is_file()


def test_sample_writes_each_batch_as_it_is_drawn(tiny_folder, tmp_path, capsys, monkeypatch):  # noqa: F811
    import flowrl.rollout.sampling as sampling

    real = sampling.ode_batches

    def second_batch_fails(*args, **kwargs):
        for n, batch in enumerate(real(*args, **kwargs)):
            if n == 1:
                raise RuntimeError("out of memory (simulated)")
            yield batch

    monkeypatch.setattr(sampling, "ode_batches", second_batch_fails)
    out = tmp_path / "out"
    rc = main(
        [
            "sample",
            *SAMPLE,
            "--prompt",
            "a red circle",
            "--prompt",
            "a blue square",
            "--out",
            str(out),
            f"model.path={tiny_folder}",
            "model.family=sd3",
            "rollout.max_batch=1",
        ]
    )
    assert rc == 1 and "out of memory" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["000-a_red_circle.png"]  # the first image survives


# ---- every reward failed: stop, named --------------------------------------------------------------------------
def test_a_run_whose_every_reward_fails_stops_with_status_3_naming_the_reward(tiny_folder, tmp_path, plugin, capsys):  # noqa: F811
    runs = tmp_path / "runs"
    rc = main(
        [
            "train",
            *tiny_args(tiny_folder, runs),
            f"rewards=[{{name: '{plugin}:NanReward'}}]",
            "train.max_steps=6",
            "eval.at_start=false",
            "prompts.eval=null",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "'nan_reward'" in err and "non-finite" in err and "3 iterations in a row" in err and "Traceback" not in err
    records = _iterations(runs / "run")
    assert [r["step"] for r in records] == [1, 2, 3]  # stopped at the third, not trained on to step 6
    assert all(r["reward_failed"] == r["leaves"] == 8 for r in records)

    capsys.readouterr()
    assert main(["train", *tiny_args(tiny_folder, tmp_path / "other"), "train.max_failed_iterations=0"]) == 2
    assert "train.max_failed_iterations=0" in capsys.readouterr().err


# ---- a hung reward times out into reward_failed -----------------------------------------------------------
def test_a_hanging_reward_times_out_into_reward_failed(tiny_folder, tmp_path, plugin, capsys):  # noqa: F811
    runs = tmp_path / "runs"
    with pytest.warns(RuntimeWarning, match=r"'hang'.*timeout of 0\.3 s.*NaN"):
        rc = main(
            [
                "train",
                *tiny_args(tiny_folder, runs),
                f"rewards=[{{name: '{plugin}:Hang', timeout: 0.3}}]",
                "train.max_steps=1",
                "eval.at_start=false",
                "prompts.eval=null",
            ]
        )
    assert rc == 0, capsys.readouterr().err
    (record,) = _iterations(runs / "run")
    assert record["reward_failed"] == record["leaves"] == 8


def test_a_timed_out_call_is_abandoned_and_the_next_gets_a_fresh_worker(plugin):
    from flowrl_rewards import MultiReward

    reward = MultiReward([{"name": f"{plugin}:Hang", "timeout": 0.2, "kwargs": {"always": False}}])
    images, prompts = torch.rand(3, 3, 8, 8), ["a", "b", "c"]
    with pytest.warns(RuntimeWarning, match="'hang'"):
        first = reward.components(images, prompts)["hang"]
    assert torch.isnan(first).all() and "timeout of 0.2 s" in reward.failures["hang"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = reward.components(images, prompts)["hang"]  # the first call's thread still sleeps
    assert torch.allclose(second, images.mean(dim=(1, 2, 3))) and reward.failures == {}
    with pytest.raises(ValueError, match="timeout"):
        MultiReward([{"name": "brightness", "timeout": 0}])


# ---- fewer prompts than one iteration draws -------------------------------------------------------------------
def test_a_prompt_set_smaller_than_one_draw_warns_once_with_both_numbers():
    from flowrl.config.schema import PromptsSection
    from flowrl.prompts.source import build_prompt_source

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = build_prompt_source(PromptsSection(train="a red circle|a blue square", per_step=5), seed=0)
        source.batch(0), source.batch(1)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "holds 2 prompts" in messages[0] and "prompts.per_step=5" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_prompt_source(PromptsSection(train="a red circle|a blue square", per_step=2), seed=0)


# ---- numeric flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, words",
    [
        (["sample", "--prompt", "x", "--num", "0"], ["--num=0", ">= 1"]),
        (["sample", "--prompt", "x", "--steps", "0"], ["--steps=0", ">= 1"]),
        (["sample", "--prompt", "x", "--guidance", "-1"], ["--guidance=-1.0", ">= 0"]),
        (["sample", "--prompt", "x", "--guidance", "nan"], ["--guidance=nan"]),
        (["sample", "--prompt", "x", "--scale", "0"], ["--scale=0", "[1, 64]"]),
        (["sample", "--prompt", "x", "--seed", "-3"], ["--seed=-3"]),
        (["bench", "--iterations", "0"], ["--iterations=0", ">= 1"]),
        (["bench", "--warmup", "-1"], ["--warmup=-1", ">= 0"]),
        (["bench", "--estimate", "--processes", "0"], ["--processes=0"]),
        (["snr", "--batches", "2"], ["--batches=2", ">= 3"]),
        (["compare", "a.yaml", "--parallel", "0"], ["--parallel=0"]),
        (["compare", "a.yaml", "--threads", "0"], ["--threads=0"]),
        (["compare", "a.yaml", "--seeds", "0", "-1"], ["--seeds=-1"]),
        (["compare", "a.yaml", "--seeds", "1", "1"], ["--seeds 1 1", "twice"]),
    ],
)
def test_numeric_flags_are_range_checked_by_name(argv, words, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path / "out")] if argv[0] in ("sample", "compare") else [])]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)
    assert "Traceback" not in err and not (tmp_path / "out").exists()
