"""``flowrl export``: a run's (or one checkpoint's) trained weights, sharded or not, in one folder a single GPU
loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowrl.commands.common import OVERRIDES_HELP, Flag
from flowrl.run.model import load_model, run_config

FLAGS: list[Flag] = []


def add_parser(sub, epilog: str) -> None:
    """``flowrl export`` under ``flowrl``'s sub-parsers (``epilog``: unused, it lists config keys)."""
    p = sub.add_parser(
        "export",
        help="consolidate a run's weights (sharded or not) into one folder a single GPU loads",
        description="Write a run's newest (or a given) checkpoint's trained weights whole: a LoRA in the "
        "diffusers format, or a transformer/ folder that from_pretrained reads (docs/gpu.md).",
    )
    p.add_argument("run", help="run folder (runs/<name>) or a checkpoints/step-N folder")
    p.add_argument(
        "--out",
        help="output folder: a new (or empty) one, or an earlier export, which is replaced "
        "(default: <run>/export); a folder it did not write is refused",
    )
    p.add_argument("--config", help="config file (default: the run's config.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def run(args: argparse.Namespace) -> int:
    """Consolidate a run's (or one checkpoint's) trained weights, sharded or not, into one folder that a single
    GPU loads: the LoRA in the diffusers format (``pipe.load_lora_weights``) or ``transformer/`` for
    ``SD3Transformer2DModel.from_pretrained`` and its kin (the EMA's weights where the run kept one). One
    process, on the CPU; written atomically, only where :func:`~flowrl.run.checkpoint.check_export_target` allows."""
    import torch

    from flowrl.run.checkpoint import check_export_target, save_weights, write_export

    cfg, ckpt = run_config(args.run, args.config, args.overrides)
    target = Path(args.out) if args.out is not None else ckpt.parent.parent / "export"
    check_export_target(target, "--out")  # before the model loads: a folder it did not write is refused
    model, _ = load_model(cfg, ckpt, torch.device("cpu"))
    out = write_export(target, lambda f: save_weights(model, f))
    what = (
        "LoRA (pipe.load_lora_weights)"
        if model.has_lora
        else "transformer (from_pretrained(..., subfolder='transformer'))"
    )
    print(f"exported the {what} of {ckpt} to {out}")
    return 0
