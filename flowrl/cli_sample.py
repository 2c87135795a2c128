"""``flowrl sample`` (each batch of images written as soon as it is drawn, under names made by
:mod:`flowrl.filenames`) and the range checks of every numeric command-line flag."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from flowrl.config import DEFAULT_CONFIG, TrainConfig
from flowrl.errors import ConfigError

SEED_MAX = 2 ** 62  # seeds go to torch.Generator.manual_seed (and seed + i must stay below 2**64)

# command → (flag, least, most (None: no bound), what it is); a flag left at None (its default) is not checked
FLAG_RANGES: dict[str, list[tuple[str, float, float | None, str]]] = {
    "sample": [("--num", 1, None, "images per prompt"), ("--steps", 1, None, "ODE steps"),
               ("--guidance", 0, None, "CFG scale"), ("--seed", 0, SEED_MAX, "seed of the first image"),
               ("--scale", 1, 64, "upscaling of grid.png")],
    "bench": [("--iterations", 1, None, "timed iterations"), ("--warmup", 0, None, "untimed iterations first"),
              ("--processes", 1, None, "processes sharing prompts.per_step")],
    "snr": [("--batches", 3, None, "independent iterations (the error of the signal drops one at a time)")],
    "compare": [("--seeds", 0, SEED_MAX, "training seeds"), ("--parallel", 1, None, "runs at once"),
                ("--threads", 1, None, "torch threads per run")],
}


def check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag of ``args.command`` within its range (:data:`FLAG_RANGES`); else a ConfigError naming
    the flag, the value and what is accepted."""
    for flag, low, high, what in FLAG_RANGES.get(args.command, []):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            bad = not math.isfinite(v) or v < low or (high is not None and v > high)
            if bad:
                accepted = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
                raise ConfigError(f"{flag}={v!r} must be {accepted} ({what})")
    if args.command == "compare" and len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, args.seeds))} names a seed twice; each seed is one run per config")


# ---- shared: a model with a run's trained weights ----------------------------------------------
def _model_from_run(run: str | None, config: str | None, overrides: list[str]):
    """(config, model, policy guidance) for a run folder or checkpoint (its config.yaml, newest weights and
    the guidance its policy was trained to sample with, None for a checkpoint that does not record it), or
    for a config (guidance None)."""
    from flowrl import build
    from flowrl.checkpoint import find_checkpoint, load_weights, read_state

    ckpt = None
    if run is not None:
        ckpt, run_dir = find_checkpoint(run)
        config = config or str(run_dir / "config.yaml")
    cfg = TrainConfig.from_yaml(config or DEFAULT_CONFIG, overrides)
    model = build.build_model(cfg.model)
    guidance = None
    if ckpt is not None:
        if not cfg.model.full_finetune:
            build.add_lora(model, cfg.model)
        load_weights(model, ckpt)
        guidance = read_state(ckpt).get("policy_guidance")
    return cfg, model, guidance


def _first_set(*values):
    return next((v for v in values if v is not None), None)


def cmd_sample(args: argparse.Namespace) -> int:
    """ODE-sample ``--num`` images of every ``--prompt``; each batch is written as soon as it is drawn (a failure
    loses only what was not drawn yet), under names made from the prompt and never outside ``--out``."""
    import torch
    from PIL import Image

    from flowrl.evaluation import save_grid
    from flowrl.filenames import FileNamer
    from flowrl.rollout.sampling import ode_sample

    cfg, model, trained_at = _model_from_run(args.checkpoint, args.config, args.overrides)
    prompts = [p for p in args.prompt for _ in range(args.num)]
    seeds = [args.seed + i for i in range(len(prompts))]
    guidance = _first_set(args.guidance, cfg.eval.guidance, trained_at, model.guidance)
    steps = args.steps if args.steps is not None else cfg.eval.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = FileNamer(out)  # every name made (and checked inside --out) before any model time is spent
    paths = [names.path(f"{i:03d}", prompt, ".png") for i, prompt in enumerate(prompts)]
    grid_path = names.path("", "grid", ".png")
    batch = max(1, cfg.eval.batch_size)
    images = []
    for start in range(0, len(prompts), batch):
        drawn = ode_sample(model, prompts[start:start + batch], seeds[start:start + batch], steps, guidance, batch)
        for path, img in zip(paths[start:start + batch], drawn):
            Image.fromarray((img.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(path)
        images.append(drawn)
    save_grid(torch.cat(images), grid_path, scale=args.scale)
    print(f"wrote {len(prompts)} images and {grid_path.name} to {out} (guidance {guidance:g})")
    return 0
