"""``flowrl rollouts CONFIG --out FOLDER``: write a rollout store (:mod:`flowrl.rollout.offline_store`) that
``rollout.plan: offline`` replays: K ODE samples of each prompt of ``prompts.train``, as clean latents with their
root seeds and their rewards, sampled once from the config's model (or a run's policy, ``--checkpoint``).

    flowrl rollouts configs/shapes/gdro.yaml --out runs/gdro-store --images-per-prompt 16
    flowrl train configs/shapes/gdro.yaml rollout.source=runs/gdro-store prompts.train=runs/gdro-store/prompts.txt
"""

from __future__ import annotations

import argparse

from flowrl.commands.common import OVERRIDES_HELP, SEED_MAX, Flag
from flowrl.config.bounds import MAX_IMAGES, MAX_STEPS

FLAGS: list[Flag] = [
    ("--images-per-prompt", 2, None, "samples per prompt", MAX_IMAGES),
    ("--num-prompts", 1, None, "prompts stored"),
    ("--steps", 1, None, "ODE steps", MAX_STEPS),
    ("--guidance", 0, None, "CFG scale"),
    ("--seed", 0, SEED_MAX, "sampling seed"),
]


def add_parser(sub, epilog: str) -> None:
    """``flowrl rollouts`` under ``flowrl``'s sub-parsers (``epilog``: unused)."""
    p = sub.add_parser(
        "rollouts",
        help="write a rollout store for offline training (rollout.plan: offline)",
        description="Sample K images of each prompt of prompts.train with the config's model (or a "
        "run's policy), score them with its rewards and write their latents, seeds and "
        "rewards to --out, a new folder (rollout.source of an offline run).",
    )
    p.add_argument("config", help="YAML config file: its model, prompts.train and rewards")
    p.add_argument(
        "--out", required=True, help="the store's folder: new or empty, never an earlier store nor inside a run folder"
    )
    p.add_argument("--checkpoint", help="sample with a run's policy (a run folder or checkpoints/step-N)")
    p.add_argument("--images-per-prompt", type=int, default=16, help="samples per prompt (default 16: GDRO's)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="store this many prompts of prompts.train, a seeded subset in file order (default: all)",
    )
    p.add_argument("--steps", type=int, default=None, help="Euler ODE steps (default: eval.steps)")
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="CFG scale (default: the guidance the config's policy samples with)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: train.seed)")
    p.add_argument("--no-reward", action="store_true", help="store no rewards (NaN): the run scores them anyway")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def store_prompts(prompts: list[str], num: int | None, seed: int) -> list[str]:
    """``num`` of ``prompts`` (all when None or more), chosen by a permutation seeded with ``seed``, in file order."""
    import torch

    from flowrl.core.seeding import derive_seed

    if num is None or num >= len(prompts):
        return list(prompts)
    gen = torch.Generator().manual_seed(derive_seed(seed, "store_prompts"))
    keep = sorted(torch.randperm(len(prompts), generator=gen)[:num].tolist())
    return [prompts[i] for i in keep]


def write_rollouts(
    cfg,
    out: str,
    *,
    checkpoint=None,
    images_per_prompt: int = 16,
    num_prompts: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int | None = None,
    score: bool = True,
    model=None,
    verbose: bool = True,
):
    """The command without its parser: ``cfg`` a loaded TrainConfig, ``checkpoint`` a checkpoint folder (or None),
    ``model`` a ready model (None: built from ``cfg`` with ``checkpoint``'s weights). Returns the store's path."""
    from flowrl.config import build
    from flowrl.prompts.source import read_prompts
    from flowrl.rollout.offline_store import COMMAND
    from flowrl.run.model import load_model
    from flowrl.run.outputs import check_output
    from flowrl.run.rollout_store import write_store
    from flowrl.training.evaluation import resolve_guidance

    check_output(out, COMMAND, mode="new")  # before any model time: refuses, naming the path
    seed = cfg.train.seed if seed is None else seed
    prompts = store_prompts(read_prompts(cfg.prompts.train, "prompts.train"), num_prompts, seed)
    reward = build.build_rewards(cfg.rewards, cfg.reward_normalize) if score else None
    if reward is not None:
        reward.check_ready()
    trained_at = None
    if model is None:
        model, trained_at = load_model(cfg, checkpoint)
    policy = build.build_loss(cfg).describe().rollout_guidance(cfg.model.guidance)
    guidance = resolve_guidance(model.guidance, guidance, trained_at, policy)
    steps = cfg.eval.steps if steps is None else steps

    def progress(done: int, total: int) -> None:
        if verbose:
            print(f"  {done}/{total} prompts sampled", flush=True)

    path = write_store(
        out,
        model,
        prompts,
        reward,
        images_per_prompt=images_per_prompt,
        steps=steps,
        guidance=guidance,
        seed=seed,
        max_batch=cfg.rollout.max_batch,
        model_info={"family": cfg.model.family, "path": cfg.model.path},
        checkpoint=None if checkpoint is None else str(checkpoint),
        progress=progress,
    )
    if verbose:
        print(
            f"wrote {len(prompts)} prompts × {images_per_prompt} samples ({steps} steps, guidance {guidance:g}) to "
            f"{path}; train with rollout.plan=offline rollout.source={path} prompts.train={path}/prompts.txt"
        )
    return path


def run(args: argparse.Namespace) -> int:
    from flowrl.run.model import run_config

    cfg, ckpt = run_config(args.checkpoint, args.config, args.overrides)
    write_rollouts(
        cfg,
        args.out,
        checkpoint=ckpt,
        images_per_prompt=args.images_per_prompt,
        num_prompts=args.num_prompts,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        score=not args.no_reward,
    )
    return 0
