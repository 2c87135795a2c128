"""The ``ocr`` reward with its real engine (RapidOCR, CPU, one thread) on text strips rendered with DejaVu Sans: the
score's definition, the prompt check (a prompt file without quoted targets fails at load naming its line), the
errors, the eval summary, and one ``flowrl train`` iteration of each OCR preset (configs/sd35/flow_grpo_ocr.yaml,
configs/sd35/nft_ocr.yaml) on a tiny SD3 pipeline scored by the real engine."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.prompts.checks import check_prompts
from flowrl_rewards import build_reward
from flowrl_rewards.text.ocr import edit_distance, quoted_target, text_score

needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("rapidocr_onnxruntime") is None,
    reason="needs rapidocr-onnxruntime (pip install 'flowrl-align[ocr]')",
)
SIGN = 'a neon sign that says "Helloworld"'  # a 10-letter target


def font(size: int = 48):
    """DejaVu Sans: the system's, else the copy matplotlib ships."""
    from PIL import ImageFont

    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        import matplotlib

        return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), size)


def strip(text: str, width: int = 512, height: int = 128) -> torch.Tensor:
    """Black ``text`` centred on a white strip: an image [3, height, width] in [0, 1]."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((width // 2, height // 2), text, fill="black", font=font(), anchor="mm")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


# ---- the score (no engine) ------------------------------------------------------------------------------
def test_edit_distance_and_the_score_formula():
    pairs = [("kitten", "sitting"), ("", "abc"), ("abc", ""), ("abc", "abc"), ("flaw", "lawn")]
    assert [edit_distance(a, b) for a, b in pairs] == [3, 3, 3, 0, 2]
    assert text_score("Hellowarld", "Hello world") == pytest.approx(0.9)  # lower-cased, spaces removed
    assert text_score("BIG SALE TODAY ONLY", "sale today") == 1.0  # inside longer text
    assert text_score("", "abcd") == 0.0
    assert text_score("a completely different and much longer text", "ab") == 0.0  # the distance is capped
    assert quoted_target('a "first" and a "second" quote') == "first"
    assert quoted_target('only one " quote') is None


# ---- the real engine -----------------------------------------------------------------------------------
@needs_engine
def test_exact_text_scores_one_one_wrong_letter_a_tenth_less_blank_zero(ocr):
    images = torch.stack([strip("Helloworld"), strip("Hellowarld"), torch.ones(3, 128, 512)])
    meta: dict = {}
    scores = ocr(images, [SIGN] * 3, meta)
    assert meta["ocr/text"] == ["Helloworld", "Hellowarld", ""]  # what RapidOCR reads
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores[0] >= 0.9 and scores[0] == 1.0
    assert 0.05 <= float(scores[0] - scores[1]) <= 0.2 and float(scores[1]) == pytest.approx(0.9, abs=1e-6)
    assert scores[2] == 0.0


@needs_engine
def test_target_inside_longer_text_and_several_words(ocr):
    images = torch.stack([strip("Big Sale Today Only"), strip("GRAND OPEN")])
    meta: dict = {}
    scores = ocr(images, ['a shop window with "sale today" painted on it', 'a banner reading "Grand Open"'], meta)
    assert meta["ocr/text"] == ["Big Sale Today Only", "GRAND OPEN"]
    assert scores.tolist() == [1.0, 1.0]


@needs_engine
def test_evaluate_gives_the_exact_read_accuracy_and_reuses_the_last_scores(ocr, monkeypatch):
    images = torch.stack([strip("Helloworld"), strip("Hellowarld"), torch.ones(3, 128, 512)])
    ocr(images, [SIGN] * 3)

    def no_second_read(bgr):
        raise AssertionError("the eval summary read the images again")

    monkeypatch.setattr(ocr.engine, "read", no_second_read)
    assert ocr.evaluate(images, [SIGN] * 3) == {"accuracy": pytest.approx(1 / 3), "n": 3}
    with pytest.raises(RuntimeError, match="read the images again"):  # other images are read (engine errors named)
        ocr.evaluate(images[:2], [SIGN] * 2)


# ---- prompts -------------------------------------------------------------------------------------------
@needs_engine
@pytest.mark.parametrize(
    "prompt", ["a sign without quotes", 'a sign with one " quote', 'an empty "" pair', 'a blank "   " pair']
)
def test_prompt_without_a_quoted_target_is_refused(ocr, prompt):
    with pytest.raises(
        ValueError, match='accepted: a prompt with the target text between double quotes, e.g. a sign that says "OPEN"'
    ):
        ocr.check_prompt(prompt)
    with pytest.raises(ValueError, match="accepted"):
        ocr(torch.ones(1, 3, 64, 64), [prompt])
    ocr.check_prompt('a sign that says "OPEN"')  # accepted


@needs_engine
def test_a_prompt_file_without_quotes_fails_at_load_naming_the_line(ocr, tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('a sign that says "OPEN"\n# a comment\na sign that says nothing\n')
    with pytest.raises(
        ConfigError,
        match=r"prompts.train=.*ocr.txt.*, line 3: 'a sign that says nothing' cannot be "
        "scored: .*no pair of double quotes; accepted",
    ):
        check_prompts(str(path), "prompts.train", ocr.check_prompt)


# ---- errors --------------------------------------------------------------------------------------------
def test_unknown_engine_and_bad_settings_name_the_key_and_the_accepted_values():
    with pytest.raises(
        ValueError,
        match=r"engine='tesseract' is not an OCR engine; accepted: \['rapidocr', "
        r"'paddleocr'\]",
    ):
        build_reward("ocr", engine="tesseract")
    with pytest.raises(ValueError, match="threads=0 must be an integer >= 1"):
        build_reward("ocr", threads=0)
    with pytest.raises(ValueError, match=r"min_confidence=1.5 must be a number in \[0, 1\]"):
        build_reward("ocr", min_confidence=1.5)
    with pytest.raises(
        ConfigError,
        match=r"batch_size=8 is not a key of reward 'ocr' \(OcrReward\); accepted: "
        r"\['engine', 'threads', 'min_confidence'\]",
    ):
        build_reward("ocr", batch_size=8)


def test_a_missing_engine_fails_when_built_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"engine='rapidocr' is not installed .*pip install 'flowrl-align\[ocr\]'"):
        build_reward("ocr")
    monkeypatch.setitem(sys.modules, "paddleocr", None)
    with pytest.raises(
        ImportError,
        match=r"engine='paddleocr' is not installed .*pip install 'paddleocr<3' "
        "paddlepaddle",
    ):
        build_reward("ocr", engine="paddleocr")


# ---- flowrl train: one iteration of the preset on a tiny SD3 pipeline ------------------------------------
@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("tiny-sd3")
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


def preset_overrides(folder, tmp_path, train: str, name: str) -> list[str]:
    """An OCR preset (configs/sd35/*_ocr.yaml) cut down to the tiny pipeline: 32 px, groups of 2, 3 steps,
    1 iteration."""
    return [
        f"model.path={folder}",
        "model.dtype=float32",
        "model.height=32",
        "model.width=32",
        "model.max_sequence_length=8",
        "model.lora.rank=4",
        "model.gradient_checkpointing=false",
        "rollout.group_size=2",
        "rollout.steps=3",
        f"prompts.train={train}",
        f"prompts.eval={train}",
        "prompts.per_step=2",
        "eval.steps=2",
        "eval.grid_prompts=2",
        "eval.default_guidance=false",
        "train.max_steps=1",
        f"train.output_dir={tmp_path}",
        f"train.name={name}",
        "train.progress=false",
        "train.log_with=none",
        "train.num_threads=1",
        "train.async_reward=false",
        "train.checkpoint_every=0",
    ]


@needs_engine
@pytest.mark.parametrize("preset, extra", [("flow_grpo_ocr", []), ("nft_ocr", ["loss.draws=2"])])  # 2 of 3 steps
def test_one_iteration_of_each_ocr_preset_logs_the_ocr_reward(tiny_sd3, tmp_path, preset, extra):
    from flowrl.commands.main import main

    prompts = tmp_path / "ocr.txt"
    prompts.write_text('a red sign that says "OPEN"\na blue card with "hello" on it\n')
    assert (
        main(
            ["train", f"configs/sd35/{preset}.yaml", *preset_overrides(tiny_sd3, tmp_path, str(prompts), "ocr"), *extra]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "ocr" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1]
    assert 0.0 <= steps[0]["reward/ocr"] <= 1.0 and steps[0]["reward_mean"] == steps[0]["reward/ocr"]
    evals = [r for r in records if "eval/ocr_mean" in r]
    assert len(evals) == 2  # before and after
    for r in evals:
        assert 0.0 <= r["eval/ocr_mean"] <= 1.0 and 0.0 <= r["eval/ocr/accuracy"] <= 1.0 and r["eval/ocr/n"] == 2


@needs_engine
def test_flowrl_train_refuses_a_prompt_file_without_quoted_targets(tiny_sd3, tmp_path, capsys):
    from flowrl.commands.main import main

    prompts = tmp_path / "bad.txt"
    prompts.write_text('a sign that says "OPEN"\na sign that says nothing\n')
    assert (
        main(["train", "configs/sd35/flow_grpo_ocr.yaml", *preset_overrides(tiny_sd3, tmp_path, str(prompts), "bad")])
        == 2
    )
    err = capsys.readouterr().err
    assert "bad.txt" in err and "line 2: 'a sign that says nothing' cannot be scored" in err
    assert "no pair of double quotes" in err and not (tmp_path / "bad" / "metrics.jsonl").exists()


# ---- flowrl eval --benchmark ocr ---------------------------------------------------------------------------
@needs_engine
def test_benchmark_ocr_scores_every_prompt_and_reports_the_mean(tiny_sd3, tmp_path, capsys, monkeypatch):
    """The OCR benchmark on the tiny pipeline, its sampler swapped for one that writes each prompt's target (and
    one wrong letter for the second prompt): every image read, the mean and the exact share as the engine read them."""
    from flowrl.commands.main import main
    from flowrl.rollout import sampling

    targets = {'a sign that says "OPEN"': "OPEN", 'a card with "Helloworld" on it': "Hellowarld"}

    def drawn(model, prompts, seeds, steps, guidance, max_batch):
        yield 0, torch.stack([strip(targets[p]) for p in prompts])

    monkeypatch.setattr(sampling, "ode_batches", drawn)
    prompts = tmp_path / "test.txt"
    prompts.write_text("\n".join(targets) + "\n")
    out = tmp_path / "bench"
    overrides = preset_overrides(tiny_sd3, tmp_path, str(prompts), "bench")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--benchmark",
                "ocr",
                "--config",
                "configs/sd35/flow_grpo_ocr.yaml",
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                *overrides,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == list(targets) and rows[0]["score"] == 1.0
    assert rows[1]["score"] == pytest.approx(1 - 1 / 10) and rows[1]["recognised"] == "Hellowarld"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean"] == pytest.approx((1 + 0.9) / 2) and summary["images"] == 0.5
    assert "OCR benchmark: 2 images of 2 prompts" in printed and f"{summary['mean']:.4f}" in printed
    assert "% read exactly: 50.00% (1 / 2)" in printed


# ---- round four (issue 54): invisible targets, non-finite images, degenerate sizes ---------------------------
@needs_engine
@pytest.mark.parametrize(
    "target, named",
    [
        ("\t", "U+0009 (a control character)"),
        ("\u00a0", "U+00A0 (NO-BREAK SPACE)"),
        ("\u200b", "U+200B (ZERO WIDTH SPACE)"),
        ("\u200f", "U+200F (RIGHT-TO-LEFT MARK)"),
        ("\u200b \u00a0\t", "U+200B (ZERO WIDTH SPACE), U+0020 (SPACE), U+00A0 (NO-BREAK SPACE)"),
    ],
)
def test_a_target_without_a_visible_character_is_refused_at_load_naming_the_prompt(ocr, tmp_path, target, named):
    prompt = f'a sign that says "{target}"'
    with pytest.raises(ValueError, match="has no visible character") as e:
        ocr.check_prompt(prompt)
    assert repr(prompt) in str(e.value) and named in str(e.value) and "always score 0" in str(e.value)
    path = tmp_path / "ocr.txt"
    path.write_text(f'a sign that says "OPEN"\n{prompt}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"ocr.txt.*, line 2: .* cannot be scored: .*no visible character"):
        check_prompts(str(path), "prompts.train", ocr.check_prompt)
    ocr.check_prompt('a sign that says "\u200fOPEN"')  # a mark beside visible text is text the engine can read
    ocr.check_prompt('a sign that says "€"')


@needs_engine
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_image_with_non_finite_values_scores_nan_not_zero(ocr, bad):
    images = torch.stack([strip("Helloworld"), strip("Helloworld"), strip("Helloworld")])
    images[1] = bad
    images[2, :, :4, :4] = bad  # a few values suffice
    meta: dict = {}
    scores = ocr(images, [SIGN] * 3, meta)
    assert scores[0] == 1.0 and torch.isnan(scores[1:]).all()
    assert ocr.last_error == "2 of 3 images hold non-finite values (NaN or inf; the first: image 1), scored NaN"
    assert meta["ocr/text"][1:] == ["", ""]
    assert ocr(images[:1], [SIGN]).item() == 1.0 and ocr.last_error is None
    assert ocr.evaluate(images, [SIGN] * 3)["accuracy"] == pytest.approx(1 / 3)
    black = torch.zeros(1, 3, 128, 512)  # what a NaN image becomes as 8 bits: not taken for the NaN one's scores
    ocr(torch.full((1, 3, 128, 512), float("nan")), [SIGN])
    assert ocr.evaluate(black, [SIGN]) == {"accuracy": 0.0, "n": 1}


@needs_engine
@pytest.mark.parametrize("height, width", [(1, 4000), (4000, 1)])
def test_a_degenerate_image_size_is_a_clear_error_naming_the_size(ocr, height, width):
    with pytest.raises(
        RuntimeError,
        match=rf"the rapidocr engine failed on image 0 of {height} × {width} pixels "
        r"\(height × width\): ResizeImgError.*resize_w or resize_h is less than or "
        r"equal to 0.*this thin.*closer to square",
    ):
        ocr(torch.ones(1, 3, height, width), [SIGN])
