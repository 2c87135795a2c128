"""train.pipeline=async (flowrl/training/pipeline.py): a rollout process on the fixed schedule of train.max_staleness.

The runs build a tiny SD3 from a saved folder (the rollout process builds its own copy from the config, as a run
from a hub id or a folder does), 1 torch thread per side so that sampled numbers do not depend on thread counts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.replay import replay
from flowrl.training.pipeline import RolloutFailed, behaviour_version, check_pipeline, split_threads
from flowrl.training.trainer import Trainer

PROMPTS = "a red circle|two blue squares|a green cat|a small dog"
TIMING = ("time/", "perf/", "pipeline/", "compile/")  # keys that differ between equal runs


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


def overrides(folder: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [
        "model.family=sd3",
        f"model.path={folder}",
        "model.lora.rank=4",
        "model.lora.init=default",
        "rollout.group_size=4",
        "rollout.steps=6",
        "rollout.window.mode=fixed",
        "rollout.window.start=0",
        "rollout.window.size=3",
        "rollout.max_batch=8",
        f"prompts.train={PROMPTS}",
        "prompts.per_step=2",
        "prompts.eval=null",
        "optim.lr=3e-3",
        "loss.clip_low=0.2",
        "loss.clip_high=0.2",
        "loss.kl_ref=0.01",
        "train.max_steps=3",
        f"train.output_dir={out}",
        f"train.name={name}",
        "train.progress=false",
        "train.num_threads=1",
        "rewards=[{name: brightness}]",
        *extra,
    ]


def config(folder: Path, out: Path, name: str, *extra: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, overrides(folder, out, name, *extra))


ASYNC = ("train.pipeline=async", "train.num_threads=2", "train.rollout_threads=1")


def records(out: Path, name: str) -> list[dict]:
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def test_the_schedule_and_the_thread_split():
    assert [behaviour_version(k, 1) for k in range(4)] == [0, 0, 1, 2]
    assert [behaviour_version(k, 2) for k in range(4)] == [0, 0, 0, 1]
    assert [behaviour_version(k, 0) for k in range(3)] == [0, 1, 2]
    t = TrainConfig.from_yaml(None, ["train.pipeline=async", "train.num_threads=4"]).train
    assert split_threads(t) == (2, 2)
    t = TrainConfig.from_yaml(None, ["train.pipeline=async", "train.num_threads=4", "train.rollout_threads=1"]).train
    assert split_threads(t) == (3, 1)
    t = TrainConfig.from_yaml(None, ["train.num_threads=4"]).train
    assert split_threads(t) == (4, None)


def test_what_async_cannot_run_is_refused_naming_the_key():
    cfg = TrainConfig.from_yaml(None, ["train.pipeline=async"])
    with pytest.raises(ConfigError, match="a model object was given"):
        check_pipeline(cfg, model=object())
    check_pipeline(TrainConfig.from_yaml(None, []), model=object())  # sync: anything
    refused = {
        "train.pipeline=asynchronous": "train.pipeline='asynchronous'.*'sync', 'async'",
        "train.max_staleness=-1": "train.max_staleness=-1 must be >= 0",
        "train.rollout_threads=0": "train.rollout_threads=0 must be >= 1",
        "train.pipeline=sync train.rollout_threads=2": "train.rollout_threads=2 is set but nothing reads it",
        "train.pipeline=async prompts.sampling=adaptive": "prompts.sampling='adaptive'.*train.max_staleness=1",
        "train.pipeline=async loss.objective=grpo_guard": "loss.objective='grpo_guard' cannot train off-policy",
    }
    for line, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_yaml(None, line.split())
    for line in ("train.pipeline=async train.max_staleness=0 loss.objective=grpo_guard", "train.pipeline=async"):
        assert TrainConfig.from_yaml(None, line.split()).train.pipeline == "async"  # at staleness 0: on-policy


def test_async_at_staleness_zero_is_the_serial_run(tiny_folder, tmp_path):
    """Staleness 0 waits for every update: the same forests, the same updates, every key equal but timing; the
    periodic and final evals run in the trainer between them (the rollout process waiting, not deadlocked)."""
    evals = ("prompts.eval=a red circle|a small dog", "eval.every=2", "eval.steps=3", "eval.at_start=false")
    Trainer(config(tiny_folder, tmp_path, "sync", *evals)).train()
    Trainer(config(tiny_folder, tmp_path, "async", *ASYNC, *evals, "train.max_staleness=0")).train()
    a, b = records(tmp_path, "sync"), records(tmp_path, "async")
    assert len(a) == len(b) == 3
    read = lambda name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    evals_a = [untimed(r) for r in read("sync") if "reward_mean" not in r]
    evals_b = [untimed(r) for r in read("async") if "reward_mean" not in r]
    assert [r["step"] for r in evals_b] == [2, 3] and evals_a[0] == evals_b[0]
    # the closing eval: async's on both sides' 2 threads (its rollout process idle), the serial run's on its 1, so
    # equal to float summation order
    assert evals_a[1] == pytest.approx(evals_b[1], rel=1e-5, abs=1e-7)
    for ra, rb in zip(a, b):
        assert untimed(ra) == untimed(rb), ra["step"]
        assert rb["pipeline/staleness"] == 0 and rb["pipeline/version"] == ra["step"] - 1
        assert rb["first_step_abs_delta_logp"] == 0.0  # the ratio is exactly 1 at staleness 0


def test_staleness_one_samples_behind_its_ratio_is_the_exact_one_and_resume_is_the_uninterrupted_run(
    tiny_folder, tmp_path
):
    """Forest k is sampled from the weights before update k − 1; the first step's ratios are those between the two
    weights, recomputed here independently. A checkpoint holds the jobs in flight and the weights that sample them:
    2 + 2 iterations equal 4 on every key but timing."""
    extra = (*ASYNC, "train.max_staleness=1", "train.ema=0.5")
    straight = Trainer(config(tiny_folder, tmp_path, "straight", *extra, "train.max_steps=4"))
    versions: list[list[torch.Tensor]] = [[p.detach().clone() for p in straight.params]]  # version 0
    seen = []
    update = straight.update

    def recording(forest, iteration):
        before = [p.detach().clone() for p in straight.params]
        out = update(forest, iteration)
        seen.append((forest, before))
        versions.append([p.detach().clone() for p in straight.params])
        return out

    straight.update = recording
    straight.train()
    recs = records(tmp_path, "straight")
    assert [r["pipeline/version"] for r in recs] == [0, 0, 1, 2]
    assert [r["pipeline/staleness"] for r in recs] == [0, 1, 1, 1]
    assert recs[0]["first_step_abs_delta_logp"] == 0.0
    for k in (1, 2, 3):
        forest, current = seen[k]
        behaviour = versions[behaviour_version(k, 1)]
        batches = [b.index for b in straight.objective.batches(forest)]
        cond = straight.model.encode(forest.prompts, forest.guidance)
        logps = {}
        for label, weights in (("behaviour", behaviour), ("current", current)):
            with torch.no_grad():
                for p, w in zip(straight.params, weights):
                    p.copy_(w)
                logps[label] = torch.cat([replay(straight.model, forest, cond, b).logp for b in batches])
        edges = torch.cat(batches)
        # the rollout process recorded the behaviour weights' log-probs
        torch.testing.assert_close(forest.logp_old[edges], logps["behaviour"], rtol=0, atol=1e-6)
        exact = torch.exp(logps["current"] - logps["behaviour"])
        assert float(exact.max() - exact.min()) > 1e-5  # the weights did move: a real off-policy ratio
        for key, value in (("max", exact.max()), ("min", exact.min()), ("mean", exact.mean())):
            assert recs[k][f"offpolicy/ratio_{key}"] == pytest.approx(float(value), abs=1e-6), (k, key)

    Trainer(config(tiny_folder, tmp_path, "resumed", *extra, "train.max_steps=2")).train()
    second = Trainer(config(tiny_folder, tmp_path, "resumed", *extra, "train.max_steps=4", "train.resume=latest"))
    second.train()
    resumed = records(tmp_path, "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for ra, rb in zip(recs, resumed):
        assert untimed(ra) == untimed(rb), ra["step"]
    resumed_other = config(
        tiny_folder, tmp_path, "resumed", *ASYNC, "train.max_staleness=2", "train.max_steps=6", "train.resume=latest"
    )
    with pytest.raises(ConfigError, match="train.max_staleness=2.*written with train.max_staleness=1"):
        Trainer(resumed_other).train()


FAILING_REWARD = '''
import multiprocessing, os
import torch
from flowrl_rewards import Reward


class FailsInTheRolloutProcess(Reward):
    """Scores brightness; in the rollout process, its second call {how}."""

    name = "fails"

    def __init__(self):
        self.calls = 0

    def score(self, images, prompts, meta):
        in_rollout = multiprocessing.current_process().name == "flowrl-rollout"
        self.calls += 1
        if in_rollout and self.calls == 2:
            {action}
        return images.float().mean(dim=(1, 2, 3))
'''


@pytest.mark.parametrize(
    "how, action, expected",
    [
        ("raises", "raise ValueError('the judge said no')", "the judge said no"),
        ("exits", "os._exit(7)", r"rollout process exited \(status 7\)"),
    ],
)
def test_a_failed_rollout_process_stops_the_run_with_its_own_error_keeping_the_last_iteration(
    tiny_folder, tmp_path, how, action, expected
):
    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_REWARD.replace("{how}", how).replace("{action}", action))
    cfg = config(
        tiny_folder,
        tmp_path,
        "fails",
        *ASYNC,
        "train.max_staleness=0",
        "train.max_steps=4",
        "train.async_reward=false",
        f"rewards=[{{name: '{plugin}:FailsInTheRolloutProcess'}}]",
    )
    trainer = Trainer(cfg)
    with pytest.raises(Exception, match=expected) as caught:
        trainer.train()
    if how == "raises":  # the error the rollout process raised (as a serial run raises it), its traceback the cause
        assert not isinstance(caught.value, RolloutFailed)
        assert isinstance(caught.value.__cause__, RolloutFailed) and "ValueError" in str(caught.value.__cause__)
    assert [r["step"] for r in records(tmp_path, "fails")] == [1]
    assert (tmp_path / "fails" / "checkpoints" / "step-1").is_dir()  # the last finished iteration is kept
    assert trainer.rollouts.link is None  # stopped


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def start_cli_run(tiny_folder: Path, out: Path, name: str) -> subprocess.Popen:
    path = out / f"{name}.yaml"
    path.write_text(config(tiny_folder, out, name, *ASYNC, "train.max_steps=200", "train.checkpoint_every=1").to_yaml())
    return subprocess.Popen(
        [sys.executable, "-m", "flowrl", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_rollout_process(proc: subprocess.Popen, run: Path) -> int:
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip():
            kids = [k for k in children(proc.pid) if "flowrl-rollout" in _cmdline(k) or "spawn" in _cmdline(k)]
            if kids:
                return kids[0]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError("the run did not finish an iteration within 120 s")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_kill_9_of_the_trainer_leaves_no_rollout_process(tiny_folder, tmp_path):
    proc = start_cli_run(tiny_folder, tmp_path, "killed")
    worker = wait_for_rollout_process(proc, tmp_path / "killed")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.time() + 10
    while alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "the rollout process outlived its trainer"


@pytest.mark.slow  # a CLI run and its signal (kill -9, the default set's twin, starts the same run)
def test_sigterm_stops_both_sides_within_the_grace_and_saves(tiny_folder, tmp_path):
    proc = start_cli_run(tiny_folder, tmp_path, "stopped")
    worker = wait_for_rollout_process(proc, tmp_path / "stopped")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert time.time() - t0 < 30, out
    assert "saved a checkpoint" in out, out
    assert not alive(worker)
    done = records(tmp_path, "stopped")[-1]["step"]
    assert (tmp_path / "stopped" / "checkpoints" / f"step-{done}").is_dir()


def test_rollout_correction_truncates_the_importance_weight_and_rejects_outside_the_band():
    """Per edge, against the behaviour log-probs: below the cap the loss is the clipped objective's to the bit; above
    it the unclipped branch's weight is min(r, C) (its gradient C·∇log π); edges outside the band weigh nothing."""
    from flowrl.objectives.policy import PolicyLoss

    logp_old = torch.zeros(4)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    logp = torch.log(torch.tensor([1.5, 3.0, 0.5, 1.0])).requires_grad_()
    plain = PolicyLoss(clip_low=0.2, clip_high=0.2, kl_ref=0.0, offpolicy_cap=1e9)
    capped = PolicyLoss(clip_low=0.2, clip_high=0.2, kl_ref=0.0, offpolicy_cap=2.0)
    banded = PolicyLoss(clip_low=0.2, clip_high=0.2, kl_ref=0.0, offpolicy_cap=2.0, offpolicy_reject=[0.6, 2.5])
    (g_plain,) = torch.autograd.grad(plain(logp, logp_old, adv)[0], logp)
    loss, diag = capped(logp, logp_old, adv)
    (g_capped,) = torch.autograd.grad(loss, logp)
    # edge 1 (r 3 > C 2, A < 0): value −A·C, gradient −A·C/4 (mean over 4 edges); the others as without a cap
    assert float(loss) == pytest.approx((1.5 + 2.0 - 0.5 + 1.0) / 4)  # per edge max(−A·min(r, C), −A·clip(r))
    torch.testing.assert_close(g_capped[[0, 2, 3]], g_plain[[0, 2, 3]])
    assert float(g_capped[1]) == pytest.approx(2.0 / 4) and float(g_plain[1]) == pytest.approx(3.0 / 4)
    assert float(diag["offpolicy/truncated"]) == 0.25 and float(diag["offpolicy/ratio_max"]) == pytest.approx(3.0)
    loss_b, diag_b = banded(logp, logp_old, adv)
    (g_banded,) = torch.autograd.grad(loss_b, logp)
    assert float(g_banded[1]) == 0.0 and float(g_banded[2]) == 0.0  # r 3 and r 0.5 leave [0.6, 2.5]
    torch.testing.assert_close(g_banded[[0, 3]], g_capped[[0, 3]])
    assert float(diag_b["offpolicy/rejected"]) == 0.5
    # at the behaviour weights nothing changes: the same loss and gradient to the bit
    at_one = torch.zeros(4, requires_grad=True)
    a, b = plain(at_one, logp_old, adv)[0], banded(at_one, logp_old, adv)[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"loss.offpolicy_reject=\[1.5, 2.0\] must be \[low, high\]"):
        PolicyLoss(offpolicy_reject=[1.5, 2.0])
    with pytest.raises(ValueError, match="loss.offpolicy_cap=1.0 must be > 1"):
        PolicyLoss(offpolicy_cap=1.0)


