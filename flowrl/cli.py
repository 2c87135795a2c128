"""``flowrl train | sample | eval | bench | snr``: parse, build, run. Thin on purpose."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# OpenMP threads that spin at barriers while another process holds a core made a 2-thread CPU
# iteration up to 70x slower on a shared 2-core machine; purely passive waiting avoids that but makes
# every small kernel wait for a sleeping thread (1.7x slower forwards alone). A short spin (1,000
# iterations, then sleep) is as fast as spinning alone and as safe as passive under contention
# (docs/benchmarks.md). Set before torch is imported; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the
# environment win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from flowrl.cli_sample import check_flags, cmd_eval, cmd_export, cmd_sample
from flowrl.config import ConfigError, TrainConfig
from flowrl.paths import DEFAULT_CONFIG, find_file, shipped_name
from flowrl.guard import stop_summary
from flowrl.summary import eval_summary

OVERRIDES_HELP = ("key=value overrides of the config, e.g. rollout.group_size=4 optim.lr=1e-4 train.max_steps=20; "
                  "every key with its value in the config that runs is listed below")


def _defaults_epilog(argv: list[str] | None = None) -> str:
    """Every key and its value in the config that would run: the one named on the command line ``argv`` (with
    its ``key=value`` overrides), else the main job's (``flowrl train`` without a config runs it), so the
    sections list the keys of the components it chooses (e.g. the objective's own keys)."""
    words = [w for w in (argv or [])[1:] if not w.startswith("-")]
    config = next((w for w in words if "=" not in w and _is_file(w)), None)
    overrides = [w for w in words if "=" in w]
    shown_config = config or shipped_name(DEFAULT_CONFIG)
    other = ("\n\nanother plan, credit rule or objective has its own keys: name its config to list them, e.g. "
             "`flowrl train configs/shapes/grpo.yaml --help`.")
    try:
        return (f"every config key, with its value in {shown_config}{' and the overrides' if overrides else ''}:\n\n"
                + _load_config(config, overrides).to_yaml() + other)
    except (ConfigError, OSError) as e:
        return f"(could not load the config named on the command line: {e})\n\nevery config key and its default:\n\n" + TrainConfig().to_yaml()


def _load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    return TrainConfig.from_yaml(path or DEFAULT_CONFIG, overrides)


def _split_config_arg(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """Allow ``flowrl train key=value`` without a config path."""
    if config is not None and "=" in config and not _is_file(config):
        return None, [config] + overrides
    return config, overrides


def _is_file(word: str) -> bool:
    """Whether ``word`` names a file (:func:`flowrl.paths.find_file`: a shipped ``configs/…`` preset too)."""
    try:
        return find_file(word) is not None
    except OSError:  # e.g. a name too long to be a path
        return False


# ---- train ------------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    from flowrl.trainer import Trainer

    config, overrides = _split_config_arg(args.config, args.overrides)
    cfg = _load_config(config, overrides)
    trainer = Trainer(cfg)
    try:
        records = trainer.train()
    except KeyboardInterrupt:
        return 130
    stop = trainer.guard.stop
    if trainer.accelerator.is_main_process:
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        if len(evals) >= 2:
            print("\n" + "\n".join(eval_summary(evals[0], evals[-1])))
        if stop is not None:
            print(f"\n{stop_summary(stop)}; exit status {GUARD_STOPPED}")
        print(f"\nrun folder: {trainer.run_dir}  (metrics.jsonl, reward_curve.png, samples/, checkpoints/)")
    return GUARD_STOPPED if stop is not None else 0


GUARD_STOPPED = 4  # the exit status of a run stopped by its eval guard (eval.guard; docs/reliability.md)


# ---- sample and eval (a run's model, the trainer's held-out eval): flowrl/cli_sample.py -----


# ---- bench ------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from flowrl.bench import bench_iteration, bench_versus, versus_table

    config, overrides = _split_config_arg(args.config, args.overrides)
    if args.estimate:  # before loading: a preset's GPU-only explorer is checked against --gpu, not this machine
        if args.vs is not None:
            raise ConfigError("--estimate predicts one config; drop --vs")
        from flowrl.estimate import run_estimate

        return run_estimate(config, overrides, gpu=args.gpu, processes=args.processes, shard=args.shard)
    cfg = _load_config(config, overrides)
    if args.vs is None:
        if args.vs_set:
            raise ConfigError("--vs-set needs --vs OTHER")
        result = bench_iteration(cfg, iterations=args.iterations, warmup=args.warmup)
        print(json.dumps(result, indent=2))
        return 0
    other = _load_config(args.vs, args.vs_set or [])
    result = bench_versus(cfg, other, iterations=args.iterations, warmup=args.warmup)
    print(versus_table(result, (Path(config).stem if config else "default", Path(args.vs).stem)))
    print(json.dumps(result, indent=2))
    return 0


# ---- snr --------------------------------------------------------------------------------------
def cmd_snr(args: argparse.Namespace) -> int:
    from flowrl.checkpoint import find_checkpoint
    from flowrl.grad_snr import gradient_snr

    config, overrides = _split_config_arg(args.config, args.overrides)
    checkpoint = None
    if args.checkpoint:
        checkpoint, run_dir = find_checkpoint(args.checkpoint)
        config = config or str(run_dir / "config.yaml")
    cfg = _load_config(config, overrides)
    result = gradient_snr(cfg, batches=args.batches, checkpoint=checkpoint, reward_only=args.reward_only)
    print(json.dumps(result, indent=2))
    if result["signal_detected"]:
        print(f"signal detected: SNR {result['snr_per_batch']:.3g} per batch of {int(result['samples_per_batch'])} samples; "
              f"about {result['samples_for_snr_1']:.0f} samples per update for SNR 1")
    elif result["signal"] == result["noise"] == 0:
        print(f"every one of the {args.batches} gradients is zero: nothing in this objective depends on what was sampled")
    else:
        print(f"no signal detected above noise in {args.batches} batches of {int(result['samples_per_batch'])} samples: "
              f"an update needs at least ~{result['samples_for_snr_1_at_least']:.0f} samples for SNR 1")
    return 0


# ---- compare ----------------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from flowrl.compare import compare

    configs = [w for w in args.items if w.endswith((".yaml", ".yml"))]
    overrides = [w for w in args.items if w not in configs]
    if not configs:
        raise ConfigError("flowrl compare needs at least one CONFIG.yaml (or LABEL=CONFIG.yaml)")
    bad = [w for w in overrides if "=" not in w]
    if bad:
        raise ConfigError(f"{bad[0]!r} is neither a CONFIG.yaml nor a key=value override")
    per_label: dict[str, list[str]] = {}
    for label, item in args.set or []:
        per_label.setdefault(label, []).append(item)
    entries = []
    for spec in configs:
        label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).stem, "", spec)
        entries.append((label, path, overrides + per_label.pop(label, [])))
    if per_label:
        raise ConfigError(f"--set names labels {sorted(per_label)} that are not among the configs' labels "
                          f"{[e[0] for e in entries]}")
    text, failed = compare(entries, args.seeds, args.budget, args.out, parallel=args.parallel, threads=args.threads,
                           metric=args.metric, run=not args.report_only)
    print(text)
    print(f"plots and table in {args.out} (results.md, curves.png, commands.sh)")
    if failed:  # the table is written; the exit status still says that not every run finished
        print(f"flowrl compare: {len(failed)} of {len(entries) * len(args.seeds)} runs failed ({', '.join(failed)}); "
              f"their logs' last lines are in {Path(args.out) / 'results.md'}", file=sys.stderr)
        return 1
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``flowrl`` parser; ``argv`` (when asking for help) picks the config whose keys the help lists."""
    epilog = _defaults_epilog(argv) if argv and ("-h" in argv or "--help" in argv) else _defaults_epilog()
    parser = argparse.ArgumentParser(prog="flowrl", description="RL alignment of flow-matching text-to-image models. "
                                     "Add --debug to any command to see the traceback of a failure.")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("train", help="train with a YAML config (default: the embedded shapes preset)",
                       description="Train: rollout plan → rewards → credit → objective, to train.max_steps. "
                                   f"Without CONFIG runs {shipped_name(DEFAULT_CONFIG)}.",
                       epilog=epilog, formatter_class=fmt)
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate PNGs with a trained run (or a config's base model)",
                       description="Generate images with ODE sampling from a run folder's newest checkpoint; grid.png "
                                   "shows each with its prompt (and with --reward, its score).")
    p.add_argument("--checkpoint", help="run folder (runs/<name>) or a checkpoints/step-N folder")
    p.add_argument("--config", help="config file (default: the run's config.yaml, else the shapes preset)")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeat for several)")
    p.add_argument("--num", type=int, default=4, help="images per prompt (default 4)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: eval.steps)")
    p.add_argument("--guidance", type=float, default=None,
                   help="CFG scale (default: eval.guidance, else the guidance the checkpoint's policy was trained for)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image; image i uses seed+i")
    p.add_argument("--out", default="samples", help="output folder (default ./samples)")
    p.add_argument("--scale", type=int, default=4, help="upscaling of grid.png (default 4)")
    p.add_argument("--reward", metavar="NAME", help="score each image with this reward (a registry name, "
                   "package.module:Class or path/to/file.py:Class): its mark on grid.png (PASS/FAIL for a 0/1 reward, "
                   "else the score) and every score in scores.json")
    p.add_argument("--reward-kwargs", metavar="JSON", help='keyword arguments of --reward, a JSON object, e.g. '
                   '\'{"mode": "strict"}\'')
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="consolidate a run's weights (sharded or not) into one folder a single GPU loads",
                       description="Write a run's newest (or a given) checkpoint's trained weights whole: a LoRA in the "
                                   "diffusers format, or a transformer/ folder that from_pretrained reads (docs/gpu.md).")
    p.add_argument("run", help="run folder (runs/<name>) or a checkpoints/step-N folder")
    p.add_argument("--out", help="output folder (default: <run>/export)")
    p.add_argument("--config", help="config file (default: the run's config.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="evaluate a run or base model on the held-out prompts",
                       description="ODE-sample the eval prompts (prompts.eval) and score them with eval.rewards.",
                       epilog=epilog, formatter_class=fmt)
    p.add_argument("--checkpoint", help="run folder or checkpoint folder (default: the base model)")
    p.add_argument("--config", help="config file (default: the run's config.yaml, else the shapes preset)")
    p.add_argument("--out", help="folder for eval.json and grid.png (--benchmark: the images in GenEval's layout, "
                                 "results.jsonl, summary.json)")
    p.add_argument("--benchmark", choices=("geneval", "ocr"), default=None,
                   help="a benchmark by its own protocol instead of the held-out eval: geneval (553 prompts x 4 images, "
                        "GenEval's score and task rows) or ocr (Flow-GRPO's OCR test set); docs/rewards/geneval.md, docs/rewards/ocr.md")
    p.add_argument("--prompts", default=None, help="--benchmark: its prompt file (default dataset/geneval/"
                                                   "test_metadata.jsonl or dataset/ocr/test.txt)")
    p.add_argument("--images-per-prompt", type=int, default=None,
                   help="--benchmark: images per prompt (default: the benchmark's, 4 for geneval, 1 for ocr)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="time iterations: rollout, reward, update, model-forward overhead, peak memory",
                       epilog=epilog, formatter_class=fmt)
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--vs", metavar="OTHER", help="a second config to run in the same process on CONFIG's model and "
                                                 "reward; prints both side by side with the ratios CONFIG / OTHER")
    p.add_argument("--vs-set", action="append", metavar="KEY=VALUE",
                   help="an override of OTHER's config (repeat for several); positional overrides apply to CONFIG")
    p.add_argument("--estimate", action="store_true",
                   help="predict peak GPU memory and s/iteration without running anything (meta device; docs/estimate.md)")
    p.add_argument("--gpu", default="H100", help="GPU class of --estimate: H100, H200, A100, L40S, 4090 (default H100)")
    p.add_argument("--processes", "--gpus", dest="processes", type=int, default=1,
                   help="--estimate: processes (GPUs) sharing prompts.per_step")
    p.add_argument("--shard", choices=("ddp", "fsdp"), default=None,
                   help="--estimate: ddp (a whole copy per GPU) or fsdp (FSDP2, split over --gpus); default: model.shard")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compare", help="several configs × seeds under one budget: plots, a table, the commands",
                       description="Run each CONFIG (or LABEL=CONFIG) with every seed under the same budget, each "
                                   "run a `flowrl train` process; resumable (OUT/status.json). key=value overrides "
                                   "apply to every config; --set LABEL key=value to one.")
    p.add_argument("items", nargs="+", metavar="CONFIG|LABEL=CONFIG|key=value")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", default="iterations=150", help="iterations=N | images=N | minutes=N (default iterations=150)")
    p.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--metric", default=None, help="held-out metric key (default: the first eval/*/accuracy)")
    p.add_argument("--set", nargs=2, action="append", metavar=("LABEL", "KEY=VALUE"), help="an override of one config")
    p.add_argument("--report-only", action="store_true", help="write the table and plots from the runs there, run nothing")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("snr", help="gradient signal-to-noise of one update: is the batch big enough?",
                       description="Policy gradients of N independent iterations at fixed weights; their agreement "
                                   "is the signal, their spread the noise (docs/benchmarks.md).",
                       epilog=epilog, formatter_class=fmt)
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml, or the run's)")
    p.add_argument("--batches", type=int, default=12, help="independent iterations to draw (default 12)")
    p.add_argument("--checkpoint", help="measure at a run's newest checkpoint (runs/<name>) or a step-N folder")
    p.add_argument("--reward-only", action="store_true", help="nft/awm: the reward's share alone (no teacher anchor, "
                   "no kl_ref, the old copy set to the weights measured)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=cmd_snr)
    from flowrl.data import add_data_parser  # flowrl data fetch | list: the GPU presets' prompt sets

    add_data_parser(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may also follow an option (``snr CONFIG --batches 4 a.b=1``)."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        into = "overrides" if hasattr(args, "overrides") else "items" if hasattr(args, "items") else None
        if into is None or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, into, list(getattr(args, into) or []) + extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command; a failure is one message on stderr (``--debug``: the traceback too) and an exit
    status: 2 a bad config or input, 3 a run stopped for non-finite values, 1 anything else; ``flowrl train``
    also exits with 4 when its eval guard stopped the run (:data:`GUARD_STOPPED`) and 130 when interrupted."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    args = parse_args([a for a in argv if a != "--debug"])
    if not debug:
        _quiet_libraries()
    try:
        check_flags(args)  # every numeric flag in its range, named (flowrl/cli_sample.py)
        return args.func(args)
    except ConfigError as e:
        return _fail(args.command, f"config error: {e}", 2, debug)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail(args.command, f"error: {_text(e)}", 2, debug)
    except FloatingPointError as e:
        return _fail(args.command, f"stopped: {e}", 3, debug)
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return _fail(args.command, f"error: {e.strerror or e}{where}", 1, debug)
    except Exception as e:  # noqa: BLE001 — anything else is still one message, not a traceback
        return _fail(args.command, f"error: {type(e).__name__}: {_text(e)}", 1, debug)


def _quiet_libraries() -> None:
    """diffusers' and transformers' loading bars and advisory warnings off: the command's own progress bar and
    messages are what a user reads (``--debug`` keeps them)."""
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def _text(e: BaseException) -> str:
    """An exception's message (KeyError's without its quotes), at most 2,000 characters."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text if len(text) <= 2000 else text[:2000] + f"… ({len(text):,} characters)"


def _fail(command: str, message: str, status: int, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    hint = "" if debug else "\n(add --debug to see the traceback)" if status == 1 else ""
    print(f"flowrl {command}: {message}{hint}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
