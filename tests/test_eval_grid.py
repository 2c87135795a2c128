"""Sample grids a person can read: each image with its prompt and a pass/fail mark from the eval reward."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from flowrl.shapes import prompt_sets, world
from flowrl.training.grids import save_labelled_grid
from flowrl_rewards import MultiReward


def _marks(path, n: int, ncol: int = 4) -> list[str]:
    """'pass' / 'fail' / '' per cell from the mark's colour under each image (green, red, none)."""
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    cell_w, cell_h, pad = 128, 128 + 38, 6
    out = []
    for i in range(n):
        r, c = divmod(i, ncol)
        x0, y0 = pad + c * (cell_w + pad), pad + r * (cell_h + pad) + 128
        band = img[y0 : y0 + 12, x0 : x0 + cell_w]
        green = ((band[..., 1] > 100) & (band[..., 0] < 80)).sum()
        red = ((band[..., 0] > 150) & (band[..., 1] < 80)).sum()
        out.append("pass" if green > red else "fail" if red > green else "")
    return out


def test_grid_marks_each_image_with_the_eval_rewards_verdict(tmp_path):
    rng = np.random.default_rng(0)
    prompts = prompt_sets.prompt_sets(0)[1][:6]
    images = (
        torch.from_numpy(np.stack([world.render(world.parse(p), rng) for p in prompts])).permute(0, 3, 1, 2).float()
        / 255
    )
    images[2] = 0  # a blank image fails its prompt
    images[5] = images[5].flip(-1).flip(-2) if "left of" in prompts[5] or "above" in prompts[5] else 0
    strict = MultiReward([{"name": "shapes", "kwargs": {"mode": "strict"}}])
    save_labelled_grid(images, prompts, strict, tmp_path / "grid.png")
    expected = ["pass" if s == 1 else "fail" for s in strict(images, prompts, {}).tolist()]
    assert expected[2] == "fail" and expected.count("pass") >= 3
    assert _marks(tmp_path / "grid.png", 6) == expected
    # a non-binary reward prints its score instead of a coloured mark
    save_labelled_grid(images, prompts, MultiReward(["brightness"]), tmp_path / "score.png")
    assert _marks(tmp_path / "score.png", 6) == [""] * 6


def test_a_grid_takes_given_scores_or_no_reward_at_all(tmp_path):
    rng = np.random.default_rng(1)
    prompts = prompt_sets.prompt_sets(0)[1][:5]
    images = (
        torch.from_numpy(np.stack([world.render(world.parse(p), rng) for p in prompts])).permute(0, 3, 1, 2).float()
        / 255
    )
    given = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    save_labelled_grid(images, prompts, None, tmp_path / "given.png", scores=given)
    assert _marks(tmp_path / "given.png", 5) == ["pass", "fail", "fail", "pass", "pass"]
    save_labelled_grid(images, prompts, None, tmp_path / "plain.png")  # the prompts alone
    assert _marks(tmp_path / "plain.png", 5) == [""] * 5
    plain = np.asarray(Image.open(tmp_path / "plain.png").convert("L"))
    assert plain.shape == (2 * (128 + 38 + 6) + 6, 4 * (128 + 6) + 6)
    assert (plain[6 + 128 + 13 : 6 + 128 + 38, 6 : 6 + 128] < 100).sum() > 20  # the first prompt's text under its image
    assert (plain[6 + 128 : 6 + 128 + 12, 6 : 6 + 128] < 100).sum() == 0  # and no mark above it


# ---- the eval grids in the tracker (train.log_with) ------------------------------------------------------------
TRACKED = [
    "configs/shapes/grpo.yaml",
    "prompts.per_step=2",
    "rollout.group_size=2",
    "rollout.steps=3",
    "rollout.window.mode=all",
    "eval.num_prompts=2",
    "eval.steps=2",
    "eval.images_per_prompt=1",
    "eval.grid_prompts=2",
    "train.progress=false",
    "train.num_threads=1",
    "train.name=run",
]


def test_eval_grids_go_to_tensorboard_at_the_step_of_each_eval_and_pass(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowrl.commands.main import main

    # eval at guidance 1 beside the model's default 3: before and after have both passes, the periodic one the first
    assert (
        main(
            [
                "train",
                *TRACKED,
                "train.max_steps=2",
                "eval.every=1",
                "eval.guidance=1",
                f"train.output_dir={tmp_path}",
                "train.log_with=tensorboard",
            ]
        )
        == 0
    )
    acc = EventAccumulator(str(tmp_path / "run" / "run"), size_guidance={"images": 0})  # <logging dir>/<train.name>
    acc.Reload()
    assert {"samples/eval", "samples/eval_default"} <= set(acc.Tags()["images"])
    assert [e.step for e in acc.Images("samples/eval")] == [0, 1, 2]
    assert [e.step for e in acc.Images("samples/eval_default")] == [0, 2]
    first = acc.Images("samples/eval")[0]
    with Image.open(tmp_path / "run" / "samples" / "before.png") as grid:  # the labelled grid itself
        assert (first.width, first.height) == grid.size


def test_eval_grids_go_to_wandb_as_images(tmp_path, monkeypatch):
    """wandb is not installed here: a stand-in module records what accelerate's WandBTracker hands it."""
    import importlib.machinery
    import sys
    import types

    import accelerate.tracking
    from accelerate.utils import LoggerType

    from flowrl.commands.main import main

    logged = []

    class Run:
        def log(self, values, step=None, **kwargs):
            logged.append((step, values))

        def finish(self):
            logged.append(("finished", {}))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: Run()
    fake.config = types.SimpleNamespace(update=lambda values, **kwargs: None)
    fake.Image = type("Image", (), {"__init__": lambda self, image: setattr(self, "image", image)})
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(
        accelerate.tracking, "_available_trackers", [*accelerate.tracking._available_trackers, LoggerType.WANDB]
    )
    assert main(["train", *TRACKED, "train.max_steps=1", f"train.output_dir={tmp_path}", "train.log_with=wandb"]) == 0
    images = [(step, values["samples/eval"]) for step, values in logged if "samples/eval" in values]
    assert [step for step, _ in images] == [0, 1]  # before and after
    (before,) = images[0][1]
    with Image.open(tmp_path / "run" / "samples" / "before.png") as grid:
        assert isinstance(before, fake.Image) and before.image.size == grid.size
    assert any("reward_mean" in values for _, values in logged) and logged[-1][0] == "finished"


def test_the_eval_grid_shows_its_first_images_when_the_eval_has_more_prompts(tmp_path):
    """eval.grid_prompts below eval.num_prompts (the main job: 16 of 240): the grid labels and scores its 16 images
    with their own prompts, and the run goes on (it stopped here once: 16 images scored against 240 prompts)."""
    from flowrl.commands.main import main

    assert (
        main(
            [
                "train",
                *TRACKED,
                "eval.num_prompts=6",
                "eval.grid_prompts=4",
                "train.max_steps=1",
                f"train.output_dir={tmp_path}",
            ]
        )
        == 0
    )
    assert len(_marks(tmp_path / "run" / "samples" / "after.png", 4)) == 4
    with Image.open(tmp_path / "run" / "samples" / "after.png") as grid:  # one row of 4 labelled 128 px cells
        assert grid.size == (4 * (128 + 6) + 6, 128 + 38 + 2 * 6)
