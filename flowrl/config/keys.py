"""Reading a config file and its ``key=value`` overrides: the YAML read with its errors named, the components the
file and the command line select, and every key checked against the schema of those components (a typo names the
nearest key; a component chosen on the command line over a preset that sets keys it lacks names the conflict)."""

from __future__ import annotations

import functools
import re
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from flowrl.core import components
from flowrl.core.choices import refuse_key
from flowrl.errors import ConfigError, shown

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


def all_keys(schema: type, prefix: str = "", lists: list[str] | None = None) -> list[str]:
    """Every dotted key of the schema (for suggestions); ``lists``: filled with the keys whose values are lists."""
    import typing

    out = []
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        out.append(key)
        hint = hints.get(f.name)
        if lists is not None and (
            typing.get_origin(hint) is list or list in map(typing.get_origin, typing.get_args(hint))
        ):
            lists.append(key)
        default = f.default_factory() if f.default_factory is not NO_DEFAULT else f.default  # type: ignore[misc]
        nested = [a for a in typing.get_args(hints.get(f.name)) if is_dataclass(a)]  # Optional[Section], default None
        if is_dataclass(default) or nested:
            out.extend(all_keys(type(default) if is_dataclass(default) else nested[0], key + ".", lists))
    return out


def section_keys(key: str, schema: type) -> list[str]:
    """The keys a refusal of ``key`` lists as accepted: those of the deepest section of ``schema`` that ``key`` sits in
    (``rollout.pol`` → every ``rollout.*`` key one level down), or the top-level sections."""
    known = known_keys(schema)
    parts = key_parts(key)
    for i in range(len(parts) - 1, 0, -1):
        section = ".".join(parts[:i])
        own = [k for k in known if k.rpartition(".")[0] == section]
        if own:
            return own
    return [k for k in known if "." not in k]


def refuse_config_key(key: str, where: str, schema: type) -> None:
    """Refuse ``key`` of the config (:func:`flowrl.core.choices.refuse_key`: the nearest of every key suggested, the
    keys of its section accepted); a moved key names its new place."""
    if key in MOVED_KEYS:
        refuse_key(
            key,
            section_keys(key, schema),
            f"(the config{where})",
            problem=f"is gone; use {MOVED_KEYS[key]}",
            suggest=False,
        )
    refuse_key(
        key,
        section_keys(key, schema),
        f"the config{where}",
        among=known_keys(schema),
        note=" (`flowrl train --help` lists every key)",
    )


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
    known = set(known_keys(schema))
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
            refuse_key(
                foreign[0],
                own,
                f"{kind.key}={chosen} (chosen on the command line; {path} sets it for its "
                f"{kind.key}={from_file.get(kind.selector, kind.default)}: remove it from the file, or choose a "
                f"{kind.selector} that reads it)",
            )


def check_keys(keys: list[str], where: str, schema: type) -> None:
    """Every key must exist in the schema; else name the nearest full key."""
    known = set(known_keys(schema))
    for key in keys:
        if key in known or any(key == f or key.startswith(f + ".") or key.startswith(f + "[") for f in FREE_FORM):
            continue
        refuse_config_key(key, where, schema)


# ---- merging a file and the command line into the schema --------------------------------------------------------
def merge_layers(base: Any, loaded: Any, path: Any, overrides: list[str], schema: type) -> Any:
    """``base`` (the schema's defaults, not changed) ← the file's tree ``loaded`` (None: no file, ``path`` names it) ←
    the ``key=value`` ``overrides`` in order (:func:`apply_overrides`), every key checked first against ``schema``
    (a typo names the nearest key, a component chosen on the command line the file's keys it lacks, a section given a
    value names its keys). Returns the merged tree; a value of the wrong type is omegaconf's ValidationError."""
    try:
        return _merge_layers(base, loaded, path, overrides, schema)
    except (ConfigKeyError, ConfigAttributeError) as e:  # a key omegaconf meets that no check above refused
        refuse_config_key(str(getattr(e, "full_key", None) or e), f" in {path}" if loaded is not None else "", schema)
        raise


def _merge_layers(base: Any, loaded: Any, path: Any, overrides: list[str], schema: type) -> Any:
    layers = []
    if loaded is not None:
        check_file_keys_under_overridden_components(loaded, path, overrides, schema)
        tree = OmegaConf.to_container(loaded)
        check_keys(dotted(tree), f" in {path}", schema)
        for key in dotted(tree):
            value = tree
            for part in key.split("."):
                value = value[part]
            check_section_value(key, value, f" in {path}", schema)
            check_list_value(key, value, f" in {path}", schema)
        layers.append(loaded)
    return apply_overrides(base, overrides, schema, layers)


@functools.lru_cache(maxsize=None)
def known_keys(schema: type) -> tuple[str, ...]:
    """:func:`all_keys` of ``schema``, computed once per schema."""
    return tuple(all_keys(schema))


@functools.lru_cache(maxsize=None)
def list_keys(schema: type) -> frozenset[str]:
    """The keys of ``schema`` whose values are lists (``train.fit_keep``, ``rewards``, ``optim.betas``)."""
    lists: list[str] = []
    all_keys(schema, lists=lists)
    return frozenset(lists)


