"""``metrics.jsonl`` of a run folder: one JSON object per iteration or eval, appended; cut back to a checkpoint's
step on resume (:mod:`flowrl.run.folder` opens it)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends JSON lines to ``path``; on resume keeps only lines with ``step <= resume_step``."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            kept = [json.dumps(r) for r in self.read() if r.get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (float(v) if hasattr(v, "item") else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """The records; a line that is not a JSON object (torn by a kill mid-write) is skipped with a warning
        naming the file and line."""
        if not self.path.exists():
            return []
        records = []
        for i, line in enumerate(self.path.read_text(errors="replace").splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                warnings.warn(
                    f"{self.path} line {i + 1} is not a metrics record (torn by an interrupted write?); skipped",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            records.append(record)
        return records
