"""The prompt sets `flowrl data` knows: where each comes from, how its files become prompt lines, the counts
and checksums it must meet, and which presets read it (:mod:`flowrl.prompts.fetch` fetches them)."""

from __future__ import annotations

import difflib
import json
import posixpath
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from flowrl.paths import CONFIG_DIR, shipped_name

SOURCE_ENV = "FLOWRL_DATA_SOURCE"
DEFAULT_OUT = "dataset"
MANIFEST = "manifest.json"


class DataError(ValueError):
    """A prompt set that cannot be produced as specified (bad name, count, checksum or source file)."""


class DataUnavailable(DataError):
    """Source files that could not be downloaded (or found under ``--source``); the message says which,
    from where, and where to put them."""


# ---- what a prompt set is -----------------------------------------------------------------------
@dataclass(frozen=True)
class Remote:
    """One source file: ``kind`` ``hub`` (a Hugging Face *dataset* repo; ``path`` may be a glob such as
    ``data/test-*.parquet``) or ``github`` (a file in a GitHub repository), at ``revision``."""

    kind: str
    repo: str
    path: str
    revision: str = "main"

    @property
    def is_glob(self) -> bool:
        return any(c in self.path for c in "*?[")

    @property
    def url(self) -> str:
        """Where a person downloads it (a folder page for a glob)."""
        if self.kind == "hub":
            base = f"https://huggingface.co/datasets/{self.repo}"
            if self.is_glob:
                return f"{base}/tree/{self.revision}/{posixpath.dirname(self.path)}"
            return f"{base}/resolve/{self.revision}/{self.path}"
        return f"https://raw.githubusercontent.com/{self.repo}/{self.revision}/{self.path}"

    @property
    def mirror(self) -> str:
        """Its path under a ``--source`` folder."""
        return f"{self.repo}/{self.path}"

    def label(self) -> str:
        where = "Hugging Face dataset" if self.kind == "hub" else "GitHub"
        return f"{where} {self.repo} @ {self.revision[:12]}: {self.path}"


@dataclass(frozen=True)
class Output:
    """One produced file under ``OUT/<name>/``: its exact line count (``count``; None: unknown, then at
    least ``min_count``) and, once known, the sha256 of its bytes."""

    file: str
    count: int | None
    min_count: int = 1
    sha256: str | None = None


@dataclass(frozen=True)
class PromptSet:
    """A named prompt set: its sources (by key), its outputs and the converter from the downloaded files
    (``{key: [paths]}``) to each output's lines (``{file: [line, ...]}``)."""

    name: str
    description: str
    remotes: dict[str, Remote]
    outputs: tuple[Output, ...]
    convert: Callable[[dict[str, list[Path]]], dict[str, list[str]]]
    needs: tuple[str, ...] = field(default=())  # importable modules the converter needs (checked first)


# ---- converters ---------------------------------------------------------------------------------
def clean_prompt(text: object) -> str | None:
    """One line of a prompt file: whitespace (newlines included) collapsed to single spaces; None for a
    non-string, an empty prompt or one starting with ``#`` (prompt files read such a line as a comment)."""
    if not isinstance(text, str):
        return None
    line = " ".join(text.split())
    return line if line and not line.startswith("#") else None


def unique(lines: Iterable[str | None]) -> list[str]:
    """Non-None ``lines`` without repeats, in first-seen order."""
    seen: set[str] = set()
    out = []
    for line in lines:
        if line is not None and line not in seen:
            seen.add(line)
            out.append(line)
    return out


