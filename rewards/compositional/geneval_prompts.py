"""GenEval prompts → :class:`~flowrl_rewards.compositional.geneval_rules.Task`: from GenEval's metadata files (each
line a record with
the prompt), or, for a prompt no file names, from GenEval's own prompt templates (``prompts/create_prompts.py`` of
djghosh13/geneval: "a photo of a bench", "… of a cat and a dog", "… of three pizzas", "… of a purple potted
plant", "… of a cat left of a dog", "… of a red car and a blue bench") over its 80 COCO class names.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from flowrl_rewards.compositional.geneval_rules import COLORS, RELATIONS, Clause, Task

COCO_CLASSES: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
"""GenEval's object names (its ``object_names.txt``): the COCO classes, three of them spelt out."""

NUMBERS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
FORMS = (
    '"a photo of a bench", "a photo of a cat and a dog", "a photo of three pizzas", '
    '"a photo of a purple potted plant", "a photo of a cat left of a dog", "a photo of a red car and a blue bench"'
)


def plural(name: str) -> str:
    """GenEval's plural: "es" after a final s, else "s"."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


@lru_cache(maxsize=8)
def _patterns(classes: tuple[str, ...]) -> list[tuple[str, re.Pattern]]:
    """(tag, regex) of each template, in the order they are tried (the longer forms first)."""
    obj = "(?P<{}>" + "|".join(re.escape(c) for c in sorted(classes, key=len, reverse=True)) + ")"
    plural_obj = "(?P<plural>" + "|".join(re.escape(plural(c)) for c in sorted(classes, key=len, reverse=True)) + ")"
    color = "(?P<{}>" + "|".join(COLORS) + ")"
    rel = "(?P<rel>" + "|".join(RELATIONS) + ")"
    num = "(?P<num>" + "|".join(NUMBERS[2:]) + ")"
    art = "an? "
    forms = [
        ("color_attr", f"{art}{color.format('c1')} {obj.format('a')} and {art}{color.format('c2')} {obj.format('b')}"),
        ("position", f"{art}{obj.format('a')} {rel} {art}{obj.format('b')}"),
        ("two_object", f"{art}{obj.format('a')} and {art}{obj.format('b')}"),
        ("counting", f"{num} {plural_obj}"),
        ("colors", f"{art}{color.format('c1')} {obj.format('a')}"),
        ("single_object", f"{art}{obj.format('a')}"),
    ]
    return [(tag, re.compile(f"a photo of {body}")) for tag, body in forms]


def parse_prompt(prompt: str, classes: Sequence[str] = COCO_CLASSES) -> Task | None:
    """The task of a prompt written in one of GenEval's templates (:data:`FORMS`) over ``classes``; None if it
    follows none of them."""
    text = " ".join(prompt.split())
    for tag, pattern in _patterns(tuple(classes)):
        m = pattern.fullmatch(text)
        if m is None:
            continue
        g = m.groupdict()
        if tag == "counting":
            cls = next(c for c in classes if plural(c) == g["plural"])
            n = NUMBERS.index(g["num"])
            return Task(tag, prompt, (Clause(cls, n),), (Clause(cls, n + 1),))
        if tag == "position":
            return Task(tag, prompt, (Clause(g["b"], 1), Clause(g["a"], 1, position=(g["rel"], 0))))
        a = Clause(g["a"], 1, g.get("c1"))
        include = (a,) if "b" not in g else (a, Clause(g["b"], 1, g.get("c2")))
        return Task(tag, prompt, include)
    return None


def read_metadata(
    paths: Iterable[str | Path], classes: Sequence[str] = COCO_CLASSES, max_objects: int | None = None
) -> dict[str, Task]:
    """Prompt → task from GenEval metadata JSONL files (one record per line; later files win on a repeated
    prompt); a ValueError naming the file, line and field of a record that is not a GenEval task, names a class
    outside ``classes`` or a count above ``max_objects`` (the most detections GenEval keeps per class: such a
    clause could never pass); a folder given for a file is named as one."""
    out: dict[str, Task] = {}
    for spec in paths:
        path = metadata_file(spec)
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}, line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e})") from None
                task = Task.from_metadata(record, where)
                check_task(task, where, classes, max_objects)
                out[" ".join(task.prompt.split())] = task
    return out


def metadata_file(spec: str | Path) -> Path:
    """The metadata file ``spec`` names (found as prompt files are); FileNotFoundError, or IsADirectoryError
    listing the JSONL files inside when it names a folder."""
    from flowrl.paths import REPO_ROOT, find_file, where_tried

    path = find_file(spec)
    if path is not None:
        return path
    folder = next((p for p in (Path(spec).expanduser(), REPO_ROOT / Path(spec).expanduser()) if p.is_dir()), None)
    if folder is not None:
        inside = sorted(p.name for p in folder.glob("*.jsonl"))
        listing = f"; the JSONL files in it: {inside[:8]}" if inside else "; it holds no .jsonl file"
        raise IsADirectoryError(
            f"GenEval metadata {str(spec)!r} is a folder ({folder}), not a file: metadata takes "
            f"JSONL files, e.g. {str(spec).rstrip('/')}/test_metadata.jsonl{listing}"
        )
    raise FileNotFoundError(
        f"GenEval metadata file {str(spec)!r} does not exist (looked in {where_tried(spec)};"
        " flowrl data fetch geneval writes dataset/geneval/{train,test}_metadata.jsonl)"
    )


def check_task(task: Task, where: str, classes: Sequence[str], max_objects: int | None) -> None:
    """A ValueError naming ``where`` and the clause when ``task`` asks for a class outside ``classes`` or (an
    include clause) more objects than ``max_objects``: GenEval could never count it as passed."""
    known = set(classes)
    for kind, clauses in (("include", task.include), ("exclude", task.exclude)):
        for i, c in enumerate(clauses):
            if c.cls not in known:
                near = [n for n in classes if n.split()[-1] == c.cls.split()[-1] or c.cls.lower() == n]
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(
                    f"{where}: {kind}[{i}].class={c.cls!r} is not a class the detector knows; accepted: "
                    f"GenEval's {len(classes)} COCO class names (e.g. 'person', 'traffic light', "
                    f"'potted plant', 'tv remote', lower case, as GenEval spells them){hint}"
                )
            if kind == "include" and max_objects is not None and c.count > max_objects:
                raise ValueError(
                    f"{where}: include[{i}].count={c.count} is above max_objects={max_objects}, the most "
                    f"detections GenEval keeps per class, so it could never pass; accepted: 1 to "
                    f"{max_objects} (or raise the reward's max_objects)"
                )


class TaskBook:
    """Finds each prompt's task: in the metadata files first (by the prompt with whitespace collapsed), else by
    GenEval's templates; a prompt found in neither is a ValueError that names the accepted forms. Metadata
    records are checked at load (:func:`check_task`); :meth:`require_classes` then narrows the classes to those
    a detector knows."""

    def __init__(
        self, metadata: Iterable[str | Path] = (), classes: Sequence[str] = COCO_CLASSES, max_objects: int | None = None
    ):
        self.classes, self.max_objects = tuple(classes), max_objects
        self.known = read_metadata(metadata, self.classes, max_objects)
        self.detectable: tuple[set[str], str] | None = None  # (classes, the detector's name)

    def require_classes(self, detectable: Iterable[str], detector: str) -> None:
        """Refuse (ValueError naming the prompt and class) a metadata task with a class the detector
        ``detector`` does not detect, and check every later prompt's task the same way."""
        self.detectable = (set(detectable), detector)
        for task in self.known.values():
            self._check_detectable(task)

    def _check_detectable(self, task: Task) -> None:
        if self.detectable is None:
            return
        classes, detector = self.detectable
        missing = [c.cls for c in (*task.include, *task.exclude) if c.cls not in classes]
        if missing:
            raise ValueError(
                f"{task.prompt!r} asks for {missing[0]!r}, a class the detector {detector!r} does not "
                f"detect (it detects {len(classes)} of GenEval's classes: {sorted(classes)[:12]}…); use "
                "a COCO instance-segmentation checkpoint with every GenEval class"
            )

    def __call__(self, prompt: str) -> Task:
        key = " ".join(prompt.split())
        task = self.known.get(key)
        if task is None:
            task = parse_prompt(key, self.classes)
            if task is not None:
                check_task(task, repr(prompt), self.classes, self.max_objects)
        if task is None:
            where = f"; nor is it in the metadata files ({len(self.known)} prompts)" if self.known else ""
            raise ValueError(
                f"{prompt!r} is not a GenEval prompt: it follows none of GenEval's templates ({FORMS}) "
                f"over the COCO class names{where}"
            )
        self._check_detectable(task)
        return task
