"""Video through the whole loop (issue 37): image rewards score a video's frames (every ``frame_stride``-th) and
average them, video rewards take it whole (the temporal-consistency reward), a video reward on an image model fails
at load, the trainer's rollouts, evals (animated GIF grids) and ``flowrl sample`` on the tiny Wan pipeline. CPU only."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl_rewards import MultiReward, Reward, build_reward
from tests.conftest import make_model

SIZE = dict(height=32, width=48, num_frames=5, max_sequence_length=12)  # 5 frames ↔ 2 latent frames


def wan_model(guidance: float = 2.0):
    from flowrl.models import wrap
    from flowrl.models.testing.wan import tiny_wan_pipeline

    return wrap(tiny_wan_pipeline(scheduler="euler"), guidance=guidance, **SIZE)


def levels(*values: float, size: int = 4) -> torch.Tensor:
    """One video [1, F, 3, size, size] whose frame t is flat at ``values[t]``."""
    return torch.tensor(values).view(1, -1, 1, 1, 1).expand(1, len(values), 3, size, size).clone()


class Calls(Reward):
    """Brightness that records the shape of every batch it is given."""

    name = "calls"

    def __init__(self):
        self.shapes = []

    def score(self, images, prompts, meta):
        self.shapes.append(tuple(images.shape))
        return images.mean(dim=(1, 2, 3))


# ---- rewards on videos ---------------------------------------------------------------------------------
def test_an_image_reward_scores_every_strided_frame_and_averages_them_per_video():
    video = torch.cat([levels(0.0, 0.2, 0.4, 0.6, 1.0), levels(1.0, 1.0, 0.0, 0.0, 0.5)])  # [2, 5, 3, 4, 4]
    bright = build_reward("brightness")
    torch.testing.assert_close(bright(video, ["a", "b"]), torch.tensor([0.44, 0.5]))
    calls = Calls()
    torch.testing.assert_close(calls(video, ["a", "b"]), torch.tensor([0.44, 0.5]))
    assert calls.shapes == [(2, 3, 4, 4)] * 5  # each frame alone, as an image batch: the plugin is unchanged
    # frame_stride from a reward term's kwargs (as from YAML): frames 0, 2, 4
    multi = MultiReward([{"name": "brightness", "kwargs": {"frame_stride": 2}}, {"name": "saturation"}])
    assert [r.frame_stride for r in multi.rewards] == [2, 1] and multi.modality == "any"
    parts = multi.components(video, ["a", "b"])
    torch.testing.assert_close(parts["brightness"], torch.tensor([(0.0 + 0.4 + 1.0) / 3, (1.0 + 0.0 + 0.5) / 3]))
    calls.frame_stride = 3
    calls.shapes.clear()
    torch.testing.assert_close(calls(video, ["a", "b"]), torch.tensor([0.3, 0.5]))  # frames 0, 3
    assert len(calls.shapes) == 2
    images = video[:, 0]  # images are unchanged
    torch.testing.assert_close(multi.components(images, ["a", "b"])["brightness"], torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"reward 'brightness': frame_stride=0 must be an integer >= 1"):
        MultiReward([{"name": "brightness", "kwargs": {"frame_stride": 0}}])
    with pytest.raises(ValueError, match=r"images must be \[B, 3, H, W\] or videos \[B, F, 3, H, W\]"):
        bright(video[:, :, :2], ["a", "b"])


def test_temporal_consistency_ranks_a_flickering_video_below_a_steady_one():
    temporal = build_reward("temporal_consistency")
    assert temporal.modality == "video" and temporal.name == "temporal_consistency"
    gen = torch.Generator().manual_seed(0)
    still = torch.rand(1, 1, 3, 8, 8, generator=gen).expand(1, 6, 3, 8, 8)
    drift = still + 0.02 * torch.arange(6.0).view(1, 6, 1, 1, 1)  # slow, steady change
    flicker = still.clone()
    flicker[:, 1::2] = 1 - flicker[:, 1::2]  # every other frame inverted
    scores = temporal(torch.cat([still, drift.clamp(0, 1), flicker]), ["a"] * 3)
    assert scores[0] == 1.0 and 1.0 > scores[1] > scores[2] >= 0.0, scores
    assert float(temporal(levels(0.0, 1.0, 0.0), ["a"])) == pytest.approx(0.0)
    assert float(temporal(levels(0.3), ["a"])) == 1.0  # one frame: nothing flickers
    temporal.frame_stride = 2  # frames 0, 2, 4 of an on/off video are all alike
    assert float(temporal(levels(0.0, 1.0, 0.0, 1.0, 0.0), ["a"])) == pytest.approx(1.0)
    with pytest.raises(
        ValueError,
        match=r"reward 'temporal_consistency' \(TemporalConsistency\) scores videos "
        r"\[B, F, 3, H, W\] only \(modality 'video'\), got images of shape \(1, 3, 8, 8\)",
    ):
        temporal(still[:, 0], ["a"])


def test_a_video_reward_with_an_image_model_fails_at_load_naming_it(tmp_path):
    from flowrl.training.trainer import Trainer
    from tests.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, "image", "rewards=[{name: brightness}, {name: temporal_consistency, label: steady}]")
    with pytest.raises(
        ConfigError,
        match=r"^rewards: reward 'steady' \(TemporalConsistency\) scores videos .* only "
        r"\(modality 'video'\), but model family 'sd3' samples images",
    ):
        Trainer(cfg, model=make_model("sd3"))
    cfg = tiny_config(tmp_path, "image_eval", "eval.rewards=[{name: temporal_consistency}]")
    with pytest.raises(ConfigError, match=r"^eval.rewards: reward 'temporal_consistency'"):
        Trainer(cfg, model=make_model("sd3"))
    assert not (tmp_path / "image_eval" / "metrics.jsonl").exists()  # failed before any rollout


# ---- the loop on the tiny Wan pipeline ---------------------------------------------------------------------
def test_one_policy_iteration_on_wan_logs_both_terms_and_writes_animated_eval_grids(tmp_path):
    from PIL import Image

    from flowrl.training.trainer import Trainer
    from tests.test_trainer import tiny_config

    cfg = tiny_config(
        tmp_path,
        "wan",
        "model.family=wan",
        "train.max_steps=1",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.size=2",
        "eval.steps=2",
        "train.async_reward=false",
        "rewards=[{name: brightness, kwargs: {frame_stride: 2}}, {name: temporal_consistency}]",
    )
    trainer = Trainer(cfg, model=wan_model())
    assert [(r.name, r.frame_stride) for r in trainer.reward.rewards] == [
        ("brightness", 2),
        ("temporal_consistency", 1),
    ]
    before = [p.detach().clone() for p in trainer.params]
    records = trainer.train()
    (record,) = [r for r in records if "reward_mean" in r]
    assert record["first_step_abs_delta_logp"] == 0.0 and record["trained_edges"] == 2 * 2 * 2
    assert 0.0 <= record["reward/brightness"] <= 1.0 and 0.0 <= record["reward/temporal_consistency"] <= 1.0
    assert record["reward_mean"] == pytest.approx(
        record["reward/brightness"] + record["reward/temporal_consistency"], rel=1e-5
    )
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
    lines = [json.loads(line) for line in (tmp_path / "wan" / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/brightness_mean", "eval/temporal_consistency_mean"} <= set(lines[0]) and "reward/brightness" in lines[
        1
    ]
    for tag in ("before", "after"):
        assert not (tmp_path / "wan" / "samples" / f"{tag}.png").exists()
        with Image.open(tmp_path / "wan" / "samples" / f"{tag}.gif") as gif:
            assert gif.format == "GIF" and gif.is_animated and gif.n_frames == SIZE["num_frames"]


def test_one_nft_iteration_on_wan_moves_the_lora(tmp_path):
    from flowrl.training.trainer import Trainer
    from tests.test_forward_process import tiny

    cfg = tiny(
        tmp_path,
        "wan_nft",
        "model.family=wan",
        "loss.objective=nft",
        "train.max_steps=1",
        "optim.lr=1e-2",
        "rewards=[{name: redness}, {name: temporal_consistency}]",
    )
    trainer = Trainer(cfg, model=wan_model(guidance=1.0))
    before = [p.detach().clone() for p in trainer.params]
    (record,) = [r for r in trainer.train() if "reward_mean" in r]
    assert record["trained_leaves"] == 4.0 and record["grad_norm"] > 0 and "reward/temporal_consistency" in record
    assert all(torch.isfinite(torch.tensor(v)) for v in record.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))


def test_layer_tuning_noises_each_video_row_at_its_own_sigma(monkeypatch):
    """``LayerTuningLoss.auxiliary`` on 5-D latents: row i is (1 − σ_i)·x0 + σ_i·ε_i. 2 groups × 2 σ = 4 rows, as
    many as the latent channels: a [N, 1, 1, 1] σ broadcast silently over the channel axis instead."""
    from flowrl.core.seeding import derive_seed, seeded_normal
    from flowrl.objectives.policy import LayerTuningLoss
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.tree import Tree

    model = wan_model(guidance=1.0)
    forest = Tree(steps=2, split_steps=[0], kernel="dance", eta=0.5).rollout(
        model, ["a red circle", "two blue squares"], RolloutContext(seed=0)
    )
    leaves = forest.leaves()
    forest.reward[leaves] = torch.rand(len(leaves), generator=torch.Generator().manual_seed(0))
    seen = []
    velocity = model.velocity
    monkeypatch.setattr(model, "velocity", lambda x, s, *a: seen.append((x.detach(), s)) or velocity(x, s, *a))
    loss, _ = LayerTuningLoss(layer_lambda=1.0).auxiliary(model, forest, model.encode(forest.prompts, 1.0))
    assert float(loss.detach()) > 0
    ((x, sigma),) = seen
    assert x.shape == (4, *model.latent_shape) == (4, 4, 2, 4, 6)
    group = forest.group[leaves]
    best = [int(leaves[group == g][int(torch.argmax(forest.reward[leaves[group == g]]))]) for g in (0, 1)]
    for i, (b, s) in enumerate(zip([best[0]] * 2 + [best[1]] * 2, sigma.tolist())):
        eps = seeded_normal(derive_seed(int(forest.seed[b]), "layer_tuning", s), model.latent_shape)
        torch.testing.assert_close(x[i], (1 - s) * forest.all_latents()[b] + s * eps)


def test_nothing_to_score_decodes_to_an_empty_batch_of_videos():
    from flowrl.rollout.decoding import decode

    model = wan_model()
    assert decode(model, torch.zeros(0, *model.latent_shape), 4).shape == (0, 5, 3, 32, 48)
    assert decode(model, model.noise([0]), 4).shape == (1, 5, 3, 32, 48)
    assert decode(make_model("sd3"), torch.zeros(0, 4, 8, 8), 4).shape == (0, 3, 16, 16)


# ---- writing videos --------------------------------------------------------------------------------------
def test_flowrl_sample_writes_animated_gifs_for_a_video_model(tmp_path, monkeypatch):
    from PIL import Image

    from flowrl.commands import sample as cli_sample
    from flowrl.config.schema import TrainConfig

    cfg = TrainConfig.from_yaml(None, ["model.family=wan", "eval.steps=2"])
    monkeypatch.setattr(cli_sample, "model_from_run", lambda *a: (cfg, wan_model(), None))
    args = argparse.Namespace(
        command="sample",
        checkpoint=None,
        config=None,
        overrides=[],
        prompt=["a red circle"],
        num=2,
        seed=0,
        guidance=None,
        steps=None,
        out=str(tmp_path / "out"),
        scale=1,
    )
    assert cli_sample.run(args) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["000-a_red_circle.gif", "001-a_red_circle.gif", "grid.gif"], files
    for name in files:
        with Image.open(tmp_path / "out" / name) as gif:
            assert gif.n_frames == SIZE["num_frames"]
            size = gif.size
    assert size == (
        2 * (128 + 6) + 6,
        32 + 38 + 2 * 6,
    )  # grid.gif: the two videos in one row, each in a labelled 128 px cell
