"""Reward speed on this machine's CPU: seconds per image, printed as a Markdown table (not a test).

    python scripts/bench_rewards.py [--parts ocr] [--images 16] [--repeats 3] [--threads 1 2]

Parts (``PARTS``: name → function): ``ocr`` scores 512×512 images of rendered text (DejaVu Sans, one or two
lines, 18 phrases) with the ``ocr`` reward at each ``--threads`` count (RapidOCR's onnxruntime intra-op
threads); ``geneval`` times the GenEval reward's detector (full-size Mask2Former Swin-S, random weights) per
image and its CLIP ViT-L/14 colour classifier per object, at each ``--threads`` count (torch threads). Each setting
builds its reward (not timed), scores the batch once to warm up, then ``--repeats``
times; the row gives the median time per image. To add a reward, write ``bench_<name>(args) -> list[Row]``
and add it to ``PARTS``; ``--parts`` picks which run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PHRASES = [
    "Grand Opening",
    "Hello World",
    "Open Late",
    "Sale Today",
    "Best Dad Ever",
    "Drive Safe",
    "Happy 40th",
    "Fresh Coffee",
    "No Parking",
    "Welcome Home",
    "Spring Collection 2024",
    "Lost City Near",
    "Try Our New Burger",
    "Forever Yours",
    "Step Goal Achieved",
    "Blue Moon Cafe",
    "Exit Only",
    "Keep Calm",
]


class Row(NamedTuple):
    part: str
    setting: str
    images: int
    seconds_per_image: float
    note: str = ""


def text_image(text: str, index: int, size: int = 512):
    """``text`` drawn on a light background, wrapped to two lines when long: an image [3, size, size] in [0, 1]."""
    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (235 - 7 * (index % 5), 230, 220))
    lines = [text] if len(text) <= 12 else [text[: len(text) // 2].rstrip(), text[len(text) // 2 :].lstrip()]
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        y = size // 2 + (i - (len(lines) - 1) / 2) * 64 + (index % 3 - 1) * 40
        draw.text((size // 2, y), line, fill=(20, 20, 40), font=dejavu(40 + 4 * (index % 4)), anchor="mm")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def dejavu(size: int):
    """DejaVu Sans: the system's, else the copy matplotlib ships."""
    from PIL import ImageFont

    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        import matplotlib

        return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), size)


def seconds_per_image(score: Callable[[], object], n: int, repeats: int) -> float:
    """Median over ``repeats`` timed calls of ``score`` (after one warm-up call), divided by ``n`` images."""
    score()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        score()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n


def bench_ocr(args: argparse.Namespace) -> list[Row]:
    """The ``ocr`` reward (RapidOCR) on ``args.images`` 512×512 text images, at each thread count."""
    import torch

    from flowrl_rewards import build_reward

    phrases = [PHRASES[i % len(PHRASES)] for i in range(args.images)]
    images = torch.stack([text_image(p, i) for i, p in enumerate(phrases)])
    prompts = [f'a sign that says "{p}"' for p in phrases]
    rows = []
    for threads in args.threads:
        reward = build_reward("ocr", threads=threads)
        meta: dict = {}
        per_image = seconds_per_image(lambda: reward(images, prompts, meta), len(images), args.repeats)
        exact = sum(t.replace(" ", "").lower() == p.replace(" ", "").lower() for t, p in zip(meta["ocr/text"], phrases))
        rows.append(
            Row(
                "ocr",
                f"rapidocr, threads={threads}",
                len(images),
                per_image,
                f"{exact}/{len(images)} read exactly, mean score {float(reward(images, prompts).mean()):.3f}",
            )
        )
    return rows


def save_mask2former_swin_small(folder: Path, shortest_edge: int) -> Path:
    """GenEval's detector architecture at full size with random weights (Mask2Former, Swin-S backbone: embed 96,
    depths 2-2-18-2, window 7; 100 queries, 6 encoder and 10 decoder layers; the 80 COCO classes), saved with an image
    processor resizing the shorter side to ``shortest_edge`` (no hub: the time depends only on the shapes)."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    from flowrl_rewards.compositional.geneval_prompts import COCO_CLASSES

    backbone = SwinConfig(
        embed_dim=96,
        depths=[2, 2, 18, 2],
        num_heads=[3, 6, 12, 24],
        window_size=7,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    labels = dict(enumerate(COCO_CLASSES))
    config = Mask2FormerConfig(
        backbone_config=backbone,
        num_labels=80,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        use_pretrained_backbone=False,
    )
    Mask2FormerForUniversalSegmentation(config).save_pretrained(folder)
    Mask2FormerImageProcessor(
        size={"shortest_edge": shortest_edge, "longest_edge": 1333}, size_divisor=32
    ).save_pretrained(folder)
    return folder


def bench_geneval(args: argparse.Namespace) -> list[Row]:
    """The ``geneval`` reward's two models at full size (random weights) on ``args.images`` 512×512 images: the
    detector alone at the transformers checkpoint's resize (shorter side 384) and at mmdetection's (800), then the
    CLIP ViT-L/14 colour classification per object crop, at each thread count."""
    import tempfile

    import numpy as np
    import torch

    from flowrl_rewards import build_reward
    from flowrl_rewards.compositional import geneval_rules as rules

    images = torch.rand(args.images, 3, 512, 512, generator=torch.Generator().manual_seed(0))
    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for edge in (384, 800):
            folder = save_mask2former_swin_small(Path(tmp) / f"m2f-{edge}", edge)
            reward = build_reward(
                "geneval",
                detector=str(folder),
                clip_model="ViT-L-14",
                clip_pretrained=None,
                device="cpu",
                dtype="fp32",
                batch_size=4,
            )
            for threads in args.threads:
                torch.set_num_threads(threads)
                rows.append(
                    Row(
                        "geneval",
                        f"detector, shorter side {edge}, threads={threads}",
                        len(images),
                        seconds_per_image(lambda: reward.detector(arr), len(images), args.repeats),
                        "Mask2Former Swin-S, 80 classes, 100 queries",
                    )
                )
        crops = [rules.Found((64.0 + i, 64.0, 320.0, 320.0 + i), 0.9, mask=np.ones((512, 512), bool)) for i in range(8)]
        for threads in args.threads:
            torch.set_num_threads(threads)
            rows.append(
                Row(
                    "geneval",
                    f"colour of one object, threads={threads}",
                    len(crops),
                    seconds_per_image(lambda: reward.colors(arr[0], crops, "car"), len(crops), args.repeats),
                    "CLIP ViT-L/14 on the masked crop; a GenEval image has 0-2 colour clauses",
                )
            )
    torch.set_num_threads(1)
    return rows


PARTS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {"ocr": bench_ocr, "geneval": bench_geneval}


def table(rows: list[Row]) -> str:
    lines = ["| reward | setting | images | s/image | images/s | note |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.part} | {r.setting} | {r.images} | {r.seconds_per_image:.3f} | {1 / r.seconds_per_image:.1f} | "
        f"{r.note} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="which rewards to time")
    parser.add_argument("--images", type=int, default=16, help="images per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per setting (the median is reported)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="CPU threads of the reward")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the image conversion only: the rewards' own threads are the setting measured
    rows = [row for part in args.parts for row in PARTS[part](args)]
    print(f"{os.cpu_count()} CPU cores; python {sys.version.split()[0]}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
