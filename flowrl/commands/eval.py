"""``flowrl eval``: the trainer's held-out eval of a run's newest weights or a config's base model, or with
``--benchmark`` a benchmark by its own protocol (:mod:`flowrl.training.benchmarks`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowrl.commands.common import OVERRIDES_HELP, Flag
from flowrl.errors import ConfigError
from flowrl.run.model import load_model, run_config
from flowrl.run.outputs import check_output

EVAL_FAILED = 3  # the exit status of an eval whose reward failed (or was not finite) for every image

FLAGS: list[Flag] = [("--images-per-prompt", 1, 64, "images per benchmark prompt")]


def add_parser(sub, epilog: str) -> None:
    """``flowrl eval`` under ``flowrl``'s sub-parsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "eval",
        help="evaluate a run or base model on the held-out prompts",
        description="ODE-sample the eval prompts (prompts.eval) and score them with eval.rewards.",
        epilog=epilog,
        formatter_class=fmt,
    )
    p.add_argument("--checkpoint", help="run folder or checkpoint folder (default: the base model)")
    p.add_argument("--config", help="config file (default: the run's config.yaml, else the shapes preset)")
    p.add_argument(
        "--out",
        help="folder for eval.json and grid.png: a new one, or an earlier eval's (then eval-2.json, "
        "…: nothing is overwritten); --benchmark: the images in GenEval's layout, results.jsonl, "
        "summary.json, in a new (or empty) folder; never inside a run folder",
    )
    p.add_argument(
        "--benchmark",
        choices=("geneval", "ocr", "vqascore"),
        default=None,
        help="a benchmark by its own protocol instead of the held-out eval: geneval (553 prompts x 4 images, "
        "GenEval's score and task rows), ocr (Flow-GRPO's OCR test set) or vqascore (the mean VQAScore of "
        "--prompts' images, judged by the config's vlm_judge term, e.g. eval.rewards='[{name: vlm_judge, kwargs: "
        "{model: Qwen/Qwen2.5-VL-7B-Instruct}}]'); docs/rewards/geneval.md, docs/rewards/ocr.md and "
        "docs/rewards/vlm_judge.md",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="--benchmark: its prompt file (default dataset/geneval/test_metadata.jsonl or dataset/ocr/test.txt; "
        "vqascore: required, a text file or a .jsonl of records with a 'prompt')",
    )
    p.add_argument(
        "--images-per-prompt",
        type=int,
        default=None,
        help="--benchmark: images per prompt (default: the benchmark's, 4 for geneval, 1 for ocr and vqascore)",
    )
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def run(args: argparse.Namespace) -> int:
    """The run's held-out eval (:class:`~flowrl.training.evaluation.HeldOutEval`, the trainer's: the same seeds, passes
    and reductions) of a run's newest weights or a config's base model, at ``eval.guidance``, else the
    guidance the checkpoint's policy was trained for; under ``accelerate launch`` each process draws its
    share of the prompts. The main process prints the metrics and writes ``--out``."""
    if args.benchmark:  # a benchmark by its own protocol (flowrl/training/benchmarks.py)
        return run_benchmark_command(args)
    import json

    from accelerate import Accelerator

    from flowrl.config import build
    from flowrl.distributed.process_group import ProcessGroup
    from flowrl.prompts.source import read_prompts
    from flowrl.training.evaluation import HeldOutEval, failed_rewards

    cfg, ckpt = run_config(args.checkpoint, args.config, args.overrides)
    if not cfg.prompts.eval:
        raise ConfigError(
            "prompts.eval is null (the run was trained without held-out prompts); name them: "
            "flowrl eval ... prompts.eval=configs/shapes/prompts/eval.txt (a file, or 'a|b|c')"
        )
    output = check_output(args.out, "flowrl eval") if args.out is not None else None  # before the model loads
    prompts = read_prompts(cfg.prompts.eval, "prompts.eval")[: cfg.eval.num_prompts or None]
    reward = build.build_rewards(cfg.eval.rewards or cfg.rewards, key="eval.rewards" if cfg.eval.rewards else "rewards")
    group = ProcessGroup(Accelerator(cpu=build.resolve_device(cfg.model.device).type == "cpu"))
    model, trained_at = load_model(cfg, ckpt, group.accelerator.device)
    held_out = HeldOutEval(
        cfg.eval,
        model,
        prompts,
        reward,
        group,
        None,
        trained_at,
        progress=cfg.train.progress,
        max_batch=cfg.rollout.max_batch,
    )
    metrics, grids = held_out.run()
    metrics["num_prompts"] = len(prompts)
    if group.is_main:
        print(json.dumps(metrics, indent=2))
        if output is not None:
            _write_eval(output.make(), metrics, grids.get("eval"))
    group.close()
    failed = sorted({name for _, name, n in failed_rewards(metrics) if n >= held_out.images})
    if failed:  # every image's score non-finite: the mean is no measurement
        if group.is_main:
            print(
                f"flowrl eval: eval reward {', '.join(map(repr, failed))} failed or was not finite for every one of "
                f"the {held_out.images} images; its mean is NaN (exit status {EVAL_FAILED})",
                file=sys.stderr,
            )
        return EVAL_FAILED
    return 0