def test_flowrl_bench_times_an_asynchronous_run_and_stops_its_rollout_process(tiny_folder, tmp_path, monkeypatch):
    """The timed iterations are the trainer's; stopping the rollout process afterwards (its job in flight, its exit:
    here made 2 s longer) is no iteration's time."""
    from flowrl.commands.bench import bench_iteration
    from flowrl.training.pipeline import AsyncRollouts

    close = AsyncRollouts.close
    monkeypatch.setattr(AsyncRollouts, "close", lambda self: (time.sleep(2.0), close(self))[1])
    cfg = config(tiny_folder, tmp_path, "bench", *ASYNC)
    out = bench_iteration(cfg, iterations=2, warmup=1)
    assert out["seconds_per_iteration"] < out["time/update"] + out["pipeline/update_wait"] + 0.7  # not + 1 s
    assert out["pipeline/staleness"] == 1.0  # both timed forests one update behind
    assert out["pipeline/update_wait"] >= 0 and out["time/rollout"] > 0  # the rollout process's own time
    assert out["overhead_seconds"] == pytest.approx(
        out["seconds_per_iteration"] - out["forward_seconds"] - out["backward_seconds"] - out["pipeline/update_wait"]
    )
    assert not [p for p in children(os.getpid()) if "spawn" in _cmdline(p)]  # no rollout process left


