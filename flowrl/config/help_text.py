"""The text of the keys' help, below :mod:`flowrl.config.help` and :mod:`flowrl.config.reward_help`: the marks of a key
without help or without a default, a docstring's text on one line, the ``name``: entries a docstring documents names
with, a field's default and a value as one line of YAML."""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Any

import yaml
from omegaconf import MISSING as OMEGACONF_MISSING

NO_HELP = "(no help yet)"
"""The help of a component field that documents itself nowhere (its field metadata, comment and docstrings)."""

REQUIRED = "(required)"
"""The default column of a key without a default (``rewards[i].name``)."""


def one_line(text: str) -> str:
    """``text`` on one line: whitespace collapsed, Sphinx roles and double backticks reduced to single backticks."""
    text = re.sub(r":(?:class|mod|func|meth|attr|data|obj):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


def field_default(f: dataclasses.Field) -> Any:
    """The default of dataclass field ``f`` (a ``default_factory``'s value; :data:`REQUIRED` where it has none)."""
    if f.default is not dataclasses.MISSING:
        return REQUIRED if f.default is OMEGACONF_MISSING else f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def inline(value: Any) -> str:
    """``value`` as one line of YAML (flow style): ``null``, ``'off'``, ``[0.9, 0.999]``, ``{mode: strict}``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, allow_unicode=True, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


_NAME = r"``\w+``"
_LABEL = re.compile(
    rf"(?<![\w`])((?:{_NAME}\s*(?:/|,|and|or)\s*)*{_NAME})"
    r"(?:\s*\[[^\]\n]*\])?(?:\s*\((?:[^()\n]|\([^()\n]*\))*\))?\s*:\s"
)
"""A docstring entry's label: ``name``: (or ``a``/``b``:, ``a``, ``b``:), with an optional [default] or
(remark) before the colon."""


@lru_cache(maxsize=None)
def doc_entries(doc: str, values: frozenset[str] = frozenset()) -> dict[str, str]:
    """Name → the text of the docstring entry that documents it (``name``: text, up to the end of its sentence, the
    next entry or the paragraph); the first entry of a name wins. A label naming only ``values`` (a field's choices)
    documents a value, not a key: it is no entry and ends none."""
    out: dict[str, str] = {}
    for m in _LABEL.finditer(doc):
        names = re.findall(r"``(\w+)``", m.group(1))
        if set(names) <= values or not _starts_entry(doc, m.start()):
            continue
        text = one_line(_entry(doc, m.end(), values)).rstrip(";,")
        if text.endswith(".") and not text.endswith(".."):
            text = text[:-1]
        if not text:
            continue
        for name in names:
            out.setdefault(name, text)
    return out


def _starts_entry(doc: str, at: int) -> bool:
    """Whether a label at ``at`` begins an entry: at the start of the text or of a paragraph, or after ``.``, ``;``,
    ``:``, ``(`` or a list's ``-`` (not inside a sentence, as in "Replay ``source`` (a store): ...")."""
    before = doc[:at]
    stripped = before.rstrip()
    return not stripped or stripped[-1] in ".;:(-" or bool(re.search(r"\n[ \t]*\n[ \t]*$", before))


def _entry(doc: str, start: int, values: frozenset[str]) -> str:
    """The text from ``start`` to the end of its sentence (outside brackets), the next ``; ``name``:`` entry, a
    paragraph's end or a list item."""
    depth, i = 0, start
    while i < len(doc):
        ch = doc[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # the entry sat inside brackets: it ends with them
                break
            depth -= 1
        elif ch == "\n" and re.match(r"\n\s*(\n|- )", doc[i:]):
            break
        elif depth == 0 and ch in ".;" and (i + 1 == len(doc) or doc[i + 1].isspace()):
            rest = doc[i + 1 :].lstrip()
            if ch == "." and (not rest or rest[0].isupper() or rest.startswith("``")):
                break
            label = _LABEL.match(rest)
            if ch == ";" and label and not set(re.findall(r"``(\w+)``", label.group(1))) <= values:
                break
        i += 1
    return doc[start:i]
