#!/usr/bin/env python
"""What ``train.fit: auto`` chooses for each GPU preset on each GPU class, against the shipped settings: a Markdown
table (docs/gpu.md, "Settings train.fit chooses"), from the estimate alone (meta device, no GPU, no weights).

    python scripts/fit_table.py [--gpus H100 H200 A100 L40S 4090] [--presets configs/...yaml ...] [--out table.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRESETS = [
    "configs/sd35/flow_grpo_pickscore.yaml",
    "configs/sd35/nft_geneval.yaml",
    "configs/flux/nft_pickscore.yaml",
    "configs/flux/dance_grpo_hps.yaml",
    "configs/sana/solrl.yaml",
    "configs/qwen_image/nft_geneval.yaml",
    "configs/wan/flow_grpo_1_3b.yaml",
]


def settings_text(settings: dict, blocks: int) -> str:
    """``rollout/update rows · checkpointed blocks · offload`` of a settings dict (:func:`settings_of`)."""
    update = settings["train.micro_batch"] or settings["rollout.max_batch"]
    checkpointed = (
        0
        if not settings["model.gradient_checkpointing"]
        else settings["model.checkpoint_blocks"]
        if settings["model.checkpoint_blocks"] is not None
        else blocks
    )
    return f"{settings['rollout.max_batch']}/{update}, ckpt {checkpointed}/{blocks}" + (
        ", offload" if settings["model.offload_encoders"] else ""
    )


def row(preset: str, gpu: str) -> str:
    from flowrl.errors import ConfigError
    from flowrl.estimate import estimate, load_config
    from flowrl.estimate.fit import fit_config, settings_of

    try:
        cfg = load_config(preset, [], gpu)
    except ConfigError as e:  # e.g. an fp8 explorer on a GPU without fp8
        return f"| `{preset}` | {gpu} | not on this GPU: {e} | | | | | |"
    shipped = estimate(cfg, gpu=gpu)
    blocks = shipped["shapes"]["blocks"]
    lo, hi = shipped["time"]["seconds_per_iteration"]
    before = (
        f"{settings_text(settings_of(cfg), blocks)} | {shipped['memory_gib']['peak']:.1f}"
        + ("" if shipped["memory_gib"]["fits"] else " (does not fit)")
        + f" | {lo:.0f}–{hi:.0f}"
    )
    try:
        fit = fit_config(cfg, gpu)
    except ConfigError as e:
        remedies = str(e).split("remedy: ", 1)[-1].split(". (", 1)[0]
        return f"| `{preset}` | {gpu} | {before} | refused: {remedies} | | |"
    flo, fhi = fit.seconds_per_iteration
    return (
        f"| `{preset}` | {gpu} | {before} | {settings_text(fit.settings, blocks)} | {fit.peak_gib:.1f} of "
        f"{fit.budget_gib:.1f} | {flo:.0f}–{fhi:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", nargs="+", default=["H100", "H200", "A100", "L40S", "4090"])
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    lines = [
        "| preset | GPU | shipped: rows rollout/update, checkpointed blocks | peak GiB | s/iteration "
        "| `train.fit: auto` | peak GiB of the budget | s/iteration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    t0 = time.monotonic()
    for preset in args.presets:
        for gpu in args.gpus:
            lines.append(row(preset, gpu))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(f"\n{text}\n\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
