"""Help on every reward's settings (the keys of ``rewards[i].kwargs`` and ``eval.rewards[i].kwargs``): what ``flowrl
train --help`` prints beside each setting a config gives and in its list of every reward's settings, and the tables
"rewards[i].kwargs by reward name" of docs/keys.md, from one source.

A reward's settings are its constructor's keywords, or its ``Settings`` dataclass's fields
(:func:`flowrl_rewards.core.registry.settings_of`). A setting's help is the first found of:

- its ``Settings`` field's ``metadata={"help": ...}`` (the setting's ``note``);
- the comment beside the keyword in the constructor's signature (``mode: str = "strict",  # ...``; comment-only
  lines below it, before the next keyword, go on with it);
- its entry in a ``kwargs:`` section of the docstring of the reward's class or a base (``name: text``, the lines
  indented below it going on with it; ``a / b: text`` and ``a, b: text`` document both);
- a ``name``: entry of those docstrings (as :func:`flowrl.config.help.field_help` reads them);
- else :data:`~flowrl.config.help_text.NO_HELP`.

A setting that nests reward terms (``gdro_corrected``'s ``reward`` and ``quality``, each ``{name, kwargs}``) is one the
reward declares in ``nested_terms`` (with whether it takes a list of them), the declaration the key check reads too
(:func:`flowrl_rewards.core.registry.check_reward_kwargs`). The term's keys follow the setting, with the help of a
reward term's own (:class:`flowrl.config.sections.RewardTerm`).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import yaml

from flowrl.config.help_text import NO_HELP, REQUIRED, doc_entries, field_default, inline, one_line
from flowrl.config.sections import RewardTerm


@dataclass(frozen=True)
class SettingHelp:
    """One key below a reward term's ``kwargs``: ``mode``, a nested term's ``reward.name`` or ``quality[j].kwargs``;
    its default (:data:`~flowrl.config.help_text.REQUIRED` when it must be given) and its help."""

    key: str
    default: Any
    help: str


# ---- the rewards ----------------------------------------------------------------------------------------------------
def reward_names(builtin: bool = False) -> list[str]:
    """The names registered now (``builtin``: only those whose target is the package's own, a ``flowrl_rewards.…``
    class, so a reward registered from outside leaves docs/keys.md alone), sorted."""
    from flowrl_rewards.core.registry import REGISTRY

    out = []
    for name, target in REGISTRY.items():
        module = target.partition(":")[0] if isinstance(target, str) else getattr(target, "__module__", "")
        if not builtin or module.startswith("flowrl_rewards."):
            out.append(name)
    return sorted(out)


def reward_class(name: str) -> type | None:
    """The reward class ``name`` (a registered name, ``module:Class`` or ``file.py:Class``) imports, or None when it
    does not resolve (the load check names why)."""
    from flowrl.core.registry import LOAD_ERRORS
    from flowrl_rewards.core.registry import resolve_reward_class

    try:
        return resolve_reward_class(str(name))
    except (KeyError, *LOAD_ERRORS):
        return None


# ---- one setting's help ---------------------------------------------------------------------------------------------
def setting_help(cls: type, setting: Any) -> str:
    """The help of ``setting`` (a :class:`~flowrl_rewards.core.registry.RewardSetting`) of reward class ``cls``: its
    note, the comment beside it in the constructor, its ``kwargs:`` entry or ``name``: entry of a docstring of ``cls``
    or a base; else NO_HELP."""
    if setting.note:
        return one_line(setting.note)
    text = _signature_comments(cls).get(setting.name)
    if text:
        return text
    from flowrl_rewards.core.base import Reward

    docs = [k.__doc__ or "" for k in cls.__mro__ if k not in Reward.__mro__]
    for read in (_kwargs_entries, doc_entries):
        for doc in docs:
            text = read(doc).get(setting.name)
            if text:
                return text
    return NO_HELP


@lru_cache(maxsize=None)
def _signature_comments(cls: type) -> dict[str, str]:
    """Keyword → the comments after it in the signature of the constructor ``cls`` runs (up to the next keyword),
    read with :mod:`tokenize`; empty when the source cannot be read."""
    owner = next((k for k in cls.__mro__ if "__init__" in vars(k)), object)
    try:
        source = textwrap.dedent(inspect.getsource(vars(owner)["__init__"]))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return {}
    out: dict[str, list[str]] = {}
    depth, name, starts = 0, None, False
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
            starts = depth == 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1 and tok.type == tokenize.OP and tok.string == ",":
            starts = True
        elif depth == 1 and starts and tok.type == tokenize.NAME:
            name, starts = tok.string, False
            out[name] = []
        elif tok.type == tokenize.COMMENT and name is not None:
            out[name].append(tok.string.lstrip("#").strip())
    return {k: one_line(" ".join(v)) for k, v in out.items() if v}


_KWARGS = re.compile(r"^([ \t]*)kwargs:[ \t]*$", re.M)
_ITEM = re.compile(r"(\w+(?:\s*(?:/|,)\s*\w+)*):\s+(\S.*)")


@lru_cache(maxsize=None)
def _kwargs_entries(doc: str) -> dict[str, str]:
    """Name → its entry in ``doc``'s ``kwargs:`` section (a Google-style list: ``name: text`` at one indentation, the
    lines indented deeper going on with it; the section ends at a blank or a less indented line)."""
    m = _KWARGS.search(doc)
    if not m:
        return {}
    out: dict[str, str] = {}
    column, names, text = None, [], []
    for line in doc[m.end() :].split("\n")[1:]:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent <= len(m.group(1)) or (column is not None and indent < column):
            break
        item = _ITEM.fullmatch(line.strip()) if column in (None, indent) else None
        if item:
            _add(out, names, text)
            column, names, text = indent, re.split(r"\s*(?:/|,)\s*", item.group(1)), [item.group(2)]
        elif column is not None and indent > column:
            text.append(line.strip())
        else:
            break
    _add(out, names, text)
    return out


def _add(out: dict[str, str], names: list[str], text: list[str]) -> None:
    entry = one_line(" ".join(text))
    entry = entry[:-1] if entry.endswith(".") and not entry.endswith("..") else entry
    for name in names:
        out.setdefault(name, entry)


# ---- the keys of a reward's kwargs ----------------------------------------------------------------------------------
def nested_terms(cls: type) -> dict[str, bool]:
    """Setting → whether it takes a list of terms, for each setting of reward class ``cls`` that nests reward terms
    (what the class declares: :attr:`flowrl_rewards.Reward.nested_terms`)."""
    return dict(getattr(cls, "nested_terms", {}))


def term_keys() -> dict[str, SettingHelp]:
    """The keys of a nested term (:data:`~flowrl_rewards.core.registry.TERM_FORM`) with their defaults and help: a
    reward term's (its ``name``),
    and for its ``kwargs`` the settings of the reward it names."""
    from flowrl_rewards.core.registry import TERM_FORM

    fields = {f.name: f for f in dataclasses.fields(RewardTerm)}
    helps = {
        "name": one_line(fields["name"].metadata["help"]),
        "kwargs": "the settings of the reward it names (that reward's keys of rewards[i].kwargs, not the combiner's)",
    }
    return {k: SettingHelp(k, field_default(fields[k]), helps[k]) for k in TERM_FORM}


def reward_keys(cls: type) -> list[SettingHelp]:
    """Every key below a term's ``kwargs`` for reward class ``cls``: each setting with its default and help, a setting
    that nests terms followed by the term's keys (``reward.name``, ``quality[j].kwargs``)."""
    from flowrl_rewards.core.registry import settings_of

    nested = nested_terms(cls)
    out = []
    for s in settings_of(cls).own:
        out.append(SettingHelp(s.name, REQUIRED if s.required else s.default, setting_help(cls, s)))
        if s.name in nested:
            prefix = f"{s.name}[j]" if nested[s.name] else s.name
            out += [dataclasses.replace(k, key=f"{prefix}.{k.key}") for k in term_keys().values()]
    return out


