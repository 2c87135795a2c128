"""``flowrl sample``: images of a run's (or a config's base) model, each batch written as soon as it is drawn under
names made by :mod:`flowrl.run.filenames`, and ``grid.png`` with each image's prompt (and with ``--reward`` its
score, also in ``scores.json``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowrl.commands.common import OVERRIDES_HELP, SEED_MAX, Flag
from flowrl.config.bounds import MAX_IMAGES, MAX_STEPS
from flowrl.errors import ConfigError, shown
from flowrl.run.model import model_from_run

FLAGS: list[Flag] = [
    ("--num", 1, None, "images per prompt", MAX_IMAGES),
    ("--steps", 1, None, "ODE steps", MAX_STEPS),
    ("--guidance", 0, None, "CFG scale"),
    ("--seed", 0, SEED_MAX, "seed of the first image"),
    ("--scale", 1, 64, "upscaling of grid.png"),
]


def add_parser(sub, epilog: str) -> None:
    """``flowrl sample`` under ``flowrl``'s sub-parsers (``epilog``: unused, it lists config keys)."""
    p = sub.add_parser(
        "sample",
        help="generate PNGs with a trained run (or a config's base model)",
        description="Generate images with ODE sampling from a run folder's newest checkpoint; grid.png "
        "shows each with its prompt (and with --reward, its score).",
    )
    p.add_argument("--checkpoint", help="run folder (runs/<name>) or a checkpoints/step-N folder")
    p.add_argument("--config", help="config file (default: the run's config.yaml, else the shapes preset)")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeat for several)")
    p.add_argument("--num", type=int, default=4, help="images per prompt (default 4)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: eval.steps)")
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="CFG scale (default: eval.guidance, else the guidance the checkpoint's policy was trained for)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the first image; image i uses seed+i")
    p.add_argument(
        "--out",
        default="samples",
        help="output folder (default ./samples): made, or added to without "
        "replacing a file; never . nor anything inside a run folder",
    )
    p.add_argument("--scale", type=int, default=4, help="upscaling of grid.png (default 4)")
    p.add_argument(
        "--reward",
        metavar="NAME",
        help="score each image with this reward (a registry name, "
        "package.module:Class or path/to/file.py:Class): its mark on grid.png (PASS/FAIL for a 0/1 reward, "
        "else the score) and every score in scores.json",
    )
    p.add_argument(
        "--reward-kwargs",
        metavar="JSON",
        help='keyword arguments of --reward, a JSON object, e.g. \'{"mode": "strict"}\'',
    )
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def _sample_reward(args: argparse.Namespace, prompts: list[str]):
    """``--reward`` (with ``--reward-kwargs``) built, ready and able to score every ``--prompt`` (a MultiReward of one
    term), or None without it; else a ConfigError naming the flag, the value (or the prompt) and what is accepted.
    Runs before the model loads: a refusal costs no model time."""
    import json

    from flowrl.errors import shown_message
    from flowrl_rewards import MultiReward

    name, raw = getattr(args, "reward", None), getattr(args, "reward_kwargs", None)
    if name is None:
        if raw is not None:
            raise ConfigError(f"--reward-kwargs={shown(raw)} needs --reward NAME (the reward they are for)")
        return None
    try:
        kwargs = json.loads(raw) if raw is not None else {}
    except json.JSONDecodeError:
        kwargs = None  # refused below with what is accepted
    if not isinstance(kwargs, dict):
        raise ConfigError(f'--reward-kwargs={shown(raw)} is not a JSON object; accepted: e.g. \'{{"mode": "strict"}}\'')
    try:
        reward = MultiReward([{"name": name, "kwargs": kwargs}])
    except (KeyError, ImportError, AttributeError, TypeError, ValueError, FileNotFoundError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(f"--reward={shown(name)}: {shown_message(str(text))}") from None
    from flowrl.models.image_prompts import split_image_prompt

    for prompt in prompts:
        try:
            reward.check_prompt(split_image_prompt(prompt)[0])
        except ValueError as e:
            raise ConfigError(
                f"--prompt {shown(prompt, 80)} cannot be scored by --reward={shown(name)}: {shown_message(str(e))}"
            ) from None
    reward.check_ready()  # e.g. a remote reward's server answers
    return reward


def _write_scores(
    path: Path,
    args: argparse.Namespace,
    files: list[Path],
    prompts: list[str],
    seeds: list[int],
    scores,
    guidance: float,
) -> None:
    """``scores.json``: the reward, its kwargs and mean, and every image's file, prompt, seed and score (null where
    the reward gave NaN)."""
    import json
    import math

    values = [float(v) for v in scores]
    finite = [v for v in values if math.isfinite(v)]
    path.write_text(
        json.dumps(
            {
                "reward": args.reward,
                "kwargs": json.loads(args.reward_kwargs) if args.reward_kwargs else {},
                "guidance": guidance,
                "mean": sum(finite) / len(finite) if finite else None,
                "images": [
                    {"file": f.name, "prompt": p, "seed": s, "score": v if math.isfinite(v) else None}
                    for f, p, s, v in zip(files, prompts, seeds, values)
                ],
            },
            indent=2,
        )
    )


def _guidance_source(args: argparse.Namespace, cfg, trained_at: float | None, guidance: float) -> str:
    """The setting the sampling guidance came from, as a user would change it: ``--guidance=G``, ``eval.guidance=G``,
    the checkpoint's or the model's."""
    if args.guidance is not None:
        return f"--guidance={guidance:g}"
    if cfg.eval.guidance is not None:
        return f"eval.guidance={guidance:g}"
    return (
        f"guidance {guidance:g} ({'the checkpoint policy' if trained_at is not None else 'the model'}'s; set "
        "--guidance)"
    )


def _check_finite(images, start: int, prompts: list[str], seeds: list[int], steps: int, source: str) -> None:
    """Every pixel of a drawn batch is finite (one pass over the batch); else a FloatingPointError naming the
    setting that produced it, the prompt and the seed, before anything of the batch is written."""
    import torch

    bad = (~torch.isfinite(images.flatten(1))).any(1)
    if bool(bad.any()):
        i = start + int(bad.nonzero()[0])
        raise FloatingPointError(
            f"{source} drew a non-finite image (NaN or ±inf pixels) of prompt {shown(prompts[i], 80)}, "
            f"seed {seeds[i]}, {steps} steps; it was not written (nor the rest of its batch). "
            "Accepted: a guidance the model samples with (a CFG scale of about 1-10)"
        )


def run(args: argparse.Namespace) -> int:
    """ODE-sample ``--num`` images of every ``--prompt``; each batch is written as soon as it is drawn (a failure
    loses only what was not drawn yet), under names made from the prompt and never outside ``--out``; then
    ``grid.png`` (a GIF for videos) with each image's prompt and, with ``--reward``, its score (also in
    ``scores.json``)."""
    import torch

    from flowrl.commands.common import check_memory, image_bytes
    from flowrl.models.image_prompts import prompt_label
    from flowrl.prompts.checks import check_prompt_fits
    from flowrl.rollout.sampling import ode_batches
    from flowrl.run.filenames import FileNamer
    from flowrl.run.outputs import check_output
    from flowrl.training.evaluation import resolve_guidance
    from flowrl.training.grids import grid_scores, save_labelled_grid, save_sample
    from flowrl.training.scoring import check_modality

    reward = _sample_reward(args, args.prompt)  # before the model loads
    output = check_output(args.out, "flowrl sample", mode="adds")  # adds files, never replaces one
    cfg, model, trained_at = model_from_run(args.checkpoint, args.config, args.overrides)
    model.resize(cfg.eval.height, cfg.eval.width)  # eval.height/eval.width: sampled at the eval's size
    for prompt in args.prompt:  # an editing model's prompts carry their image; a text model's do not
        check_prompt_fits(
            prompt,
            f"--prompt {shown(prompt, 80)}",
            edits=model.takes_source_image,
            family=model.family or cfg.model.family,
        )
    if reward is not None:
        check_modality(model, [("--reward", reward)])
    prompts = [p for p in args.prompt for _ in range(args.num)]
    seeds = [args.seed + i for i in range(len(prompts))]
    guidance = resolve_guidance(model.guidance, args.guidance, cfg.eval.guidance, trained_at)
    steps = args.steps if args.steps is not None else cfg.eval.steps
    check_memory("--num", args.num, len(prompts) * image_bytes(model), f"{len(prompts):,} images kept for the grid")
    out = output.make()
    names = FileNamer(out)  # every name made (and checked inside --out) before any model time is spent
    video = model.modality == "video"  # a video family: animated GIFs
    suffix = ".gif" if video else ".png"
    paths = [names.path(f"{i:03d}", prompt_label(prompt), suffix) for i, prompt in enumerate(prompts)]
    grid_path = names.path("", "grid", suffix)
    scores_path = names.path("", "scores", ".json") if reward is not None else None
    images = []
    for start, drawn in ode_batches(model, prompts, seeds, steps, guidance, cfg.rollout.max_batch):
        _check_finite(drawn, start, prompts, seeds, steps, _guidance_source(args, cfg, trained_at, guidance))
        for path, img in zip(paths[start : start + len(drawn)], drawn):
            save_sample(img, path)
        images.append(drawn)
    images = torch.cat(images)
    scores = grid_scores(images, prompts, reward) if reward is not None else None
    ncol = args.num if 1 < args.num <= 8 else min(4, len(prompts))  # a row per prompt when it fits
    grid_path = save_labelled_grid(images, prompts, None, grid_path, ncol=ncol, scale=args.scale, scores=scores)
    written = [grid_path.name]
    if scores_path is not None:
        _write_scores(scores_path, args, paths, prompts, seeds, scores, guidance)
        written.append(scores_path.name)
    what = "videos" if video else "images"
    scored = "" if scores is None else f"; --reward {args.reward}: mean {float(scores.nanmean()):.4f}"
    print(f"wrote {len(prompts)} {what}, {' and '.join(written)} to {out} (guidance {guidance:g}{scored})")
    return 0