def test_the_main_job_runs_its_rollouts_one_update_behind_through_the_cli(tmp_path):
    """``flowrl train`` with no config (the main job, configs/shapes/nft.yaml) is asynchronous: every forest after
    the first is sampled from the weights one update old, and the run ends with no rollout process left;
    ``train.pipeline=sync`` samples every forest from the current weights."""
    from flowrl.commands.main import main

    small = [
        "rollout.group_size=4",
        "rollout.steps=3",
        "prompts.per_step=2",
        "prompts.eval=null",
        "train.max_steps=3",
        "train.checkpoint_every=0",
        "train.progress=false",
        f"train.output_dir={tmp_path}",
    ]
    assert main(["train", *small, "train.name=main"]) == 0
    assert [r["pipeline/staleness"] for r in records(tmp_path, "main")] == [0, 1, 1]
    assert not [p for p in children(os.getpid()) if "spawn" in _cmdline(p)]
    assert main(["train", *small, "train.name=serial", "train.pipeline=sync"]) == 0
    assert all("pipeline/staleness" not in r for r in records(tmp_path, "serial"))


def test_the_closing_eval_takes_the_idle_rollout_processs_threads(tiny_folder, tmp_path, monkeypatch):
    """The evals that run while the rollout process samples use the trainer's share of the threads; the closing eval,
    after the last iteration (no job left in flight), uses both sides' (``train.num_threads``), and the share is
    given back after it."""
    seen = []
    evaluate = Trainer._evaluate

    def counting(self, tag=None):
        seen.append((tag, torch.get_num_threads()))
        return evaluate(self, tag)

    monkeypatch.setattr(Trainer, "_evaluate", counting)
    evals = ("prompts.eval=a red circle", "eval.steps=2", "eval.every=1", "eval.at_start=true")
    trainer = Trainer(config(tiny_folder, tmp_path, "threads", *ASYNC, *evals, "train.max_steps=2"))
    trainer.train()
    assert seen == [("before", 1), (None, 1), ("after", 2)] and torch.get_num_threads() == 1  # step 2: the closing one