def check_list_value(key: str, value: Any, where: str, schema: type) -> None:
    """A key whose value is a list (:func:`list_keys`) given one value (``train.fit_keep=rollout.max_batch``, which
    omegaconf refused as an ``AnyNode``): a ConfigError naming the key and showing the list form."""
    if key not in list_keys(schema) or value is None or isinstance(value, (list, tuple, ListConfig)):
        return
    item = value if isinstance(value, (str, int, float)) else "…"
    terms = key in FREE_FORM  # a list of reward terms: mappings
    example, several = (f"[{{name: {item}}}]", "[{name: a}, {name: b}]") if terms else (f"[{item}]", "[a, b]")
    raise ConfigError(
        f"config key {key!r}{where} is a list, got one value ({shown(value, 60)}); write it as a list: "
        f"{key}={example} (several: {key}={several})"
    )


@functools.lru_cache(maxsize=None)
def sections(schema: type) -> dict[str, list[str]]:
    """Every section key of the schema (a mapping of keys: ``model``, ``model.context_parallel``; not a list of them,
    ``rewards``) → its own keys."""
    keys, lists = known_keys(schema), list_keys(schema)
    return {
        k: [c for c in keys if c.rpartition(".")[0] == k]
        for k in keys
        if k not in lists and any(c.startswith(k + ".") for c in keys)
    }


def check_section_value(key: str, value: Any, where: str, schema: type) -> None:
    """A section key (``model.context_parallel``) takes a mapping of its keys, not a value (``model.context_parallel=4``
    merged as ``config key None: None``); else a ConfigError naming the key and its keys. Null is left to the schema
    (an optional section accepts it)."""
    own = sections(schema).get(key)
    if own is None or value is None or isinstance(value, (dict, DictConfig)):
        return
    example = own[0]
    raise ConfigError(
        f"config key {key!r}{where} is a section of keys, not a value (got {shown(value, 60)}); set one of its keys, "
        f"e.g. {example}=…, or give a mapping, e.g. {key}={{{example.rpartition('.')[2]}: …}}; its keys: {own}"
    )


def key_parts(key: str) -> list[str]:
    """``rewards[1].kwargs.api_key`` and ``rewards.1.kwargs.api_key`` → ``["rewards", "1", "kwargs", "api_key"]``."""
    return [p for p in re.split(r"\.|\[|\]", key.strip()) if p]


def _parsed(raw: str) -> Any:
    """The value of ``key=raw`` as the command line gives it (YAML: ``4`` an int, ``{a: 1}`` a mapping)."""
    value = OmegaConf.from_dotlist([f"value={raw}"])["value"]
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _list_index(base: Any, parts: list[str], key: str, known: tuple[str, ...]) -> int | None:
    """The position in ``parts`` of an index into a list that ``base`` holds on the way to ``key`` (``rewards.1…``:
    1), or None when the key goes through no list; an index the list does not have, or a list of the schema (``known``)
    that is null here, is a ConfigError naming the key and saying to give the whole list. The value is never shown (it
    may be a secret)."""
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        node = OmegaConf.select(base, prefix, default=None, throw_on_missing=False)
        if isinstance(node, ListConfig):
            if parts[i].isdigit() and int(parts[i]) < len(node):
                return i
            what = f"{len(node)} items" if len(node) != 1 else "1 item"
            index = f"{prefix}.0" if len(node) == 1 else f"{prefix}.0 … {prefix}.{len(node) - 1}"
            rest = ".".join(parts[i + 1 :] if parts[i].isdigit() else parts[i:]) or "…"
            raise ConfigError(
                f"{key}=… : {prefix} is a list of {what} here, and {parts[i]!r} is not the index of one; index one "
                f"({index}, e.g. {prefix}.0.{rest}=…), or give the whole list: {prefix}=[…]"
            )
        if node is None and parts[i].isdigit() and prefix in known:
            raise ConfigError(
                f"{key}=… : {prefix} is null here, so it has no item {parts[i]}; give the whole list: {prefix}=[…]"
            )
        if not isinstance(node, DictConfig):
            return None
    return None


def apply_overrides(base: Any, overrides: list[str], schema: type, layers: list | None = None) -> Any:
    """``base`` (not changed) merged with ``layers`` (the file's tree) and then the ``key=value`` ``overrides`` in
    order, each key checked (:func:`check_keys`). A key may index into a list the config holds
    (``rewards.1.kwargs.api_key=…`` or ``rewards[1]…``: the list as the file and the earlier overrides left it), and a
    section takes a mapping, not a value (:func:`check_section_value`); a string key keeps its text as written
    (:func:`keep_strings_as_written`). Overrides that index no list are merged together (a merge copies the config)."""
    pending, out = list(layers or []), base
    lists = list_keys(schema)
    for item in overrides:
        key, raw = item.split("=", 1)
        parts = key_parts(key)
        if any(
            ".".join(parts[:i]) in lists for i in range(1, len(parts))
        ):  # into a list: as the layers so far leave it
            out, pending = OmegaConf.merge(out, *pending), []  # a copy: the schema's defaults are shared
            index = _list_index(out, parts, key.strip(), known_keys(schema))
            if index is not None:  # the item it names updated in place, the list kept whole
                check_keys([".".join(parts[:index])], "", schema)
                OmegaConf.update(out, ".".join(parts), _parsed(raw), merge=True)
                continue
        check_keys([key.strip()], "", schema)
        value = _parsed(raw)
        check_section_value(".".join(parts), value, "", schema)
        check_list_value(".".join(parts), value, "", schema)
        pending.append(OmegaConf.from_dotlist([item]))
    if pending:
        out = OmegaConf.merge(out, *pending)
    if overrides:
        keep_strings_as_written(out, overrides)
    return out
