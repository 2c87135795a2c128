"""The fault campaign of issue 24, kept: bad configs (a table), taken run names, failed starts, resumes with
changed settings, torn metrics, stale temporary folders, a full disk, misbehaving reward plugins and
servers, and kill -9 at random points. Every user-facing failure is one message (no traceback) naming the
key, file or value, and nothing a failure did not mean to write is left under the output folder."""

from __future__ import annotations

import errno
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.commands.main import main
from tests.conftest import without_wall_clock

# ---- the bad-config table -----------------------------------------------------------------------------
# (overrides of the default job, or a YAML text as {"yaml": ...}; words the message must hold). Each fails
# with status 2, one message, nothing written under train.output_dir.
BAD_CONFIGS = [
    # issue 54, round four: each names what is wrong with it
    (["eval.guard.max_drop=inf"], ["eval.guard.max_drop=inf", "finite number"]),
    (["eval.rewards=[{name: shapes},{name: shapes}]"], ["eval.rewards (", "unique", "label"]),
    (
        ["configs/sd35/grpo_guard_pickscore.yaml", "rollout.plan=ode"],
        ["rollout.kernel is not a key of rollout.plan=ode (chosen", "grpo_guard_pickscore.yaml", "reads it"],
    ),
    (["optim.grad_clip=-1"], ["optim.grad_clip=-1", "> 0"]),
    (["optim.grad_clip=0"], ["optim.grad_clip=0", "> 0"]),
    (["optim.lr=0"], ["optim.lr=0", "> 0"]),
    (["optim.lr=-1e-4"], ["optim.lr", "> 0"]),
    (["optim.lr=abc"], ["optim.lr", "abc"]),
    (["optim.lr=nan"], ["optim.lr=nan"]),
    (["optim.betas=[0.9]"], ["optim.betas", "two numbers"]),
    (["optim.betas=[0.9,1.5]"], ["optim.betas[1]=1.5", "[0, 1)"]),
    (["optim.weight_decay=-1"], ["optim.weight_decay", ">= 0"]),
    (["optim.eps=0"], ["optim.eps", "> 0"]),
    (["optim.warmup_steps=-1"], ["optim.warmup_steps=-1", ">= 0"]),
    (["optim.schedule=cosinus"], ["optim.schedule='cosinus'", "cosine"]),
    (["train.checkpoint_every=-1"], ["train.checkpoint_every=-1", ">= 0"]),
    (["train.keep_last=-1"], ["train.keep_last=-1", ">= 0"]),
    (["train.num_threads=0"], ["train.num_threads=0", "> 0"]),
    (["train.max_minutes=-2"], ["train.max_minutes", ">= 0"]),
    (["train.max_steps=-5"], ["train.max_steps=-5", ">= 0"]),
    (["train.inner_epochs=0"], ["train.inner_epochs=0", "> 0"]),
    (["train.updates_per_epoch=0"], ["train.updates_per_epoch=0", "> 0"]),
    (["train.ema=1"], ["train.ema", "[0, 1)"]),
    (["train.log_with=mlflow"], ["train.log_with='mlflow'", "tensorboard"]),
    (["train.async_reward=maybe"], ["train.async_reward='maybe'"]),
    (["train.name=../../x"], ["train.name='../../x'", "inside train.output_dir"]),
    (["train.name=/tmp/x"], ["train.name='/tmp/x'", "inside train.output_dir"]),
    (["train.overwrite=true", "train.resume=latest"], ["train.overwrite", "train.resume"]),
    (["train.max_step=5"], ["train.max_step", "did you mean 'train.max_steps'"]),
    (["eval.every=-1"], ["eval.every=-1", ">= 0"]),
    (["eval.batch_size=4"], ["eval.batch_size", "is gone; use rollout.max_batch"]),
    (["eval.images_per_prompt=0"], ["eval.images_per_prompt=0", "> 0"]),
    (["eval.steps=0"], ["eval.steps=0", "> 0"]),
    (["eval.num_prompts=0"], ["eval.num_prompts=0", "> 0"]),
    (["eval.grid_prompts=-1"], ["eval.grid_prompts=-1", ">= 0"]),
    (["model.family=sd4"], ["model.family='sd4'", "did you mean 'sd3'"]),
    (["model.dtype=fp8"], ["model.dtype='fp8'", "bfloat16"]),
    (["model.device=tpu"], ["model.device='tpu'", "cuda:N"]),
    (["model.guidance=-1"], ["model.guidance=-1", ">= 0"]),
    (["model.true_cfg=2"], ["model.true_cfg", "FLUX"]),
    (["model.lora.rank=0"], ["model.lora.rank=0", "> 0"]),
    (["model.lora.alpha=0"], ["model.lora.alpha=0", "> 0"]),
    (["model.lora.dropout=1.5"], ["model.lora.dropout=1.5", "[0, 1)"]),
    (["model.height=0"], ["model.height=0", "> 0"]),
    (["model.height=30"], ["model.height=30", "multiples"]),
    (["model.path=/nonexistent/shapes"], ["model.path='/nonexistent/shapes'"]),
    (["model.full_finetune=false", "model.lora.targets=[nothere]"], ["model.lora.targets", "nothere"]),
    (["rollout.plan=xx"], ["rollout.plan='xx'", "accepted"]),
    (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
    (["rollout.steps=1"], ["rollout.steps=1", ">= 2"]),
    (["rollout.max_batch=0"], ["rollout.max_batch=0", "> 0"]),
    (["rollout.chunks=0"], ["rollout.chunks=0", "> 0"]),
    (["rollout.solver=rk9"], ["rollout.solver='rk9'", "euler"]),
    (["loss.objective=nope"], ["loss.objective='nope'", "nft"]),
    (["loss.beta=0"], ["loss.beta=0"]),
    (["loss.old_decay=1.5"], ["loss.old_decay=1.5"]),
    (["loss.cfg=maybe"], ["loss.cfg='maybe'", "free"]),
    (["loss.draws=0"], ["loss.draws=0", ">= 1"]),
    (["loss.timesteps=gauss"], ["loss.timesteps='gauss'", "logit_normal"]),
    ({"yaml": "rollout: {plan: ode}\nloss: {objective: clipped}\n"}, ["rollout.plan", "ode"]),
    (["credit.rule=nope"], ["credit.rule='nope'", "group"]),
    (["credit.scale=nope"], ["credit.scale='nope'"]),
    (["rewards=[]"], ["rewards", "at least one"]),
    (["rewards=[{name: nope}]"], ["nope", "registered"]),
    (["rewards=[{name: shapes, weight: nan}]"], ["rewards[0].weight=nan"]),
    (["rewards=[{name: shapes, kwargs: {mode: zzz}}]"], ["rewards", "zzz", "strict"]),
    (["reward_normalize=zz"], ["reward_normalize='zz'", "group"]),
    (["prompts.per_step=0"], ["prompts.per_step=0", "> 0"]),
    (["prompts.sampling=random"], ["prompts.sampling='random'", "adaptive"]),
    (["prompts.sampling=adaptive", "prompts.adaptive_floor=-1"], ["prompts.adaptive_floor"]),
    (["prompts.train=nope"], ["prompts.train='nope'", "no such prompt file"]),
    (["prompts.train=missing/prompts.txt"], ["prompts.train='missing/prompts.txt'", "no such prompt file"]),
    (["prompts.eval=missing.txt"], ["prompts.eval='missing.txt'"]),
    (["prompts.train=a red circle|a purple dragon"], ["prompts.train=", "prompt 2", "'a purple dragon'"]),
    (["prompts.train={tmp}/bad_line.txt"], ["prompts.train=", "line 4", "'one green sausage'"]),
    (["prompts.train=" + "a red circle " * 20000], ["prompts.train=", "characters)"]),
    ({"yaml": "model: {family: shapes\n  bad: [\n"}, ["line 2", "not valid YAML"]),
    ({"yaml": "- a\n- b\n"}, ["a config is a mapping", "list"]),
    ({"yaml": "5\n"}, ["not a config"]),
    ({"yaml": "rollout: 5\n"}, ["config key 'rollout'", "section"]),
    ({"yaml": "rewards: shapes\n"}, ["config key 'rewards'", "list of rewards"]),
    ({"yaml": "optim: {lr: [1, 2]}\n"}, ["optim.lr"]),
]


def _case_id(case) -> str:
    spec = case[0]
    text = spec["yaml"].splitlines()[0] if isinstance(spec, dict) else " ".join(spec)
    return text[:40]


def test_the_table_holds_at_least_sixty_cases():
    assert len(BAD_CONFIGS) >= 60


@pytest.mark.parametrize("spec, words", BAD_CONFIGS, ids=[_case_id(c) for c in BAD_CONFIGS])
def test_a_bad_config_is_one_message_naming_the_key_and_writes_nothing(tmp_path, capsys, spec, words):
    (tmp_path / "bad_line.txt").write_text("a red circle\n# a comment\n\none green sausage\n")
    out = tmp_path / "runs"
    if isinstance(spec, dict):
        (tmp_path / "bad.yaml").write_text(spec["yaml"])
        argv = ["train", str(tmp_path / "bad.yaml")]
    else:
        argv = ["train", *[s.replace("{tmp}", str(tmp_path)) for s in spec]]
    rc = main(argv + [f"train.output_dir={out}", "train.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    assert len(err) < 2000
    assert not out.exists(), sorted(out.rglob("*"))


# ---- runs on a tiny SD3 pipeline in a local folder --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("tiny") / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


def tiny_args(folder: Path, out: Path, name: str = "run", *extra: str) -> list[str]:
    return [
        "configs/shapes/grpo.yaml",
        f"model.path={folder}",
        "model.family=sd3",
        "prompts.train=a red circle|a blue square",
        "prompts.eval=a red circle|a green square",
        "prompts.per_step=2",
        "rollout.group_size=4",
        "rollout.steps=3",
        "rollout.window.mode=all",
        "rewards=[{name: brightness}]",
        "eval.rewards=null",
        "eval.steps=2",
        "model.lora.rank=2",
        "train.checkpoint_every=1",
        "train.async_reward=false",
        f"train.output_dir={out}",
        f"train.name={name}",
        "train.progress=false",
        "train.num_threads=1",
        *extra,
    ]


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_taken_run_name_is_refused_and_the_run_left_intact(tiny_folder, tmp_path, capsys):
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=2"]) == 0
    before = snapshot(tmp_path / "run")
    capsys.readouterr()
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1", "optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "train.name='run'" in err and "train.resume=latest" in err and "train.overwrite=true" in err
    assert snapshot(tmp_path / "run") == before

    # replacing it is explicit, and leaves none of the old run's checkpoints for a later resume to pick up
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1", "train.overwrite=true"]) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 1]  # eval before, iteration 1, eval after: the old run's records are gone


def test_resume_names_changed_settings_and_refuses_a_shape_change(tiny_folder, tmp_path, capsys):
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1"]) == 0
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match=r"optim\.lr: 0\.001 → 0\.002.*rollout\.group_size: 4 → 2"):
        assert (
            main(
                [
                    "train",
                    *tiny_args(tiny_folder, tmp_path),
                    "train.max_steps=2",
                    "train.resume=latest",
                    "optim.lr=2e-3",
                    "rollout.group_size=2",
                ]
            )
            == 0
        )
    before = snapshot(tmp_path / "run")
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                *tiny_args(tiny_folder, tmp_path),
                "train.max_steps=3",
                "train.resume=latest",
                "model.lora.rank=4",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "model.lora.rank" in err and "2 → 4" in err and "Traceback" not in err
    assert snapshot(tmp_path / "run") == before


REWARD_PLUGIN = """
import torch
from flowrl_rewards.core.base import Reward


class Short(Reward):
    name = "short"

    def score(self, images, prompts, meta):
        return torch.zeros(3)


class Raises(Reward):
    name = "raises"

    def score(self, images, prompts, meta):
        raise KeyError("no_such_column")
"""


@pytest.mark.parametrize(
    "cls, words",
    [("Short", ["'short'", "3 scores for 8 images"]), ("Raises", ["'raises'", "KeyError", "no_such_column"])],
)
def test_a_misbehaving_reward_is_one_message_and_a_failed_start_writes_nothing(
    tiny_folder, tmp_path, capsys, cls, words
):
    plugin = tmp_path / "plugin_reward.py"
    plugin.write_text(REWARD_PLUGIN)
    rc = main(
        [
            "train",
            *tiny_args(tiny_folder, tmp_path / "runs"),
            f"rewards=[{{name: '{plugin}:{cls}'}}]",
            "train.max_steps=2",
            "eval.at_start=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "runs" / "run").exists()


def test_a_plugin_that_raises_on_import_names_its_file_and_line(tiny_folder, tmp_path, capsys):
    plugin = tmp_path / "broken_reward.py"
    plugin.write_text("import torch\n\nSCALE = 1 / 0\n")
    rc = main(["train", *tiny_args(tiny_folder, tmp_path / "runs"), f"rewards=[{{name: '{plugin}:Broken'}}]"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert str(plugin) in err and "line 3" in err and "ZeroDivisionError" in err
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_reward_server_fails_before_any_model_time(tiny_folder, tmp_path, capsys):
    url = "http://127.0.0.1:9/score"  # the discard port: nothing listens
    rc = main(
        [
            "train",
            *tiny_args(tiny_folder, tmp_path / "runs"),
            f"rewards=[{{name: remote, kwargs: {{url: '{url}', timeout: 2, retries: 0}}}}]",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "health check" in err and "127.0.0.1:9" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_torn_metrics_line_and_stale_temporary_folders_do_not_stop_a_resume(tiny_folder, tmp_path):
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=2"]) == 0
    run = tmp_path / "run"
    whole = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(whole + '{"step": 3, "reward_me')  # a kill in the middle of a write
    stale = [run / "checkpoints" / ".step-3.tmp-999999", run / "checkpoints" / ".step-2.old-999998"]
    for folder in stale:
        folder.mkdir()
        (folder / "half.safetensors").write_bytes(b"\0" * 10)
    with pytest.warns(RuntimeWarning, match=r"metrics\.jsonl line \d+ is not a metrics record"):
        assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=3", "train.resume=latest"]) == 0
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3]
    assert not any(f.exists() for f in stale)


def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays(tiny_folder, tmp_path, capsys, monkeypatch):
    import torch

    import flowrl.run.checkpoint as checkpoint

    real_save, calls = torch.save, []

    def save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint's state
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    rc = main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=3"])
    err = capsys.readouterr().err
    assert rc == 1 and "No space left on device" in err and "previous checkpoints are intact" in err
    assert "Traceback" not in err
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1"]  # no half-written step-2, no temporary folder
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=3", "train.resume=latest"]) == 0


def test_eval_of_a_run_without_eval_prompts_says_which_key(tiny_folder, tmp_path, capsys):
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1", "prompts.eval=null"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "prompts.eval is null" in err and "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    assert main(["train", "--debug", "optim.betas=[0.9]"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "optim.betas" in err


def test_a_finished_run_resumed_again_adds_nothing(tiny_folder, tmp_path, capsys):
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1"]) == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1", "train.resume=latest"]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


# ---- kill -9 at random points ---------------------------------------------------------------------------
def _records(path: Path) -> list[dict]:
    """The metrics without wall-clock timings."""
    return [without_wall_clock(json.loads(l)) for l in path.read_text().splitlines()]


# slow (38 s): 20 steps killed at random points; the default set holds resume equality by
# test_families_e2e.py::test_resume_equals_a_straight_run and a kill -9 before the first checkpoint by
# test_resume_messages.py::test_resume_after_kill_9_before_the_first_checkpoint_refuses_and_erases_nothing
@pytest.mark.slow
def test_kill_9_at_random_points_resumes_to_the_uninterrupted_metrics(tiny_folder, tmp_path, request):
    steps = 20
    command = [sys.executable, "-m", "flowrl", "train"]
    # the uninterrupted reference runs in its own folder beside the killed one (one thread each: on two cores
    # it costs no extra wall time); its metrics are compared once both are done
    with open(tmp_path / "reference.err", "w") as reference_err:
        reference = subprocess.Popen(
            command + tiny_args(tiny_folder, tmp_path, "reference", f"train.max_steps={steps}"),
            stdout=subprocess.DEVNULL,
            stderr=reference_err,
        )
    request.addfinalizer(lambda: reference.poll() is None and (reference.kill(), reference.wait()))

    rng = random.Random(24)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    kills, finished = 0, False
    for attempt in range(8):
        extra = ["train.resume=latest"] if attempt else []
        proc = subprocess.Popen(
            command + tiny_args(tiny_folder, tmp_path, "killed", f"train.max_steps={steps}", *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if kills < 3:
            # wait for a random number of logged records, then a random part of an iteration (rollout, update or
            # checkpoint write), and kill without warning
            have = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            target = have + rng.randint(1, 5)  # new progress past the last resume
            deadline = time.time() + 120
            while (
                proc.poll() is None
                and time.time() < deadline
                and (not metrics.exists() or len(metrics.read_text().splitlines()) < target)
            ):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))  # about one iteration with its checkpoint write
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            finished = True
            break
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.err").read_text()[-2000:]
    assert finished and kills == 3
    assert _records(metrics) == _records(tmp_path / "reference" / "metrics.jsonl")
    assert not list((tmp_path / "killed" / "checkpoints").glob(".step-*"))
