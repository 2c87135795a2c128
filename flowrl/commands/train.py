"""``flowrl train``: a run to ``train.max_steps`` (:class:`~flowrl.training.trainer.Trainer`), then the closing summary
(:mod:`flowrl.commands.summary`) and, when the eval guard stopped the run, its own exit status."""
from __future__ import annotations

import argparse
import os

from flowrl.commands.common import OVERRIDES_HELP, Flag, load_config, split_config_arg
from flowrl.commands.summary import eval_summary, failed_evals
from flowrl.paths import DEFAULT_CONFIG, shipped_name
from flowrl.training.guard import stop_summary

FLAGS: list[Flag] = []


def add_parser(sub, epilog: str) -> None:
    """``flowrl train`` under ``flowrl``'s sub-parsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("train", help="train with a YAML config (default: the embedded shapes preset)",
                       description="Train: rollout plan → rewards → credit → objective, to train.max_steps. "
                                   f"Without CONFIG runs {shipped_name(DEFAULT_CONFIG)}.",
                       epilog=epilog, formatter_class=fmt)
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def fitted_and_metered(cfg, overrides: list[str]):
    """``cfg`` with ``train.fit: auto``'s settings for the device at hand (printed; the ``key=value`` overrides win),
    and the :class:`~flowrl.training.perf.PerfMeter` of its iterations (``perf/tflops``, ``perf/mfu``)."""
    from flowrl.estimate.device import fit_for_run, perf_meter

    flops = None
    if cfg.train.fit == "auto":
        fit = fit_for_run(cfg, overrides)
        if os.environ.get("RANK", "0") == "0":
            print("\n".join(fit.summary()), flush=True)
        cfg, flops = fit.config, fit.flops_per_iteration
    return cfg, perf_meter(cfg, flops)


GUARD_STOPPED = 4  # the exit status of a run stopped by its eval guard (eval.guard; docs/reliability.md)


# ---- train ------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from flowrl.training.trainer import Trainer

    config, overrides = split_config_arg(args.config, args.overrides)
    cfg = load_config(config, overrides)
    cfg, perf = fitted_and_metered(cfg, overrides)
    trainer = Trainer(cfg, perf=perf)
    try:
        records = trainer.train()
    except KeyboardInterrupt:
        return 130
    stop = trainer.guard.stop
    if trainer.accelerator.is_main_process:
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        if len(evals) >= 2:
            print("\n" + "\n".join(eval_summary(evals[0], evals[-1])))
        failed = failed_evals(evals)  # an eval reward that failed: said in the summary, not only in the log
        if failed:
            print("\n" + "\n".join(failed))
        if stop is not None:
            print(f"\n{stop_summary(stop)}; exit status {GUARD_STOPPED}")
        print(f"\nrun folder: {trainer.run_dir}  (metrics.jsonl, reward_curve.png, samples/, checkpoints/)")
    trainer.group.close()  # several processes: all done, the process group destroyed before the interpreter exits
    return GUARD_STOPPED if stop is not None else 0

