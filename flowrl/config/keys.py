"""Reading a config file and its ``key=value`` overrides: the YAML read with its errors named, the components the
file and the command line select, and every key checked against the schema of those components (a typo names the
nearest key; a component chosen on the command line over a preset that sets keys it lacks names the conflict)."""

from __future__ import annotations

import difflib
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flowrl.core import components
from flowrl.errors import ConfigError

MOVED_KEYS = {
    "loss.beta": "loss.kl_ref (the weight of the KL to the reference policy, one name for every objective; "
    "loss.beta is DiffusionNFT's step only)",
    "loss.batch_size": "rollout.max_batch (the run's one micro-batch size: states per rollout forward and "
    "rows per training forward)",
    "eval.batch_size": "rollout.max_batch (the run's one micro-batch size: images per forward of the eval, "
    "flowrl sample and the benchmarks too)",
    "loss.layer_batch": "rollout.max_batch (the run's one micro-batch size: rows per forward of the "
    "layer-tuning term too)",
    "rollout.inner_kwargs": "rollout.inner: {plan: NAME, key: value, ...} (the inner plan and its own keys)",
    "rollout.inner_args": "rollout.inner: {plan: NAME, key: value, ...} (the inner plan and its own keys, one mapping)",
    "credit.per_reward_norm": "reward_normalize: group (MultiReward z-scores each reward within its "
    "prompt group before the weighted sum) with credit.scale: none",
}


def load_yaml(path: Path) -> Any:
    """The YAML tree of ``path``; a syntax error names the file, line and column, a file that is not UTF-8 its name."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}:{where}: not valid YAML ({problem})") from None
    except UnicodeDecodeError as e:  # UTF-16, Latin-1, a binary file
        raise ConfigError(
            f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}); a config is YAML saved as UTF-8"
        ) from None
    except (OmegaConfBaseException, OSError) as e:  # e.g. a file holding a single number
        raise ConfigError(
            f"{path}: not a config ({e}); a config is a mapping of sections such as model:, rollout:, loss:"
        ) from None


def keep_strings_as_written(base, overrides: list[str]) -> None:
    """A string key given on the command line keeps its text: YAML would read ``train.name=off`` as false (the run
    folder ``False``), ``0x10`` as 16 and ``1e3`` as 1000.0. Quotes around the value are taken off."""
    for item in overrides:
        key, raw = item.split("=", 1)
        if isinstance(OmegaConf.select(base, key, default=None), str):
            text = raw.strip()
            if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
                text = text[1:-1]
            OmegaConf.update(base, key, text, merge=False)


def selected_components(loaded: Any, overrides: list[str]) -> dict[str, str]:
    """The component names a YAML tree and overrides select: ``{"plan": ..., "rule": ..., "objective": ...}``
    (the last override wins; absent → the defaults)."""
    chosen: dict[str, str] = {}
    for kind in components.KINDS:
        section = loaded.get(kind.section) if loaded is not None and hasattr(loaded, "get") else None
        if section is not None and hasattr(section, "get") and section.get(kind.selector) is not None:
            chosen[kind.selector] = str(section.get(kind.selector))
        for item in overrides:
            key, _, value = item.partition("=")
            if key.strip() == kind.key:
                chosen[kind.selector] = value.strip()
    return chosen


def all_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for suggestions)."""
    import typing

    out = []
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        out.append(key)
        default = f.default_factory() if f.default_factory is not NO_DEFAULT else f.default  # type: ignore[misc]
        nested = [a for a in typing.get_args(hints.get(f.name)) if is_dataclass(a)]  # Optional[Section], default None
        if is_dataclass(default) or nested:
            out.extend(all_keys(type(default) if is_dataclass(default) else nested[0], key + "."))
    return out


def unknown_key_message(e: OmegaConfBaseException, schema: type) -> str:
    bad = getattr(e, "full_key", None) or str(e)
    keys = all_keys(schema)
    close = difflib.get_close_matches(bad, keys, n=1, cutoff=0.5)
    if not close:  # compare the last component within the same section
        section, _, leaf = bad.rpartition(".")
        same = [k for k in keys if k.rpartition(".")[0] == section]
        close = [
            k
            for k in same
            if k.rpartition(".")[2] in difflib.get_close_matches(leaf, [s.rpartition(".")[2] for s in same], n=1)
        ]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {bad!r}{hint} (see `flowrl train --help` or flowrl/config/schema.py for every key)"


FREE_FORM = (
    "rewards",
    "eval.rewards",  # lists of reward terms whose kwargs are the reward's own settings (checked
    # against them at load by flowrl.config.checks.check_reward_terms, the reward not built)
    "rollout.inner",  # a wrapped plan {plan: name, its keys} (checked against that plan when built, at load)
    "model.kwargs",
)  # the adapter's own keywords (checked against its signature at load, no weight loaded)


def dotted(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a nested dict (lists are leaves)."""
    if not isinstance(tree, dict):
        return [prefix]
    out = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.extend(dotted(v, key) if key not in FREE_FORM else [key])
    return out


def check_file_keys_under_overridden_components(loaded: Any, path: Any, overrides: list[str], schema: type) -> None:
    """A component chosen on the command line (``rollout.plan=ode``) over a file whose section sets keys that component
    does not have (the preset's ``rollout.kernel``): the conflict named, not an unknown key of the file."""
    known = set(all_keys(schema))
    from_file = selected_components(loaded, [])
    for kind in components.KINDS:
        chosen = selected_components(None, overrides).get(kind.selector)
        if chosen is None or chosen == from_file.get(kind.selector, kind.default):
            continue
        section = loaded.get(kind.section) if hasattr(loaded, "get") else None
        if section is None:
            continue
        keys = [f"{kind.section}.{k}" for k in dotted(OmegaConf.to_container(section))]
        foreign = [k for k in keys if k not in known and not any(k == f or k.startswith(f + ".") for f in FREE_FORM)]
        if foreign:
            own = sorted(k for k in known if k.startswith(kind.section + "."))
            raise ConfigError(
                f"{kind.key}={chosen} (on the command line) has no key {foreign[0]!r}, which {path} sets for "
                f"its {kind.key}={from_file.get(kind.selector, kind.default)}; remove it from the file (or "
                f"choose a {kind.selector} that reads it). {kind.key}={chosen} reads: {own}"
            )


def check_keys(keys: list[str], where: str, schema: type) -> None:
    """Every key must exist in the schema; else name the nearest full key."""
    known = set(all_keys(schema))
    for key in keys:
        if key in known or any(key == f or key.startswith(f + ".") or key.startswith(f + "[") for f in FREE_FORM):
            continue
        if key in MOVED_KEYS:
            raise ConfigError(f"config key {key!r}{where} is gone; use {MOVED_KEYS[key]}")
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{where}{hint} (`flowrl train --help` lists every key)")
