"""The GPU check's report (scripts/gpu_check.py): ``gpu_check.json`` and ``gpu_check.md``, rewritten after every row
so that a killed run leaves what it measured. The layout (a table per part, its columns and title, and any tables
a part adds below its own) is the subclass's: :class:`Report`'s ``titles``, ``columns`` (a table per part, or one
per kind of row: :meth:`Report.tables`) and ``extras``."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path


def fmt(value) -> str:
    """A table cell: — for None, yes/no, thousands separators, 3 significant digits, ranges as a–b."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return "–".join(fmt(v) for v in value)
    return str(value)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """A Markdown table of ``rows`` (``columns``: header, row key), each row's status (and error) last."""
    out = ["| " + " | ".join(h for h, _ in columns) + " | status |", "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        status = row.get("status", "ok") + (f": {row['error']}" if row.get("error") else "")
        out.append("| " + " | ".join(fmt(row.get(key)) for _, key in columns) + f" | {status} |")
    return out


class Report:
    """The JSON (docs/gpu.md: its structure) and the Markdown of every part, rewritten after every row."""

    titles: dict[str, str] = {}
    columns: dict[str, list[tuple[str, str]]] = {}
    extras: dict = {}
    """part → ``function(rows) -> lines``: Markdown printed under the part's table."""

    def __init__(self, out: str | Path, meta: dict, parts: list[str]):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {
            "schema": 1,
            "meta": meta,
            "parts": {p: {"status": "pending", "seconds": 0.0, "allotted_seconds": 0.0, "rows": []} for p in parts},
        }

    def add(self, part: str, row: dict) -> None:
        self.data["parts"][part]["rows"].append(row)
        self.write()

    def rows(self, part: str) -> list[dict]:
        return self.data["parts"].get(part, {}).get("rows", [])

    def close_part(self, part: str, seconds: float, allotted: float, error: str | None = None) -> None:
        entry = self.data["parts"][part]
        statuses = {r.get("status") for r in entry["rows"]}
        entry["status"] = "failed" if error else "ok" if statuses == {"ok"} else "empty" if not statuses else "partial"
        entry.update(seconds=round(seconds, 1), allotted_seconds=round(allotted, 1))
        if error:
            entry["error"] = error
        self.write()

    @staticmethod
    def tables(rows: list[dict], columns) -> list[str]:
        """A part's own table: ``columns`` a list of (header, key); or one table per kind of row, ``columns`` then
        ``{kind: (caption, [(header, key), ...])}`` in order, a row going to its ``row["kind"]``'s table (to the first
        one when it names none of them: a row that failed before saying what it was)."""
        if not isinstance(columns, dict):
            return table(rows, columns) + [""]
        first = next(iter(columns))
        lines = []
        for kind, (caption, cols) in columns.items():
            own = [r for r in rows if (r.get("kind") if r.get("kind") in columns else first) == kind]
            if own:
                lines += [caption, ""] + table(own, cols) + [""]
        return lines

    def write(self) -> None:
        self.data["meta"]["written"] = now()
        for name, text in (
            ("gpu_check.json", json.dumps(self.data, indent=2, default=str, allow_nan=True)),
            ("gpu_check.md", self.markdown()),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text + "\n")
            tmp.replace(self.out / name)

    def markdown(self) -> str:
        m = self.data["meta"]
        lines = [
            f"# GPU check{' (--tiny, CPU)' if m['tiny'] else ''}",
            "",
            f"device: {m['device']}; torch {m['torch']} (CUDA {m['cuda']}); commit {m['commit']}; "
            f"started {m['started']}; budget {m['minutes']:g} min; bf16 peak taken as {m['peak_tflops']:g} TFLOP/s",
            "",
        ]
        if m["tiny"]:
            lines += [
                "--tiny: the architectures shrunk, on the CPU; peak GiB is the process's peak RSS, not comparable "
                "with the estimate.",
                "",
            ]
        for part, entry in self.data["parts"].items():
            lines += [
                f"## {self.titles.get(part, part)}",
                "",
                f"status: {entry['status']}; {entry['seconds']:.0f} s of {entry['allotted_seconds']:.0f} s allotted"
                + (f"; {entry['error']}" if entry.get("error") else ""),
                "",
            ]
            lines += self.tables(entry["rows"], self.columns[part])
            if part in self.extras:
                lines += self.extras[part](entry["rows"]) + [""]
        return "\n".join(lines)
