"""The neural GenEval reward end to end on tiny randomly initialised models built from configs (a Mask2Former
detector and an open_clip colour classifier, saved to folders and loaded as a user's would be)."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("scipy")  # transformers' Mask2Former needs it
open_clip = pytest.importorskip("open_clip")

from flowrl_rewards import build_reward  # noqa: E402
from flowrl_rewards.compositional import geneval_rules as rules  # noqa: E402
from flowrl_rewards.compositional.geneval_detector import ClipColors, Mask2FormerDetector, geneval_name, mask_boxes  # noqa: E402

LABELS = [
    "person",
    "dog",
    "cat",
    "car",
    "bench",
    "pizza",
    "mouse",
    "zebra",
]  # "mouse": COCO's, GenEval's "computer mouse"


def save_tiny_detector(folder, labels=LABELS, seed=0):
    """A tiny Mask2Former (Swin backbone) with its image processor, saved with save_pretrained."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    backbone = SwinConfig(
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        image_size=64,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    cfg = Mask2FormerConfig(
        backbone_config=backbone,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
        hidden_dim=32,
        feature_size=32,
        mask_feature_size=32,
        encoder_feedforward_dim=64,
        dim_feedforward=64,
        decoder_layers=2,
        encoder_layers=1,
        num_queries=12,
        num_attention_heads=2,
        use_pretrained_backbone=False,
    )
    torch.manual_seed(seed)
    Mask2FormerForUniversalSegmentation(cfg).save_pretrained(folder)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 128}, size_divisor=32).save_pretrained(folder)
    return folder


def save_tiny_clip(folder):
    cfg = {
        "model_cfg": {
            "embed_dim": 16,
            "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
        },
        "preprocess_cfg": {},
    }
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = open_clip.create_model(f"local-dir:{folder}")
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(folder / "open_clip_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval")
    return {"detector": str(save_tiny_detector(root / "m2f")), "clip": f"local-dir:{save_tiny_clip(root / 'clip')}"}


@pytest.fixture(scope="module")
def reward(tiny):
    # a random detector is unsure of everything: thresholds at 0 so that its detections reach the rules
    return build_reward(
        "geneval",
        detector=tiny["detector"],
        clip_model=tiny["clip"],
        clip_pretrained=None,
        device="cpu",
        confidence=0.0,
        counting_threshold=0.0,
        batch_size=2,
    )


def test_labels_map_to_geneval_names():
    assert geneval_name("mouse") == "computer mouse" and geneval_name("Potted_Plant") == "potted plant"
    assert geneval_name("dog") == "dog"


def test_mask_boxes_are_end_exclusive_extents():
    masks = torch.zeros(2, 10, 12, dtype=torch.bool)
    masks[0, 2:5, 3:9] = True
    assert mask_boxes(masks).tolist() == [[3.0, 2.0, 9.0, 5.0], [0.0, 0.0, 0.0, 0.0]]


def test_detections_from_designed_logits(tiny):
    """Query 0 is a confident dog with a rectangular mask: one dog with that box, score = p × mean mask probability."""
    det = Mask2FormerDetector(tiny["detector"], max_per_image=5)
    c = len(LABELS)
    logits = torch.full((12, c + 1), -20.0)
    logits[:, c] = 20.0  # every other query: no object
    logits[0, LABELS.index("dog")] = 5.0
    logits[0, c] = 5.0 - np.log(9)  # p(dog) = 0.9
    masks = torch.full((12, 16, 16), -10.0)
    masks[0, 4:8, 8:12] = 10.0  # a quarter-resolution mask of the 64×64 input
    found = det._detections(logits, masks, torch.ones(64, 64), (64, 64))
    dogs = sorted(found["dog"], key=lambda f: -f.score)
    assert 0.85 < dogs[0].score < 0.9  # p(dog) × the mean mask probability (< 1 on the upsampled mask's rim)
    x0, y0, x1, y1 = dogs[0].box
    assert (y0, x0) == pytest.approx((16, 32), abs=2) and (y1, x1) == pytest.approx((32, 48), abs=2)
    assert dogs[0].mask.shape == (64, 64) and set(found) <= {
        "dog",
        "person",
        "cat",
        "car",
        "bench",
        "pizza",
        "computer mouse",
        "zebra",
    }
    assert all(f.score < 1e-3 for name, fs in found.items() for f in fs if f is not dogs[0])