def combiner_keys() -> list[SettingHelp]:
    """The keys every term's ``kwargs`` takes beside its reward's: the combiner's (``frame_stride``)."""
    from flowrl_rewards.core.registry import TERM_KWARGS

    return [SettingHelp(s.name, s.default, one_line(s.note) or NO_HELP) for s in TERM_KWARGS]


# ---- flowrl train --help --------------------------------------------------------------------------------------------
CATALOGUE = "# ---- rewards[i].kwargs by reward name"
"""The first line of :func:`catalogue`."""


def catalogue() -> list[str]:
    """The help's list of every reward registered now with its settings, their defaults and help: YAML comments."""
    combiner = "; ".join(f"{k.key}: {inline(k.default)} ({k.help})" for k in combiner_keys())
    out = [
        f"{CATALOGUE} (eval.rewards[i].kwargs too): each reward's settings, default and help (docs/keys.md);",
        f"# every term's kwargs also take {combiner}:",
    ]
    bare = []
    for name in reward_names():
        cls = reward_class(name)
        rows = reward_keys(cls) if cls is not None else []
        if cls is not None and not rows:
            bare.append(name)
            continue
        where = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else "does not import"
        out.append(f"#   {name} ({where}):")
        out += [f"#     {r.key}: {r.default if r.default == REQUIRED else inline(r.default)}  # {r.help}" for r in rows]
    if bare:
        out.append(f"#   {', '.join(bare)}: no settings")
    return out


def kwargs_notes(name: Any, node: Any) -> list[tuple[Any, Any, str]]:
    """(key node, value node, help) of each key of the composed mapping ``node``, the ``kwargs`` of a term naming
    reward ``name``, and of the keys of the terms its settings nest; none when ``name`` does not resolve."""
    cls = reward_class(name) if isinstance(name, str) else None
    if cls is None or not isinstance(node, yaml.MappingNode):
        return []
    from flowrl_rewards.core.registry import settings_of

    helps = {k.key: k.help for k in combiner_keys()}
    helps.update({s.name: setting_help(cls, s) for s in settings_of(cls).own})
    nested, term = nested_terms(cls), term_keys()
    out = []
    for key, value in node.value:
        out.append((key, value, helps.get(key.value, NO_HELP)))
        for item in (value.value if isinstance(value, yaml.SequenceNode) else [value]) if key.value in nested else []:
            if isinstance(item, yaml.MappingNode):  # (not a bare reward name)
                out += [(k, v, term[k.value].help) for k, v in item.value if k.value in term]
                out += term_notes(item)
    return out


def term_notes(item: Any) -> list[tuple[Any, Any, str]]:
    """:func:`kwargs_notes` of the composed reward term ``item`` (a mapping with ``name`` and ``kwargs``)."""
    keys = {k.value: v for k, v in item.value} if isinstance(item, yaml.MappingNode) else {}
    name = keys.get("name")
    return kwargs_notes(name.value if isinstance(name, yaml.ScalarNode) else None, keys.get("kwargs"))


__all__ = [
    "CATALOGUE",
    "SettingHelp",
    "catalogue",
    "combiner_keys",
    "kwargs_notes",
    "nested_terms",
    "reward_class",
    "reward_keys",
    "reward_names",
    "setting_help",
    "term_keys",
    "term_notes",
]
