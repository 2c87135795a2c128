"""``flowrl sample`` (each batch of images written as soon as it is drawn, under names made by
:mod:`flowrl.filenames`), ``flowrl eval`` (the trainer's held-out eval of a run or base model) and the range
checks of every numeric command-line flag."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from flowrl.errors import ConfigError, shown
from flowrl.run_model import load_model, model_from_run, run_config

SEED_MAX = 2 ** 62  # seeds go to torch.Generator.manual_seed (and seed + i must stay below 2**64)

# command → (flag, least, most (None: no bound), what it is); a flag left at None (its default) is not checked
FLAG_RANGES: dict[str, list[tuple[str, float, float | None, str]]] = {
    "sample": [("--num", 1, None, "images per prompt"), ("--steps", 1, None, "ODE steps"),
               ("--guidance", 0, None, "CFG scale"), ("--seed", 0, SEED_MAX, "seed of the first image"),
               ("--scale", 1, 64, "upscaling of grid.png")],
    "bench": [("--iterations", 1, None, "timed iterations"), ("--warmup", 0, None, "untimed iterations first"),
              ("--processes", 1, None, "processes sharing prompts.per_step")],
    "snr": [("--batches", 3, None, "independent iterations (the error of the signal drops one at a time)")],
    "eval": [("--images-per-prompt", 1, 64, "images per benchmark prompt")],
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


def cmd_export(args: argparse.Namespace) -> int:
    """Consolidate a run's (or one checkpoint's) trained weights, sharded or not, into one folder that a single
    GPU loads: the LoRA in the diffusers format (``pipe.load_lora_weights``) or ``transformer/`` for
    ``SD3Transformer2DModel.from_pretrained`` and its kin (the EMA's weights where the run kept one). One
    process, on the CPU; written atomically."""
    import torch

    from flowrl.checkpoint import save_weights, write_export

    cfg, ckpt = run_config(args.run, args.config, args.overrides)
    model, _ = load_model(cfg, ckpt, torch.device("cpu"))
    out = write_export(Path(args.out) if args.out else ckpt.parent.parent / "export", lambda f: save_weights(model, f))
    what = "LoRA (pipe.load_lora_weights)" if model.has_lora else "transformer (from_pretrained(..., subfolder='transformer'))"
    print(f"exported the {what} of {ckpt} to {out}")
    return 0


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
        raise ConfigError(f"--reward-kwargs={shown(raw)} is not a JSON object; accepted: e.g. '{{\"mode\": \"strict\"}}'")
    try:
        reward = MultiReward([{"name": name, "kwargs": kwargs}])
    except (KeyError, ImportError, AttributeError, TypeError, ValueError, FileNotFoundError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(f"--reward={shown(name)}: {shown_message(str(text))}") from None
    from flowrl.image_prompts import split_image_prompt

    for prompt in prompts:
        try:
            reward.check_prompt(split_image_prompt(prompt)[0])
        except ValueError as e:
            raise ConfigError(f"--prompt {shown(prompt, 80)} cannot be scored by --reward={shown(name)}: "
                              f"{shown_message(str(e))}") from None
    reward.check_ready()  # e.g. a remote reward's server answers
    return reward


def _write_scores(path: Path, args: argparse.Namespace, files: list[Path], prompts: list[str], seeds: list[int],
                  scores, guidance: float) -> None:
    """``scores.json``: the reward, its kwargs and mean, and every image's file, prompt, seed and score (null where
    the reward gave NaN)."""
    import json
    import math

    values = [float(v) for v in scores]
    finite = [v for v in values if math.isfinite(v)]
    path.write_text(json.dumps({
        "reward": args.reward, "kwargs": json.loads(args.reward_kwargs) if args.reward_kwargs else {},
        "guidance": guidance, "mean": sum(finite) / len(finite) if finite else None,
        "images": [{"file": f.name, "prompt": p, "seed": s, "score": v if math.isfinite(v) else None}
                   for f, p, s, v in zip(files, prompts, seeds, values)]}, indent=2))


def cmd_sample(args: argparse.Namespace) -> int:
    """ODE-sample ``--num`` images of every ``--prompt``; each batch is written as soon as it is drawn (a failure
    loses only what was not drawn yet), under names made from the prompt and never outside ``--out``; then
    ``grid.png`` (a GIF for videos) with each image's prompt and, with ``--reward``, its score (also in
    ``scores.json``)."""
    import torch

    from flowrl.evaluation import resolve_guidance
    from flowrl.filenames import FileNamer
    from flowrl.grids import grid_scores, save_labelled_grid, save_sample
    from flowrl.image_prompts import prompt_label
    from flowrl.prompt_checks import check_prompt_fits
    from flowrl.rollout.sampling import ode_sample
    from flowrl.scoring import check_modality, model_modality

    reward = _sample_reward(args, args.prompt)  # before the model loads
    cfg, model, trained_at = model_from_run(args.checkpoint, args.config, args.overrides)
    for prompt in args.prompt:  # an editing model's prompts carry their image; a text model's do not
        check_prompt_fits(prompt, f"--prompt {shown(prompt, 80)}", edits=model.takes_source_image,
                          family=getattr(model, "family", cfg.model.family))
    if reward is not None:
        check_modality(model, [("--reward", reward)])
    prompts = [p for p in args.prompt for _ in range(args.num)]
    seeds = [args.seed + i for i in range(len(prompts))]
    guidance = resolve_guidance(model.guidance, args.guidance, cfg.eval.guidance, trained_at)
    steps = args.steps if args.steps is not None else cfg.eval.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = FileNamer(out)  # every name made (and checked inside --out) before any model time is spent
    video = model_modality(model) == "video"  # a video family: animated GIFs
    suffix = ".gif" if video else ".png"
    paths = [names.path(f"{i:03d}", prompt_label(prompt), suffix) for i, prompt in enumerate(prompts)]
    grid_path = names.path("", "grid", suffix)
    scores_path = names.path("", "scores", ".json") if reward is not None else None
    batch = max(1, cfg.eval.batch_size)
    images = []
    for start in range(0, len(prompts), batch):
        drawn = ode_sample(model, prompts[start:start + batch], seeds[start:start + batch], steps, guidance, batch)
        for path, img in zip(paths[start:start + batch], drawn):
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


def cmd_eval(args: argparse.Namespace) -> int:
    """The run's held-out eval (:class:`~flowrl.evaluation.HeldOutEval`, the trainer's: the same seeds, passes
    and reductions) of a run's newest weights or a config's base model, at ``eval.guidance``, else the
    guidance the checkpoint's policy was trained for; under ``accelerate launch`` each process draws its
    share of the prompts. The main process prints the metrics and writes ``--out``."""
    if args.benchmark:  # a benchmark by its own protocol (flowrl/benchmark.py)
        from flowrl.benchmark import cmd_benchmark

        return cmd_benchmark(args)
    import json

    from accelerate import Accelerator

    from flowrl import build
    from flowrl.evaluation import HeldOutEval
    from flowrl.grids import save_grid
    from flowrl.process_group import ProcessGroup
    from flowrl.prompts import read_prompts

    cfg, ckpt = run_config(args.checkpoint, args.config, args.overrides)
    if not cfg.prompts.eval:
        raise ConfigError("prompts.eval is null (the run was trained without held-out prompts); name them: "
                          "flowrl eval ... prompts.eval=configs/shapes/prompts/eval.txt (a file, or 'a|b|c')")
    prompts = read_prompts(cfg.prompts.eval, "prompts.eval")[: cfg.eval.num_prompts or None]
    reward = build.build_rewards(cfg.eval.rewards or cfg.rewards)
    group = ProcessGroup(Accelerator(cpu=build.resolve_device(cfg.model.device).type == "cpu"))
    model, trained_at = load_model(cfg, ckpt, group.accelerator.device)
    held_out = HeldOutEval(cfg.eval, model, prompts, reward, group, None, trained_at, progress=cfg.train.progress)
    metrics, grids = held_out.run()
    metrics["num_prompts"] = len(prompts)
    if group.is_main:
        print(json.dumps(metrics, indent=2))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "eval.json").write_text(json.dumps(metrics, indent=2))
            if grids.get("eval") is not None and grids["eval"].numel():
                save_grid(grids["eval"], Path(args.out) / "grid.png", scale=4)
    group.close()
    return 0
