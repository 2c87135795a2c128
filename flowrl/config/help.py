"""Help on every config key: what ``flowrl train [CONFIG] --help`` prints beside each key's value, and the key table of
docs/keys.md, both from one source.

Where a key's help lives:

- the schema's own sections (``model``, ``rewards``, ``optim``, ``prompts``, ``eval``, ``train``; flowrl/config/
  model_section.py and sections.py): ``field(..., metadata={"help": ...})`` on each field, as TRL's config
  dataclasses carry theirs;
- the component sections (``rollout``, ``credit``, ``loss``), whose keys are the chosen plan's, credit rule's or
  objective's dataclass fields (:mod:`flowrl.core.components`): a field's ``metadata={"help": ...}`` when it has one,
  else the comment beside the field in its class's source, else the entry of its class's docstring (or of its
  module's docstring) that documents it as ``name``: text; :data:`NO_HELP` where none does. The selector keys
  (``rollout.plan``, ``credit.rule``, ``loss.objective``) and the loop's own keys (``rollout.max_batch``,
  ``rollout.chunks``) take theirs from :data:`LOOP_HELP` here.

:func:`annotated_yaml` is a config's YAML exactly as ``TrainConfig.to_yaml`` writes it (every value as today, the
rewards' secrets redacted), with ``# help`` added after each key; :mod:`flowrl.config.key_table` writes docs/keys.md
from the same help. The help of each reward's settings (the keys of ``rewards[i].kwargs``) lives on the reward:
:mod:`flowrl.config.reward_help` says where. :mod:`flowrl.config.help_text` holds what both read docstrings with.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Union

import yaml

from flowrl.config.help_text import NO_HELP, doc_entries, field_default, one_line
from flowrl.config.reward_help import catalogue, term_notes
from flowrl.config.sections import RewardTerm
from flowrl.core import components
from flowrl.core.choices import choices_of

LOOP_HELP: dict[str, str] = {
    "rollout.max_batch": "states per model forward; training replays the same layout",
    "rollout.chunks": "roll out the groups in parts, scoring each while the next rolls out",
}
"""Help of the keys the loop owns in a component section (:attr:`flowrl.core.components.Kind.loop_keys`)."""

WHAT = {"rollout": "rollout plan", "credit": "credit rule", "loss": "objective"}


def selector_help(kind: components.Kind, names: list[str] | None = None) -> str:
    """The help of a component section's selector key (``rollout.plan``, ``credit.rule``, ``loss.objective``), naming
    ``names`` (default: every name registered now)."""
    names = " | ".join(names if names is not None else [name for name, _ in kind.registry.items()])
    return (
        f"the {WHAT.get(kind.section, kind.section)}: a registered name ({names}), package.module:Class or "
        f"path/to/file.py:Class; the section's other keys are its fields"
    )


# ---- one key's help ---------------------------------------------------------------------------------------------
def _help_of(f: dataclasses.Field) -> str | None:
    text = f.metadata.get("help") if f.metadata else None
    return one_line(text) if text else None


def field_help(owner: type, name: str) -> str:
    """The help of field ``name`` of the dataclass ``owner``: its ``metadata["help"]``; else, walking ``owner``'s
    classes (the most derived first), the comment beside the field where a class declares it, or the class
    docstring's ``name``: entry; else a module docstring's entry; else :data:`NO_HELP`. A docstring's entry of a
    class above the one that declares the field last loses its final ``[default]`` (the default may differ here)."""
    fields = {f.name: f for f in dataclasses.fields(owner)}
    text = _help_of(fields[name])
    if text:
        return text
    values = frozenset(str(v) for f in fields.values() for v in choices_of(f) or ())  # choices, not keys
    classes = [k for k in owner.__mro__ if k is not object]
    declared = next((k for k in classes if name in vars(k).get("__annotations__", {})), owner)
    for klass in classes:
        if name in vars(klass).get("__annotations__", {}):
            text = _source_comments(klass).get(name)
            if text:
                return text
        text = doc_entries(klass.__doc__ or "", values).get(name)
        if text:
            return text if klass is declared or classes.index(klass) < classes.index(declared) else _undefaulted(text)
    for module in dict.fromkeys(sys.modules.get(k.__module__) for k in classes):
        text = doc_entries(module.__doc__ or "", values).get(name) if module is not None else None
        if text:
            return _undefaulted(text)
    return NO_HELP


def _undefaulted(text: str) -> str:
    """``text`` without a final ``[default]`` note (a number or a literal in brackets, e.g. ``[2]``)."""
    return re.sub(r"\s*\[(?:[-\d`'\"]|None|True|False|null)[^\]]*\]$", "", text) or text


@lru_cache(maxsize=None)
def _source_comments(klass: type) -> dict[str, str]:
    """Field name → the comment beside its declaration in ``klass``'s body (with the comment-only lines that continue
    it at the same indentation), read with :mod:`tokenize`; empty when the source cannot be read."""
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(_dedent(source)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return {}
    out: dict[str, str] = {}
    depth, start, i = 0, True, 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT):
            start = start or tok.type != tokenize.COMMENT
        elif start and depth == 1 and tok.type == tokenize.NAME and _is_op(tokens, i + 1, ":"):
            name, column, comments = tok.string, tok.start[1], []
            while i < len(tokens) and tokens[i].type != tokenize.NEWLINE:  # the statement's own comments
                if tokens[i].type == tokenize.COMMENT:
                    comments.append(tokens[i].string)
                i += 1
            while comments and i + 2 < len(tokens):  # comment-only lines that go on at the field's indentation
                nxt = tokens[i + 1]
                if nxt.type != tokenize.COMMENT or nxt.start[1] != column or nxt.string.startswith("# --"):
                    break
                comments.append(nxt.string)
                i += 2  # the comment and its NL
            text = one_line(" ".join(c.lstrip("#").strip() for c in comments))
            if text:
                out[name] = text
            start = True
            i += 1
            continue
        else:
            start = False
        i += 1
    return out


def _dedent(source: str) -> str:
    """``source`` (a class's, maybe nested) moved left by its first line's indentation."""
    lines = source.splitlines(keepends=True)
    indent = len(lines[0]) - len(lines[0].lstrip())
    if not indent:
        return source
    return "".join(
        "\n" if not line.strip() else line[indent:] if line[:indent].isspace() else line.lstrip() for line in lines
    )


def _is_op(tokens: list[tokenize.TokenInfo], i: int, op: str) -> bool:
    return i < len(tokens) and tokens[i].type == tokenize.OP and tokens[i].string == op


# ---- the members of a section -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    """A component section: ``kind``'s section when it selects ``cls`` (its registered ``name``)."""

    kind: components.Kind
    name: str
    cls: type


@dataclass(frozen=True)
class Member:
    """One key of a section: its help, its type (for the keys below it) and its default."""

    help: str
    type: Any
    default: Any


def members(owner: Any) -> dict[str, Member]:
    """Key → :class:`Member` of a section: a :class:`Component` (its selector, the loop's keys, then the component's
    fields) or a dataclass (its fields; a TrainConfig's component sections are found from their types, see
    :func:`config_members`)."""
    if isinstance(owner, Component):
        kind, cls = owner.kind, owner.cls
        out = {kind.selector: Member(selector_help(kind), str, owner.name)}
        for key, typ, default in kind.loop_keys:
            out[key] = Member(LOOP_HELP.get(f"{kind.section}.{key}", NO_HELP), typ, default)
        hints = _hints(cls)
        for f in components.component_fields(cls):
            out[f.name] = Member(field_help(cls, f.name), hints.get(f.name, Any), field_default(f))
        return out
    hints = _hints(owner)
    return {
        f.name: Member(field_help(owner, f.name), hints.get(f.name, Any), field_default(f))
        for f in dataclasses.fields(owner)
    }


def config_members(cfg: Any = None) -> dict[str, Member]:
    """The top-level keys of a config (``cfg``, or the schema's defaults): each section's help from
    :class:`~flowrl.config.schema.TrainConfig`'s own fields, the component sections as the :class:`Component` that
    ``cfg`` selects (the defaults' when None)."""
    from flowrl.config.schema import TrainConfig

    out = members(TrainConfig)
    for kind in components.KINDS:
        name = getattr(getattr(cfg, kind.section), kind.selector) if cfg is not None else kind.default
        member = out[kind.section]
        out[kind.section] = Member(member.help, Component(kind, name, components.resolve(kind, name)), member.default)
    return out


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 — an unresolvable annotation: its keys are listed without the keys below them
        return {}


def below_of(typ: Any) -> tuple[Any, bool]:
    """(the section a key's value holds — a dataclass or a :class:`Component` — or None, whether it is a list of
    them) from the key's type (``Optional[...]`` and ``list[...]`` unwrapped)."""
    if isinstance(typ, Component):
        return typ, False
    origin = typing.get_origin(typ)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return below_of(args[0]) if len(args) == 1 else (None, False)
    if origin is list:
        args = typing.get_args(typ)
        inner, _ = below_of(args[0]) if args else (None, False)
        return inner, inner is not None
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):
        return typ, False
    return None, False