def test_colour_classifier_weights_and_crops(tiny):
    model, preprocess, tokenizer = open_clip.create_model_and_transforms(tiny["clip"])[0::2] + (
        open_clip.get_tokenizer(tiny["clip"]),
    )
    colors = ClipColors(model, preprocess, tokenizer, torch.device("cpu"), torch.float32)
    w = colors.classifier("dog")
    assert w.shape == (10, 16) and torch.allclose(w.norm(dim=1), torch.ones(10))
    image = np.zeros((40, 40, 3), dtype=np.uint8)
    image[:, :, 0] = 255
    mask = np.zeros((40, 40), dtype=bool)
    mask[10:20, 10:20] = True
    crop = colors.crops(image, [rules.Found((5, 5, 25, 25), 0.9, mask=mask)])
    from PIL import Image

    expected = np.full((20, 20, 3), 0x99, dtype=np.uint8)
    expected[5:15, 5:15] = (255, 0, 0)  # the object on grey, cropped to its box
    assert torch.equal(crop[0], preprocess(Image.fromarray(expected)))
    picks = colors(image, [rules.Found((5, 5, 25, 25), 0.9, mask=mask)] * 3, "dog")
    assert len(picks) == 3 and len(set(picks)) == 1 and picks[0] in rules.COLORS


def test_reward_end_to_end_agrees_with_the_rules(reward):
    prompts = ["a photo of a dog", "a photo of a red car", "a photo of a cat left of a dog", "a photo of two zebras"]
    images = torch.rand(4, 3, 48, 64, generator=torch.Generator().manual_seed(0))
    meta = {}
    scores = reward(images, prompts, meta)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.equal(scores, torch.as_tensor(meta["geneval/partial"]))
    assert meta["geneval/tag"] == ["single_object", "colors", "position", "counting"]
    # the same verdicts by hand: detector → GenEval's thresholds → colours → rules
    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, (raw, p) in enumerate(zip(reward.detector(arr), prompts)):
        task = reward.tasks(p)
        objects = rules.keep(raw, task.tag, reward.thresholds)
        for cls in task.color_classes & set(objects):
            objects[cls] = [
                rules.Found(f.box, f.score, c) for f, c in zip(objects[cls], reward.colors(arr[i], objects[cls], cls))
            ]
        v = rules.judge(task, objects)
        assert (meta["geneval/strict"][i], meta["geneval/partial"][i]) == (float(v.strict), pytest.approx(v.partial))
    summary = reward.evaluate(images, prompts)
    assert summary["n"] == 4 and set(summary) >= {"accuracy", "overall", "partial", "accuracy/counting", "n/position"}


def test_reward_refuses_bad_settings_and_prompts(tiny, tmp_path):
    kw = dict(detector=tiny["detector"], clip_model=tiny["clip"], clip_pretrained=None, device="cpu")
    with pytest.raises(ValueError, match="score='best'"):
        build_reward("geneval", score="best", **kw)
    with pytest.raises(ValueError, match="confidence=1.5"):
        build_reward("geneval", confidence=1.5, **kw)
    with pytest.raises(RuntimeError, match="cannot load the detector"):
        build_reward("geneval", **{**kw, "detector": str(tmp_path / "nothing")})
    other = save_tiny_detector(tmp_path / "other", labels=["wheel", "door"])
    with pytest.raises(ValueError, match="none of GenEval's classes"):
        build_reward("geneval", **{**kw, "detector": str(other)})
    r = build_reward("geneval", **kw)
    r.check_prompt("a photo of three pizzas")
    with pytest.raises(ValueError, match="not a GenEval prompt"):
        r.check_prompt("a beautiful sunset")


