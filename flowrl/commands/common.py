"""What every ``flowrl`` subcommand shares: the help text of overrides, the config a command line names, and the range
checks of numeric flags (each command module declares its own ``FLAGS``)."""

from __future__ import annotations

import argparse
import math

from flowrl.config.help import annotated_yaml
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.paths import DEFAULT_CONFIG, find_file, shipped_name

OVERRIDES_HELP = (
    "key=value overrides of the config, e.g. rollout.group_size=4 optim.lr=1e-4 train.max_steps=20; "
    "every key with its value in the config that runs is listed below"
)

SEED_MAX = 2**62  # seeds go to torch.Generator.manual_seed (and seed + i must stay below 2**64)

Flag = tuple[str, float, "float | None", str] | tuple[str, float, "float | None", str, float]
"""``(flag, least, most (None: no bound), what it is[, limit])`` of a numeric flag; a flag left at None (its default)
is not checked. ``limit``: a stated maximum of a size that drives memory or time (:mod:`flowrl.config.bounds`),
refused at once with its own message rather than after minutes of work."""


def defaults_epilog(argv: list[str] | None = None) -> str:
    """Every key and its value in the config that would run: the one named on the command line ``argv`` (with
    its ``key=value`` overrides), else the main job's (``flowrl train`` without a config runs it), so the
    sections list the keys of the components it chooses (e.g. the objective's own keys)."""
    words = [w for w in (argv or [])[1:] if not w.startswith("-")]
    config = next((w for w in words if "=" not in w and is_file(w)), None)
    overrides = [w for w in words if "=" in w]
    shown_config = config or shipped_name(DEFAULT_CONFIG)
    other = (
        "\n\nanother plan, credit rule or objective has its own keys: name its config to list them, e.g. "
        "`flowrl train configs/shapes/grpo.yaml --help`."
    )
    helped = "each followed by its help (# ...; docs/keys.md has every key's)"
    try:
        return (
            f"every config key, with its value in {shown_config}{' and the overrides' if overrides else ''}, "
            f"{helped}:\n\n" + annotated_yaml(load_config(config, overrides)) + other
        )
    except (ConfigError, OSError) as e:
        return (
            f"(could not load the config named on the command line: {e})\n\nevery config key and its default, "
            f"{helped}:\n\n" + annotated_yaml(TrainConfig())
        )


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    return TrainConfig.from_yaml(path or DEFAULT_CONFIG, overrides)


def split_config_arg(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """Allow ``flowrl train key=value`` without a config path."""
    if config is not None and "=" in config and not is_file(config):
        return None, [config] + overrides
    return config, overrides


def is_file(word: str) -> bool:
    """Whether ``word`` names a file (:func:`flowrl.paths.find_file`: a shipped ``configs/…`` preset too)."""
    try:
        return find_file(word) is not None
    except OSError:  # e.g. a name too long to be a path
        return False


def check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag the command declares (``args.flags``, its module's ``FLAGS``) within its range; else a
    ConfigError naming the flag, the value and what is accepted."""
    from flowrl.config.bounds import at_most

    for flag, low, high, what, *limit in getattr(args, "flags", ()):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            bad = not math.isfinite(v) or v < low or (high is not None and v > high)
            if bad:
                accepted = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
                raise ConfigError(f"{flag}={v!r} must be {accepted} ({what})")
            if limit:
                at_most(flag, v, limit[0], what)


def image_bytes(model) -> int:
    """Bytes one drawn image (a video: all its frames) of ``model`` takes as float32 pixels."""
    frames = int(model.num_frames or 1)
    return 3 * int(model.height) * int(model.width) * frames * 4


def available_memory() -> int | None:
    """Bytes of memory this machine can still give a process (``MemAvailable`` of /proc/meminfo), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(flag: str, value: int, need: int, what: str) -> None:
    """``need`` bytes (``what``, driven by ``flag``'s ``value``) fit in the memory available now, with a quarter to
    spare; else a ConfigError naming the flag, both sizes and what to change, before any work starts."""
    have = available_memory()
    if have is not None and need > 0.75 * have:
        raise ConfigError(
            f"{flag}={value}: {what} take {need / 2**30:,.1f} GiB, more than this machine can hold "
            f"({have / 2**30:,.1f} GiB available); accepted: a smaller {flag}"
        )