# ---- flowrl train --help ------------------------------------------------------------------------------------------
def annotated_yaml(cfg: Any) -> str:
    """``cfg.to_yaml()`` (every value as ``flowrl train --help`` printed it, the secrets redacted) with each key's help
    after it as a YAML comment (``  # help``; before the key, on a line of its own, where the value spans lines), the
    top-level sections' own lines (``model:``) left bare, and the keys of each reward term's ``kwargs`` helped too
    (:mod:`flowrl.config.reward_help`); then, as comments, every reward's settings with their defaults and help
    (:func:`~flowrl.config.reward_help.catalogue`): still YAML, and the same YAML."""
    text = cfg.to_yaml()
    root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    after: dict[int, str] = {}
    before: dict[int, str] = {}
    for key, value, note in _notes(root, config_members(cfg)):
        line = key.start_mark.line
        if key.start_mark.column == 0 and isinstance(value, yaml.MappingNode):
            continue  # a top-level section's line stays ``model:`` (its help: docs/keys.md)
        if isinstance(value, yaml.ScalarNode) and value.end_mark.line > line:
            before[line] = note
        else:
            after[line] = note
    out = []
    for i, line in enumerate(text.split("\n")):
        if i in before:
            out.append(f"{line[: len(line) - len(line.lstrip())]}# {before[i]}")
        out.append(f"{line}  # {after[i]}" if i in after else line)
    return "\n".join(out[:-1] + catalogue() + out[-1:])  # the list of every reward's settings, before the last "\n"


def _notes(node: Any, keys: dict[str, Member]) -> list[tuple[Any, Any, str]]:
    """(key node, value node, help) of every key of a composed mapping ``node`` whose section is ``keys``, and of the
    keys below them."""
    out: list[tuple[Any, Any, str]] = []
    if not isinstance(node, yaml.MappingNode):
        return out
    for key, value in node.value:
        member = keys.get(key.value)
        if member is None:
            continue
        out.append((key, value, member.help))
        section, is_list = below_of(member.type)
        if section is None:
            continue
        below = members(section)
        for item in value.value if is_list and isinstance(value, yaml.SequenceNode) else [] if is_list else [value]:
            out += _notes(item, below)
            out += term_notes(item) if section is RewardTerm else []  # its kwargs: the reward's settings
    return out
