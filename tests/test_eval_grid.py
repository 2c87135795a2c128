"""Sample grids a person can read: each image with its prompt and a pass/fail mark from the eval reward."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from flowrl.evaluation import save_labelled_grid
from flowrl.shapes import prompt_sets, world
from rewards import MultiReward


def _marks(path, n: int, ncol: int = 4) -> list[str]:
    """'pass' / 'fail' / '' per cell from the mark's colour under each image (green, red, none)."""
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    cell_w, cell_h, pad = 128, 128 + 38, 6
    out = []
    for i in range(n):
        r, c = divmod(i, ncol)
        x0, y0 = pad + c * (cell_w + pad), pad + r * (cell_h + pad) + 128
        band = img[y0:y0 + 12, x0:x0 + cell_w]
        green = ((band[..., 1] > 100) & (band[..., 0] < 80)).sum()
        red = ((band[..., 0] > 150) & (band[..., 1] < 80)).sum()
        out.append("pass" if green > red else "fail" if red > green else "")
    return out


def test_grid_marks_each_image_with_the_eval_rewards_verdict(tmp_path):
    rng = np.random.default_rng(0)
    prompts = prompt_sets.prompt_sets(0)[1][:6]
    images = torch.from_numpy(np.stack([world.render(world.parse(p), rng) for p in prompts])).permute(0, 3, 1, 2).float() / 255
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