def _write_eval(out: Path, metrics: dict, grid) -> None:
    """``eval.json`` and ``grid.png`` in ``out`` under new names (``eval-2.json``, … when an earlier eval wrote
    there: nothing is overwritten), named on stderr."""
    import json

    from flowrl.run.filenames import FileNamer
    from flowrl.training.grids import save_grid

    names = FileNamer(out)
    written = [names.path("", "eval", ".json")]
    written[0].write_text(json.dumps(metrics, indent=2))
    if grid is not None and grid.numel():
        written.append(names.path("", "grid", ".png"))
        save_grid(grid, written[-1], scale=4)
    print(f"flowrl eval: wrote {' and '.join(p.name for p in written)} to {out}", file=sys.stderr)


def run_benchmark_command(args) -> int:
    """``flowrl eval --benchmark NAME``: the benchmark on a run's newest weights (``--checkpoint``) or a config's
    base model, at ``eval.guidance``, else the guidance the checkpoint's policy was trained for, else the model's. The
    reward's settings (for ``vqascore`` the judge: ``backend``, ``model``, ``url``…) are the config's term of its name
    (``eval.rewards`` first), set on the command line as any key: ``eval.rewards='[{name: vlm_judge, kwargs: …}]'``."""
    from accelerate import Accelerator

    from flowrl.config import build
    from flowrl.distributed.process_group import ProcessGroup
    from flowrl.training.benchmarks import (
        benchmark_reward,
        get_benchmark,
        read_benchmark_prompts,
        run_benchmark,
        summary_lines,
    )
    from flowrl.training.evaluation import resolve_guidance

    bench = get_benchmark(args.benchmark)
    cfg, ckpt = run_config(args.checkpoint, args.config, args.overrides)
    # a fixed layout (GenEval's): written into a new or empty folder only, never over an earlier benchmark's files
    output = check_output(args.out, "flowrl eval --benchmark", mode="new") if args.out is not None else None
    path = args.prompts or bench.prompts
    if not path:
        raise ConfigError(
            f"--benchmark {bench.name} has no prompt set of its own; name one with --prompts FILE (a text file, one "
            "prompt a line, or a .jsonl of records with a 'prompt')"
        )
    try:
        prompts, records = read_benchmark_prompts(path)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e}; the {bench.name} benchmark reads {bench.prompts} ({bench.source}), or name a file with --prompts"
        ) from None
    if not prompts:
        raise ConfigError(f"--prompts {path!r} holds no prompt")
    reward = benchmark_reward(cfg, bench, path if records is not None and bench.name == "geneval" else None)
    for i, prompt in enumerate(prompts):  # every prompt scorable before any model time is spent
        try:
            reward.check_prompt(prompt)
        except ValueError as e:
            raise ConfigError(f"--prompts {path!r}, prompt {i + 1}: {e}") from None
    reward.check_ready()  # e.g. a served judge answers and serves its model, before any model time is spent
    group = ProcessGroup(Accelerator(cpu=build.resolve_device(cfg.model.device).type == "cpu"))
    model, trained_at = load_model(cfg, ckpt, group.accelerator.device)
    model.resize(cfg.eval.height, cfg.eval.width)  # eval.height/eval.width: the benchmark's images at that size
    model.trainable.eval()
    guidance = resolve_guidance(model.guidance, cfg.eval.guidance, trained_at)
    n = args.images_per_prompt or bench.images_per_prompt
    if output is not None and group.is_main:
        output.make()
    summary = run_benchmark(
        bench,
        model,
        cfg,
        reward,
        prompts,
        records,
        group,
        guidance,
        output.path if output is not None else None,
        n,
        progress=cfg.train.progress,
    )
    if group.is_main:
        print(summary_lines(bench, summary, len(prompts)))
        print(
            f"(guidance {guidance:g}, {cfg.eval.steps} steps, {n} image{'s' if n > 1 else ''} per prompt"
            f"{', written to ' + args.out if args.out else ''})"
        )
    group.close()
    return 0
