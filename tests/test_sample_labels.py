"""``flowrl sample``'s grid shows each image's prompt and, with ``--reward``, its score (PASS/FAIL for a 0/1 reward),
the scores also in ``scores.json``; a reward that cannot score a prompt (or cannot be built) is refused before the
model loads; a video model's grid is a labelled GIF. The base shapes model, 2 prompts × 2 images, a few steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from test_eval_grid import _marks

from flowrl.commands.main import main

CELL, TEXT, PAD = 128, 38, 6  # a 32 px shapes image at --scale 4, the label band under it, the padding


def prompt_text_under(path, i: int, ncol: int) -> int:
    """Dark pixels in the prompt's lines under image ``i`` of a labelled grid."""
    img = np.asarray(Image.open(path).convert("L"))
    r, c = divmod(i, ncol)
    x0, y0 = PAD + c * (CELL + PAD), PAD + r * (CELL + TEXT + PAD) + CELL
    return int((img[y0 + 13 : y0 + TEXT, x0 : x0 + CELL] < 100).sum())


def sample(out, *extra: str) -> int:
    return main(
        [
            "sample",
            "--prompt",
            "a red circle",
            "--prompt",
            "two blue squares",
            "--num",
            "2",
            "--steps",
            "6",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_the_grid_marks_each_image_with_its_score_and_scores_json_lists_them(tmp_path, capsys):
    out = tmp_path / "out"
    assert sample(out, "--reward", "shapes", "--reward-kwargs", '{"mode": "strict"}') == 0
    assert "scores.json" in capsys.readouterr().out
    scores = json.loads((out / "scores.json").read_text())
    assert scores["reward"] == "shapes" and scores["kwargs"] == {"mode": "strict"} and scores["guidance"] == 3.0
    listed = scores["images"]
    assert [i["prompt"] for i in listed] == ["a red circle"] * 2 + ["two blue squares"] * 2
    assert [i["seed"] for i in listed] == [0, 1, 2, 3] and all((out / i["file"]).is_file() for i in listed)
    values = [i["score"] for i in listed]
    assert set(values) <= {0.0, 1.0} and scores["mean"] == pytest.approx(sum(values) / 4)
    # one row per prompt (--num 2): each image over its mark, the reward's verdict on it, and its prompt
    assert _marks(out / "grid.png", 4, ncol=2) == ["pass" if v == 1 else "fail" for v in values]
    assert all(prompt_text_under(out / "grid.png", i, 2) > 20 for i in range(4))
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (2 * (CELL + PAD) + PAD, 2 * (CELL + TEXT + PAD) + PAD)


def test_without_a_reward_the_grid_shows_the_prompts_and_a_score_reward_its_numbers(tmp_path):
    plain = tmp_path / "plain"
    assert sample(plain) == 0
    assert sorted(p.name for p in plain.iterdir())[-1] == "grid.png" and not (plain / "scores.json").exists()
    assert _marks(plain / "grid.png", 4, ncol=2) == [""] * 4
    assert all(prompt_text_under(plain / "grid.png", i, 2) > 20 for i in range(4))

    scored = tmp_path / "scored"
    assert sample(scored, "--reward", "brightness") == 0  # not pass/fail: the score, in black
    values = [i["score"] for i in json.loads((scored / "scores.json").read_text())["images"]]
    assert all(0 < v < 1 for v in values) and _marks(scored / "grid.png", 4, ncol=2) == [""] * 4
    band = np.asarray(Image.open(scored / "grid.png").convert("L"))[PAD + CELL : PAD + CELL + 12, PAD : PAD + CELL]
    assert (band < 100).sum() > 10  # the first image's score printed under it


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            ["--reward", "shapes", "--prompt", "one green sausage"],
            ["--prompt 'one green sausage'", "--reward='shapes'", "cannot be scored"],
        ),
        (["--reward", "shapez"], ["--reward='shapez'", "not registered", "'shapes'"]),
        (
            ["--reward", "shapes", "--reward-kwargs", "{mode: strict}"],
            ["--reward-kwargs='{mode: strict}'", "JSON object"],
        ),
        (
            ["--reward", "shapes", "--reward-kwargs", '{"mod": "strict"}'],
            ["--reward='shapes'", "mod='strict' is not a key of", "['mode']"],
        ),
        (["--reward-kwargs", '{"mode": "strict"}'], ["--reward-kwargs=", "needs --reward NAME"]),
    ],
)
def test_a_reward_that_cannot_score_is_refused_before_the_model_loads(extra, words, tmp_path, capsys, monkeypatch):
    from flowrl.commands import sample as cli_sample

    def no_model(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_sample, "model_from_run", no_model)
    assert sample(tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_video_models_grid_is_a_labelled_gif_with_its_scores(tmp_path, monkeypatch):
    import argparse

    from test_video import SIZE, wan_model

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
        reward="brightness",
        reward_kwargs=None,
    )
    assert cli_sample.run(args) == 0
    listed = json.loads((tmp_path / "out" / "scores.json").read_text())["images"]
    assert [i["file"] for i in listed] == ["000-a_red_circle.gif", "001-a_red_circle.gif"]
    with Image.open(tmp_path / "out" / "grid.gif") as gif:
        assert gif.n_frames == SIZE["num_frames"]
        assert gif.size == (2 * (CELL + PAD) + PAD, 32 + TEXT + 2 * PAD)  # 48×32 videos in 128 px cells, labelled
        frame = np.asarray(gif.convert("L"))
    assert (frame[PAD + 32 + 13 : PAD + 32 + TEXT, PAD : PAD + CELL] < 100).sum() > 20  # the prompt on every frame
