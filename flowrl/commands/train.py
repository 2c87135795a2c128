"""``flowrl train``: a run to ``train.max_steps`` (:class:`~flowrl.training.trainer.Trainer`), then the closing summary
(:mod:`flowrl.commands.summary`) and, when the eval guard stopped the run, its own exit status."""

from __future__ import annotations

import argparse
import os

from flowrl.commands.common import OVERRIDES_HELP, Flag, is_file, load_config, split_config_arg
from flowrl.commands.summary import eval_summary, failed_evals
from flowrl.paths import DEFAULT_CONFIG, shipped_name
from flowrl.training.callbacks import GuardOnEval
from flowrl.training.guard import stop_summary

FLAGS: list[Flag] = []


def add_parser(sub, epilog: str) -> None:
    """``flowrl train`` under ``flowrl``'s sub-parsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "train",
        help="train with a YAML config (default: the embedded shapes preset)",
        description="Train: rollout plan → rewards → credit → objective, to train.max_steps. "
        f"Without CONFIG runs {shipped_name(DEFAULT_CONFIG)}.",
        epilog=epilog,
        formatter_class=fmt,
    )
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def reward_settings_epilog(argv: list[str] | None) -> str:
    """The help's list of reward settings (:func:`reward_settings_text`) of the config ``flowrl train ARGV --help``
    would run (the config and ``key=value`` overrides named in ``argv``, as the key list above it; one that does
    not load: the default config's)."""
    from flowrl.config.schema import ConfigError, TrainConfig

    words = [w for w in (argv or [])[1:] if not w.startswith("-")]
    config = next((w for w in words if "=" not in w and is_file(w)), None)
    try:
        cfg = load_config(config, [w for w in words if "=" in w])
    except (ConfigError, OSError):
        cfg = TrainConfig()
    return "\n\n" + reward_settings_text(cfg)


def reward_settings_text(cfg) -> str:
    """Every reward term of ``cfg`` (``rewards``, then ``eval.rewards`` when set) with its settings, each with its
    default, its help and whether the config sets it (:func:`flowrl_rewards.core.registry.settings_of`; the class
    imported, not built), then the combiner's term keys."""
    from flowrl.config.help_text import NO_HELP
    from flowrl.config.reward_help import setting_help
    from flowrl_rewards.core.registry import TERM_KEYS, TERM_KWARGS, resolve_reward_class, settings_of

    lines = ["reward settings (the keys of rewards[i].kwargs and eval.rewards[i].kwargs), with their defaults:"]
    for section, terms in (("rewards", cfg.rewards), ("eval.rewards", cfg.eval.rewards or [])):
        for i, term in enumerate(terms):
            try:
                settings = settings_of(resolve_reward_class(term.name))
            except Exception as e:  # noqa: BLE001 — the help still lists the others
                lines.append(f"  {section}[{i}] {term.name}: (cannot list its settings: {e})")
                continue
            cls = settings.reward
            lines.append(f"  {section}[{i}] {term.name} ({cls.__module__}.{cls.__name__}):")
            given = dict(term.kwargs or {})
            for s in settings.own + TERM_KWARGS:
                said = s.note if s in TERM_KWARGS else setting_help(cls, s)
                notes = [n for n in (s.annotation, said) if n and n != NO_HELP]
                if s.name in given:  # its value is in the key list above (not repeated: it may be a credential)
                    notes.append("set in this config")
                default = "(required)" if s.required else _yaml_value(s.default)
                lines.append(f"    {s.name}: {default}" + (f"  # {'; '.join(notes)}" if notes else ""))
            if settings.open:
                lines.append("    (its constructor takes any other key too)")
    keys = ", ".join(f"{k.name} ({_yaml_value(k.default)}: {k.note})" for k in TERM_KEYS)
    lines.append(f"each term also takes, beside name and kwargs: {keys}")
    return "\n".join(lines)


def _yaml_value(value) -> str:
    """``value`` as YAML writes it: null, true/false, a bare string, else its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else repr(value)


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


GUARD_STOPPED = GuardOnEval.exit_status  # a run stopped by its eval guard (eval.guard; docs/reliability.md)


# ---- train ------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from flowrl.training.trainer import Trainer

    config, overrides = split_config_arg(args.config, args.overrides)
    cfg = load_config(config, overrides)
    check_push(cfg.train.push_to_hub)
    cfg, perf = fitted_and_metered(cfg, overrides)
    trainer = Trainer(cfg, perf=perf)
    try:
        records = trainer.train()
    except KeyboardInterrupt:
        return 130
    if trainer.rolls_out:  # a launched rollout process (train.rollout_processes): its trainers have stopped
        trainer.group.close()
        return 0
    stop = trainer.control.stop  # a callback's (the eval guard's: exit status 4), else None
    if stop is not None and stop.reason != "eval_guard":
        stop = None  # train.max_minutes: an ordinary end
    if trainer.accelerator.is_main_process:
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        if len(evals) >= 2:
            print("\n" + "\n".join(eval_summary(evals[0], evals[-1])))
        failed = failed_evals(evals)  # an eval reward that failed: said in the summary, not only in the log
        if failed:
            print("\n" + "\n".join(failed))
        if stop is not None:
            print(f"\n{stop_summary(stop.detail)}; exit status {stop.exit_status}")
        print(f"\nrun folder: {trainer.run_dir}  (metrics.jsonl, reward_curve.png, samples/, checkpoints/)")
    pushed = push_to_hub(trainer, stop)
    trainer.group.close()  # several processes: all done, the process group destroyed before the interpreter exits
    return stop.exit_status if stop is not None else pushed


def check_push(repo: str | None) -> None:
    """Before any training: ``train.push_to_hub`` names a valid repo id, the Hub is not switched off (HF_HUB_OFFLINE)
    and a Hugging Face token is there (else a ConfigError: a run of hours should not end on a missing token)."""
    if repo is None:
        return
    from huggingface_hub import constants

    from flowrl.config.schema import ConfigError
    from flowrl.run.hub import check_repo_id, hub_token

    check_repo_id(repo, "train.push_to_hub")
    if constants.is_offline_mode():
        raise ConfigError(
            f"train.push_to_hub={repo!r} needs the Hub, but HF_HUB_OFFLINE is set: unset it (or drop "
            "train.push_to_hub); nothing was trained"
        )
    if not hub_token():
        raise ConfigError(
            f"train.push_to_hub={repo!r} needs a Hugging Face token: set HF_TOKEN or run `hf auth login` (or drop "
            "train.push_to_hub); nothing was trained"
        )


def push_to_hub(trainer, stop) -> int:
    """``train.push_to_hub`` after training (docs/sharing.md): the run's weights exported (``export/``, every process
    takes part), its model card written beside them and the folder uploaded by the main process. The exit status: 0,
    or 1 after a failed upload (one line; the run and its export kept). A run its eval guard stopped is not pushed."""
    repo = trainer.cfg.train.push_to_hub
    if repo is None:
        return 0
    if stop is not None:
        if trainer.accelerator.is_main_process:
            print(
                f"not pushed to {repo}: the eval guard stopped the run; `flowrl export {trainer.run_dir} "
                f"--push-to-hub {repo}` pushes its last checkpoint anyway"
            )
        return 0
    folder = trainer.export() if trainer.sharding is None else trainer.run_dir / "export"  # sharded: exported already
    status = 0
    if trainer.accelerator.is_main_process:
        from flowrl.commands.export import push
        from flowrl.run.model_card import write_card

        step = trainer.step
        write_card(
            folder, trainer.cfg, trainer.run_dir, step=step, last_step=step, guidance=trainer.guidance, repo_id=repo
        )
        again = f"`flowrl export {trainer.run_dir} --push-to-hub {repo}` pushes again"
        status = push(
            folder, repo, command="train", kept=f"the run in {trainer.run_dir} and its export are kept ({again})"
        )
    return status
