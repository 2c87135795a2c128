"""Reward speed on this machine's CPU: seconds per image, printed as a Markdown table (not a test).

    python scripts/bench_rewards.py [--parts ocr] [--images 16] [--repeats 3] [--threads 1 2]

Parts (``PARTS``: name → function): ``ocr`` scores 512×512 images of rendered text (DejaVu Sans, one or two
lines, 18 phrases) with the ``ocr`` reward at each ``--threads`` count (RapidOCR's onnxruntime intra-op
threads). Each setting builds its reward (not timed), scores the batch once to warm up, then ``--repeats``
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

PHRASES = ["Grand Opening", "Hello World", "Open Late", "Sale Today", "Best Dad Ever", "Drive Safe", "Happy 40th",
           "Fresh Coffee", "No Parking", "Welcome Home", "Spring Collection 2024", "Lost City Near",
           "Try Our New Burger",
           "Forever Yours", "Step Goal Achieved", "Blue Moon Cafe", "Exit Only", "Keep Calm"]


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
    lines = [text] if len(text) <= 12 else [text[:len(text) // 2].rstrip(), text[len(text) // 2:].lstrip()]
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

    from rewards import build_reward

    phrases = [PHRASES[i % len(PHRASES)] for i in range(args.images)]
    images = torch.stack([text_image(p, i) for i, p in enumerate(phrases)])
    prompts = [f'a sign that says "{p}"' for p in phrases]
    rows = []
    for threads in args.threads:
        reward = build_reward("ocr", threads=threads)
        meta: dict = {}
        per_image = seconds_per_image(lambda: reward(images, prompts, meta), len(images), args.repeats)
        exact = sum(t.replace(" ", "").lower() == p.replace(" ", "").lower() for t, p in zip(meta["ocr/text"], phrases))
        rows.append(Row("ocr", f"rapidocr, threads={threads}", len(images), per_image,
                        f"{exact}/{len(images)} read exactly, mean score {float(reward(images, prompts).mean()):.3f}"))
    return rows


PARTS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {"ocr": bench_ocr}


def table(rows: list[Row]) -> str:
    lines = ["| reward | setting | images | s/image | images/s | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.part} | {r.setting} | {r.images} | {r.seconds_per_image:.3f} | {1 / r.seconds_per_image:.1f} | "
              f"{r.note} |" for r in rows]
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
