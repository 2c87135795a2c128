"""GenEval metadata checked at load (issue 54): a class the detector does not know, a count it can never reach, a
colour outside GenEval's ten (and its case) and a folder given for a file are refused before any model loads, naming
the file, line and field and what is accepted."""

from __future__ import annotations

import json

import pytest

from flowrl_rewards import build_reward
from flowrl_rewards.compositional.geneval_prompts import TaskBook, read_metadata

GOOD = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"}


def metadata(tmp_path, *records, name="meta.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def clause(**fields):
    return {"tag": "counting", "include": [{"class": "cat", "count": 2, **fields}], "prompt": "a photo of two cats"}


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            clause(**{"class": "unicorn"}),
            r"line 2: include\[0\].class='unicorn' is not a class the detector knows; "
            r"accepted: GenEval's 80 COCO class names",
        ),
        (clause(**{"class": "mouse"}), r"include\[0\].class='mouse' .*did you mean 'computer mouse'\?"),
        (
            clause(count=1000000000),
            r"line 2: include\[0\].count=1000000000 is above max_objects=16, the most detections "
            r"GenEval keeps per class, so it could never pass; accepted: 1 to 16",
        ),
        (clause(count=1e9), r"line 2: include\[0\].count=1000000000.0 must be an integer >= 1"),
        (
            clause(color="magenta"),
            r"line 2: include\[0\].color='magenta' is not one of GenEval's ten colours \('red', "
            r"'orange', 'yellow', 'green', 'blue', 'purple', 'pink', 'brown', 'black', 'white'\) "
            r"\(lower case\)",
        ),
        (
            clause(color="Red"),
            r"line 2: include\[0\].color='Red' is not one of GenEval's ten colours .*GenEval's colours "
            r"are lower case: write 'red'",
        ),
        (
            {
                "tag": "counting",
                "include": [{"class": "cat", "count": 2}],
                "exclude": [{"class": "unicorn", "count": 3}],
                "prompt": "x",
            },
            r"exclude\[0\].class='unicorn'",
        ),
    ],
)
def test_a_record_geneval_can_never_pass_is_refused_naming_the_line_and_field(tmp_path, bad, match):
    path = metadata(tmp_path, GOOD, bad)
    with pytest.raises(ValueError, match=rf"meta.jsonl, {match}" if match.startswith("line") else match):
        TaskBook([path], max_objects=16)
    with pytest.raises(ValueError, match=match):  # the reward refuses it before loading any model
        build_reward("geneval", metadata=str(path), detector=str(tmp_path / "no-detector-here"))


def test_counts_are_held_to_the_rewards_max_objects(tmp_path):
    path = metadata(tmp_path, clause(count=5))
    assert TaskBook([path], max_objects=5)("a photo of two cats").include[0].count == 5
    with pytest.raises(ValueError, match=r"include\[0\].count=5 is above max_objects=4"):
        TaskBook([path], max_objects=4)
    book = TaskBook(max_objects=3)
    with pytest.raises(ValueError, match=r"'a photo of four cats': include\[0\].count=4 is above max_objects=3"):
        book("a photo of four cats")
    assert book("a photo of three cats").include[0].count == 3


def test_metadata_naming_a_folder_says_it_is_a_folder(tmp_path):
    folder = tmp_path / "geneval"
    folder.mkdir()
    with pytest.raises(
        IsADirectoryError,
        match=rf"GenEval metadata '{folder}' is a folder \({folder}\), not a file: "
        r"metadata takes JSONL files, .*it holds no .jsonl file",
    ) as e:
        read_metadata([folder])
    assert "does not exist" not in str(e.value)
    metadata(tmp_path, GOOD, name="geneval/test_metadata.jsonl")
    with pytest.raises(IsADirectoryError, match=r"the JSONL files in it: \['test_metadata.jsonl'\]"):
        build_reward("geneval", metadata=str(folder), detector=str(tmp_path / "no-detector-here"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_metadata([tmp_path / "missing.jsonl"])
    assert read_metadata([folder / "test_metadata.jsonl"])["a photo of a red car"].include[0].color == "red"
