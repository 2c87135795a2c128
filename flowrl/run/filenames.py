"""File names made from user text (prompts): one path component, never a path the text chose.

    names = FileNamer(out)                      # out: the folder every name stays inside
    path = names.path("000", "../two red/circles", ".png")   # out/000-two_red_circles.png, checked inside out

A name keeps letters, digits, ``-``, ``_`` and ``.`` of the text (anything else becomes ``_``), never starts
with ``.`` (no hidden files, no ``..``), is cut to :data:`MAX_STEM` characters, and gets a counter (``-2``,
``-3``, …) when it clashes with a name made before or a file already in the folder: existing files are never
overwritten. Every path is resolved and checked to lie directly inside the folder before it is handed out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowrl.errors import shown

MAX_STEM = 60  # characters of the text kept in a name (a name stays far below the 255 bytes file systems allow)
_UNSAFE = re.compile(r"[^\w.\-]+", re.UNICODE)  # path separators, spaces, quotes, control characters, …


def slug(text: str, limit: int = MAX_STEM, fallback: str = "image") -> str:
    """``text`` as one safe path component of at most ``limit`` characters (``fallback`` when nothing is left)."""
    name = _UNSAFE.sub("_", str(text)).strip("._-")
    name = re.sub(r"\.{2,}", ".", name)  # no '..' anywhere, even inside a component
    name = name[:limit].rstrip("._-")
    return name or fallback


def unique_names(texts: list[str], limit: int = MAX_STEM, fallback: str = "item") -> list[str]:
    """One folder or file name per text (labels, config names): :func:`slug` of at most ``limit`` characters
    (``fallback`` when nothing is left), and ``-2``, ``-3``, … where it would repeat an earlier one (compared
    case-insensitively), so no two texts share a name."""
    made, out = set(), []
    for text in texts:
        stem = slug(text, limit, fallback)
        name, n = stem, 1
        while name.lower() in made:
            n += 1
            name = f"{stem}-{n}"
        made.add(name.lower())
        out.append(name)
    return out


class FileNamer:
    """Hands out paths of new files directly inside ``folder``, each name made by :func:`slug` and unique."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._made: set[str] = set()

    def path(self, prefix: str, text: str, suffix: str) -> Path:
        """``folder / "<prefix>-<slug(text)><suffix>"`` (just ``<slug(text)><suffix>`` for an empty prefix), with a
        counter when that name was made before or exists; raises ValueError for a path outside ``folder``."""
        stem = "-".join(p for p in (slug(prefix, 20) if prefix else "", slug(text)) if p)
        name, n = f"{stem}{suffix}", 1
        while name.lower() in self._made or os.path.lexists(self.folder / name):  # lower: case-insensitive file systems
            n += 1
            name = f"{stem}-{n}{suffix}"
        path = self.folder / name
        root = self.folder.resolve()
        if path.resolve().parent != root or path.name != name or len(path.parts) != len(self.folder.parts) + 1:
            raise ValueError(f"file name {shown(name)} made from {shown(text, 80)} would not lie inside {root}")
        self._made.add(name.lower())
        return path