# ---- flowrl eval --benchmark geneval ------------------------------------------------------------------------
BENCH_RECORDS = [
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {
        "tag": "position",
        "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a cat left of a dog",
    },
]


def bench_config(tmp_path, tiny, folder):
    import yaml

    cfg = {
        "model": {"family": "sd3", "path": str(folder), "guidance": 2.0},
        "rollout": {"plan": "ode", "group_size": 2, "steps": 2},
        "rewards": [
            {
                "name": "geneval",
                "kwargs": {
                    "detector": tiny["detector"],
                    "clip_model": tiny["clip"],
                    "clip_pretrained": None,
                    "device": "cpu",
                    "confidence": 0.0,
                    "counting_threshold": 0.0,
                },
            }
        ],
        "loss": {"objective": "nft", "cfg": "guided"},
        "prompts": {"train": "a photo of a dog|a photo of a cat"},
        "eval": {"steps": 2},
        "train": {"progress": False, "num_threads": 1},
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_benchmark_geneval_end_to_end(tmp_path, tiny, capsys):
    from flowrl.commands.main import main
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    config = bench_config(tmp_path, tiny, folder)
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in BENCH_RECORDS))
    out = tmp_path / "bench"
    capsys.readouterr()
    assert (
        main(["eval", "--benchmark", "geneval", "--config", str(config), "--prompts", str(meta), "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "Total images: 12" in printed and "Total prompts: 3" in printed
    assert all(f"{tag:<16} = " in printed for tag in ("single_object", "colors", "position"))
    assert "counting" not in printed and "Overall score (avg. over tasks):" in printed
    # GenEval's layout: a folder per prompt with its metadata and 4 samples, then one result line per image
    assert json.loads((out / "00001" / "metadata.jsonl").read_text()) == BENCH_RECORDS[1]
    assert sorted(p.name for p in (out / "00002" / "samples").iterdir()) == [f"{k:04d}.png" for k in range(4)]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["tag"] for r in rows} == {"single_object", "colors", "position"}
    summary = json.loads((out / "summary.json").read_text())
    per_tag = {
        t: np.mean([r["correct"] for r in rows if r["tag"] == t]) for t in ("single_object", "colors", "position")
    }
    assert summary["overall"] == pytest.approx(np.mean(list(per_tag.values())))
    assert f"Overall score (avg. over tasks): {summary['overall']:.5f}" in printed
    assert summary["images"] == pytest.approx(np.mean([r["correct"] for r in rows])) and summary["n/images"] == 12
    # the images are the eval's: the same seeds draw the same pixels again
    assert (
        main(
            [
                "eval",
                "--benchmark",
                "geneval",
                "--config",
                str(config),
                "--prompts",
                str(meta),
                "--out",
                str(tmp_path / "again"),
                "--images-per-prompt",
                "1",
            ]
        )
        == 0
    )
    from PIL import Image

    first = np.asarray(Image.open(out / "00000" / "samples" / "0000.png"))
    assert np.array_equal(first, np.asarray(Image.open(tmp_path / "again" / "00000" / "samples" / "0000.png")))


def test_benchmark_refuses_prompts_it_cannot_score(tmp_path, tiny, capsys):
    from flowrl.commands.main import main

    config = bench_config(tmp_path, tiny, tmp_path / "no-model-needed")
    bad = tmp_path / "prompts.txt"
    bad.write_text("a photo of a dog\na sunset over the sea\n")
    assert main(["eval", "--benchmark", "geneval", "--config", str(config), "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "prompt 2" in err and "not a GenEval prompt" in err
    assert (
        main(["eval", "--benchmark", "geneval", "--config", str(config), "--prompts", str(tmp_path / "none.jsonl")])
        == 2
    )
    assert "none.jsonl" in capsys.readouterr().err


def test_an_eval_runs_the_detector_once_per_batch(reward, monkeypatch):
    """score then evaluate on the same images object (what the held-out eval does) detect once; new images again."""
    calls = []
    detect = reward.detector.__call__
    monkeypatch.setattr(type(reward.detector), "__call__", lambda self, arr: calls.append(len(arr)) or detect(arr))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    prompts = ["a photo of a dog", "a photo of two cats"]
    meta = {}
    reward(images, prompts, meta)
    summary = reward.evaluate(images, list(prompts))
    assert calls == [2] and summary["accuracy"] == pytest.approx(float(np.mean(meta["geneval/strict"])))
    reward.evaluate(images.clone(), prompts)
    assert calls == [2, 2]


# ---- round four (issue 54): classes the detector knows, whole metadata from a text file ------------------------
def test_a_class_the_detector_does_not_detect_is_refused_at_load(tiny, tmp_path):
    kw = dict(detector=tiny["detector"], clip_model=tiny["clip"], clip_pretrained=None, device="cpu")
    meta = tmp_path / "meta.jsonl"
    meta.write_text(
        json.dumps(
            {"tag": "single_object", "include": [{"class": "giraffe", "count": 1}], "prompt": "a photo of a giraffe"}
        )
        + "\n"
    )
    with pytest.raises(
        ValueError,
        match=r"'a photo of a giraffe' asks for 'giraffe', a class the detector .* does not "
        r"detect \(it detects 8 of GenEval's classes",
    ):
        build_reward("geneval", metadata=str(meta), **kw)
    reward = build_reward("geneval", **kw)
    with pytest.raises(ValueError, match="asks for 'giraffe', a class the detector"):
        reward.check_prompt("a photo of a giraffe")  # a GenEval template, but never detectable here
    reward.check_prompt("a photo of a computer mouse")  # the tiny detector's "mouse", GenEval's name


def test_benchmark_out_from_a_text_file_writes_whole_geneval_metadata(tmp_path, tiny, capsys, monkeypatch):
    from flowrl.commands.main import main
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.rollout import sampling

    def drawn(model, prompts, seeds, steps, guidance, max_batch):
        yield 0, torch.rand(len(prompts), 3, 32, 32, generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(sampling, "ode_batches", drawn)
    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    config = bench_config(tmp_path, tiny, folder)
    text = tmp_path / "prompts.txt"
    prompts = ["a photo of three pizzas", "a photo of a cat left of a dog", "a photo of a red car and a blue bench"]
    text.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "bench"
    assert (
        main(
            [
                "eval",
                "--benchmark",
                "geneval",
                "--config",
                str(config),
                "--prompts",
                str(text),
                "--out",
                str(out),
                "--images-per-prompt",
                "1",
            ]
        )
        == 0
    )
    written = [json.loads((out / f"{i:05d}" / "metadata.jsonl").read_text()) for i in range(3)]
    assert written == [
        {
            "tag": "counting",
            "include": [{"class": "pizza", "count": 3}],
            "exclude": [{"class": "pizza", "count": 4}],
            "prompt": prompts[0],
        },
        {
            "tag": "position",
            "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
            "prompt": prompts[1],
        },
        {
            "tag": "color_attr",
            "include": [{"class": "car", "count": 1, "color": "red"}, {"class": "bench", "count": 1, "color": "blue"}],
            "prompt": prompts[2],
        },
    ]


def test_benchmark_records_name_a_prompt_without_a_task(tiny):
    from flowrl.errors import ConfigError
    from flowrl.training.benchmarks import geneval_records

    reward = build_reward(
        "geneval", detector=tiny["detector"], clip_model=tiny["clip"], clip_pretrained=None, device="cpu"
    )
    with pytest.raises(
        ConfigError,
        match=r"prompt 2 \('a sunset'\): cannot write its GenEval metadata: .*not a "
        r"GenEval prompt",
    ):
        geneval_records(reward, ["a photo of a dog", "a sunset"])