def read_parquet_column(paths: list[Path], column: str) -> list:
    """Values of ``column`` over the parquet files ``paths``, in order (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading parquet files needs pyarrow: pip install pyarrow") from None
    values: list = []
    for path in paths:
        table = pq.read_table(path)
        if column not in table.column_names:
            raise DataError(f"{path}: no column {column!r}; its columns: {table.column_names}")
        values.extend(table.column(column).to_pylist())
    return values


def read_json_prompts(path: Path) -> list[object]:
    """The ``prompt`` of each record of a JSON list (HPDv2's ``train.json`` / ``test.json``)."""
    with open(path, encoding="utf-8") as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not JSON ({e})") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "prompt" in r for r in records):
        raise DataError(f"{path}: expected a JSON list of objects with a 'prompt' key")
    return [r["prompt"] for r in records]


def read_jsonl_records(path: Path) -> list[tuple[str, dict]]:
    """``(line, record)`` of each non-blank line of a JSONL file whose records hold a ``prompt``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {number}: not JSON ({e})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise DataError(f"{path}, line {number}: expected an object with a 'prompt' key")
            out.append((line.strip(), record))
    return out


PICKSCORE_TEST = 2048
PICKSCORE_MIN_SPACES = 5
PICKSCORE_SEED = 0


def convert_pickscore(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """Pick-a-Pic captions → unique prompts with >= 5 spaces, sorted then shuffled with
    ``random.Random(0)``: the first ``PICKSCORE_TEST`` are the test split, the rest the train split."""
    prompts = sorted(
        {
            p
            for p in map(clean_prompt, read_parquet_column(files["captions"], "caption"))
            if p is not None and p.count(" ") >= PICKSCORE_MIN_SPACES
        }
    )
    random.Random(PICKSCORE_SEED).shuffle(prompts)
    return {"test.txt": prompts[:PICKSCORE_TEST], "train.txt": prompts[PICKSCORE_TEST:]}


def convert_hpdv2(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """HPDv2: test prompts in file order; unique train prompts in first-seen order, minus test prompts."""
    test = [clean_prompt(p) for p in read_json_prompts(files["test"][0])]
    test = [p for p in test if p is not None]
    held_out = set(test)
    train = [p for p in unique(map(clean_prompt, read_json_prompts(files["train"][0]))) if p not in held_out]
    return {"test.txt": test, "train.txt": train}


def convert_geneval(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """GenEval metadata JSONL → prompts and the metadata line of each (same order; its ``prompt`` is the
    written one); the train split loses repeats and every test prompt."""
    out: dict[str, list[str]] = {}
    held_out: set[str] = set()
    for split in ("test", "train"):
        prompts, lines = [], []
        for line, record in read_jsonl_records(files[split][0]):
            p = clean_prompt(record["prompt"])
            if p is None or (split == "train" and p in held_out):
                continue
            if split == "train":
                held_out.add(p)
            prompts.append(p)
            lines.append(line if p == record["prompt"] else json.dumps({**record, "prompt": p}))
        if split == "test":
            held_out = set(prompts)
        out[f"{split}.txt"], out[f"{split}_metadata.jsonl"] = prompts, lines
    return out


def convert_drawbench(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """DrawBench: the ``prompts`` column in order (its 200 rows; repeats kept, as the benchmark has them)."""
    return {"test.txt": [p for p in map(clean_prompt, read_parquet_column(files["test"], "prompts")) if p is not None]}


OCR_REVISION = "ac4c86e8cae021841f1fde853d340e0db67690dd"  # yifan123/flow_grpo, 2025-07-18
OCR_TEST = 1_018  # lines of dataset/ocr/test.txt at OCR_REVISION (its train.txt: at least 10,000, count unrecorded)
OCR_TEST_SHA256 = "a2ca41aa30b79a9582751a6317d98e11acb4de6a2cc74e68da23bae5f5b522e9"  # test.txt as written


def convert_ocr(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """Flow-GRPO's text-rendering prompts: each file's lines in order, cleaned (:func:`clean_prompt`: blank lines
    and lines read as comments dropped), repeats kept. Every prompt must quote its target text (the ``ocr``
    reward reads it); a line that does not is a DataError naming the file and line."""
    from flowrl_rewards.text.ocr import prompt_target

    out: dict[str, list[str]] = {}
    for split in ("train", "test"):
        path, prompts = files[split][0], []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                prompt = clean_prompt(line)
                if prompt is None:
                    continue
                try:
                    prompt_target(prompt)
                except ValueError as e:
                    raise DataError(f"{path}, line {number}: {prompt[:80]!r}: {e}") from None
                prompts.append(prompt)
        out[f"{split}.txt"] = prompts
    return out


PROMPT_SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet(
            name="pickscore",
            description="Pick-a-Pic v1 captions, SFW subset (Flow-GRPO's recommended PickScore prompts); "
            "2,048 test, the rest train",
            remotes={
                "captions": Remote(
                    "hub",
                    "CarperAI/pickapic_v1_no_images_training_sfw",
                    "pickapic_training_sfw.parquet",
                    "ebca1a045fbb7d4192df1d4804865f9c4c91f27b",
                )
            },
            outputs=(Output("train.txt", None, min_count=5_000), Output("test.txt", PICKSCORE_TEST)),
            convert=convert_pickscore,
            needs=("pyarrow",),
        ),
        PromptSet(
            name="hpdv2",
            description="Human Preference Dataset v2 prompts (the DanceGRPO / BranchGRPO / MixGRPO HPS recipes): "
            "unique train prompts, the 400 test prompts",
            remotes={
                "train": Remote("hub", "ymhao/HPDv2", "train.json", "bb0f2563e451e11c3f376b2ba93615db00e042e1"),
                "test": Remote("hub", "ymhao/HPDv2", "test.json", "bb0f2563e451e11c3f376b2ba93615db00e042e1"),
            },
            outputs=(Output("train.txt", None, min_count=50_000), Output("test.txt", 400)),
            convert=convert_hpdv2,
        ),
        PromptSet(
            name="geneval",
            description="GenEval: the 553 evaluation prompts; Flow-GRPO's GenEval-style training prompts; "
            "with each prompt's metadata for the GenEval reward server",
            remotes={
                "train": Remote("github", "yifan123/flow_grpo", "dataset/geneval/train_metadata.jsonl"),
                "test": Remote("github", "djghosh13/geneval", "prompts/evaluation_metadata.jsonl"),
            },
            outputs=(
                Output("train.txt", None, min_count=1_000),
                Output("train_metadata.jsonl", None, min_count=1_000),
                Output("test.txt", 553),
                Output("test_metadata.jsonl", 553),
            ),
            convert=convert_geneval,
        ),
        PromptSet(
            name="drawbench",
            description="DrawBench's 200 prompts (11 categories), an eval set: prompts.eval=dataset/drawbench/test.txt",
            remotes={"test": Remote("hub", "Jialuo21/DrawBench", "data/test-*.parquet")},
            outputs=(Output("test.txt", 200),),
            convert=convert_drawbench,
            needs=("pyarrow",),
        ),
        PromptSet(
            name="ocr",
            description="Flow-GRPO's text-rendering prompts (the OCR recipes of Flow-GRPO and DiffusionNFT), each "
            "quoting the text to render; its own split: 1,018 test prompts, its train file",
            remotes={
                "train": Remote("github", "yifan123/flow_grpo", "dataset/ocr/train.txt", OCR_REVISION),
                "test": Remote("github", "yifan123/flow_grpo", "dataset/ocr/test.txt", OCR_REVISION),
            },
            outputs=(Output("train.txt", None, min_count=10_000), Output("test.txt", OCR_TEST, sha256=OCR_TEST_SHA256)),
            convert=convert_ocr,
        ),
    )
}


def get_set(name: str) -> PromptSet:
    """The prompt set ``name``; else a DataError naming the accepted names."""
    if name in PROMPT_SETS:
        return PROMPT_SETS[name]
    close = difflib.get_close_matches(name, list(PROMPT_SETS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataError(f"unknown prompt set {name!r}{hint}; accepted: {sorted(PROMPT_SETS)}")


def used_by(spec: PromptSet, configs: Path = CONFIG_DIR) -> list[str]:
    """The shipped presets that name one of ``spec``'s files (``dataset/<name>/<file>``), as users name them
    (``configs/…``)."""
    wanted = [f"dataset/{spec.name}/{o.file}" for o in spec.outputs]
    return sorted(
        shipped_name(p) for p in configs.rglob("*.yaml") if any(w in p.read_text(encoding="utf-8") for w in wanted)
    )
