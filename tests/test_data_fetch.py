"""``flowrl data fetch`` against a local fake hub: prompt files, count and checksum checks, atomic
writing, the offline message. No network: every download function is replaced or a mirror is used."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

import flowrl.prompts.fetch as data
from flowrl.paths import CONFIG_DIR
from flowrl.prompts import sets as data_sets
from flowrl.prompts.source import read_prompts

HPD = "ymhao/HPDv2"
HPD_REV = data.PROMPT_SETS["hpdv2"].remotes["test"].revision


def run(argv: list[str]) -> int:
    """``flowrl data ...`` through a parser wired as ``flowrl`` wires it (the data command's add_parser)."""
    from flowrl.commands import data as data_command

    parser = argparse.ArgumentParser(prog="flowrl")
    data_command.add_parser(parser.add_subparsers(dest="command", required=True), "")
    args = parser.parse_args(["data", *argv])
    return args.func(args)


def make_prompts(n: int, prefix: str = "test prompt") -> list[str]:
    return [f"{prefix} number {i} of a red fox" for i in range(n)]


def write_hpdv2(root: Path, n_test: int = 400, n_train: int = 50_010) -> tuple[list[str], list[str]]:
    """HPDv2 laid out as in its hub repo under ``root/ymhao/HPDv2``; returns the expected test and train
    lines. Train repeats prompts (pairs), holds one test prompt, odd whitespace and a '#' prompt."""
    repo = root / HPD
    repo.mkdir(parents=True, exist_ok=True)
    test = make_prompts(n_test)
    (repo / "test.json").write_text(json.dumps([{"prompt": p, "image_path": ["a.jpg"], "rank": [1]} for p in test]))
    train = [f"train prompt {i}  with\nnewline" for i in range(n_train)]
    records = [{"prompt": p, "human_preference": [1, 0]} for p in train for _ in range(2)]  # each twice
    records.insert(5, {"prompt": test[0], "human_preference": [0, 1]})  # a test prompt: dropped from train
    records.insert(7, {"prompt": "#hashtag art", "human_preference": [0, 1]})  # read as a comment: dropped
    (repo / "train.json").write_text(json.dumps(records))
    return test, [" ".join(p.split()) for p in train]


@pytest.fixture
def hpd_mirror(tmp_path):
    root = tmp_path / "mirror"
    test, train = write_hpdv2(root)
    return root, test, train


def test_hpdv2_from_mirror_writes_the_prompt_files(tmp_path, hpd_mirror, capsys):
    root, test, train = hpd_mirror
    out = tmp_path / "dataset"
    assert run(["fetch", "hpdv2", "--source", str(root), "--out", str(out)]) == 0
    test_file, train_file = out / "hpdv2" / "test.txt", out / "hpdv2" / "train.txt"
    assert test_file.read_text().splitlines() == test
    assert train_file.read_text().splitlines() == train  # unique, first-seen order, whitespace collapsed
    assert test[0] not in train_file.read_text().splitlines() and "#hashtag art" not in train_file.read_text()
    assert train_file.read_bytes().endswith(b"\n")
    assert read_prompts(str(train_file)) == train  # what the trainer reads is what was written
    manifest = json.loads((out / "hpdv2" / "manifest.json").read_text())
    assert manifest["files"]["test.txt"] == {"lines": 400, "sha256": hashlib.sha256(test_file.read_bytes()).hexdigest()}
    assert manifest["sources"][0]["revision"] == HPD_REV
    assert "sha256" in capsys.readouterr().out
    assert not [p for p in (out / "hpdv2").iterdir() if ".tmp-" in p.name]


def test_wrong_count_fails_names_it_and_writes_nothing(tmp_path, capsys):
    root = tmp_path / "mirror"
    write_hpdv2(root, n_test=399)
    out = tmp_path / "dataset"
    assert run(["fetch", "hpdv2", "--source", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "test.txt: 399 lines, expected exactly 400" in err and "ymhao/HPDv2" in err
    assert not (out / "hpdv2" / "train.txt").exists() and not (out / "hpdv2" / "test.txt").exists()


def test_truncated_train_split_fails_on_the_floor(tmp_path, capsys):
    root = tmp_path / "mirror"
    write_hpdv2(root, n_train=1_000)
    assert run(["fetch", "hpdv2", "--source", str(root), "--out", str(tmp_path / "d")]) == 2
    assert "1,000 lines, expected at least 50,000" in capsys.readouterr().err
    assert not (tmp_path / "d" / "hpdv2" / "train.txt").exists()


def small_hpdv2(monkeypatch, **changes) -> data.PromptSet:
    """The hpdv2 set with small counts (and ``changes`` to its test output), for tiny fake files."""
    spec = data.PROMPT_SETS["hpdv2"]
    test = dataclasses.replace(spec.outputs[1], count=3, **changes)
    small = dataclasses.replace(spec, outputs=(dataclasses.replace(spec.outputs[0], min_count=2), test))
    monkeypatch.setitem(data.PROMPT_SETS, "hpdv2", small)
    return small


def test_recorded_checksum_is_verified(tmp_path, monkeypatch):
    root = tmp_path / "mirror"
    test, _ = write_hpdv2(root, n_test=3, n_train=5)
    good = hashlib.sha256("".join(p + "\n" for p in test).encode()).hexdigest()
    small_hpdv2(monkeypatch, sha256=good)
    out = tmp_path / "dataset"
    data.fetch("hpdv2", out, root, log=lambda _: None)
    assert (out / "hpdv2" / "test.txt").read_text().splitlines() == test

    small_hpdv2(monkeypatch, sha256="0" * 64)
    (out / "hpdv2" / "train.txt").write_text("old\n")
    with pytest.raises(data.DataError, match=f"sha256 {good}, expected 0{{64}}"):
        data.fetch("hpdv2", out, root, force=True, log=lambda _: None)
    assert (out / "hpdv2" / "train.txt").read_text() == "old\n"  # nothing written after a failed check


def test_a_failure_while_writing_leaves_no_partial_file(tmp_path, monkeypatch):
    root = tmp_path / "mirror"
    write_hpdv2(root, n_test=3, n_train=5)
    small_hpdv2(monkeypatch)
    target = tmp_path / "dataset" / "hpdv2"
    target.mkdir(parents=True)
    (target / "train.txt").write_text("old train\n")
    calls = []
    real_fsync = os.fsync

    def failing_fsync(fd):  # the disk fills up while the second file is written
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        data.fetch("hpdv2", tmp_path / "dataset", root, force=True, log=lambda _: None)
    assert (target / "train.txt").read_text() == "old train\n"  # the previous file, whole
    assert sorted(p.name for p in target.iterdir()) == ["train.txt"]  # no new file, no temporary file


def fake_hub(root: Path, calls: list):
    """Stand-ins for hf_hub_download / snapshot_download serving ``root/<repo>/<file>``, recording calls."""

    def hf_hub_download(repo_id, filename, *, repo_type=None, revision=None, **kw):
        calls.append(("file", repo_id, filename, repo_type, revision))
        path = root / repo_id / filename
        if not path.is_file():
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError("not cached and no connection")
        return str(path)

    def snapshot_download(repo_id, *, repo_type=None, revision=None, allow_patterns=None, **kw):
        calls.append(("snapshot", repo_id, tuple(allow_patterns), repo_type, revision))
        return str(root / repo_id)

    return hf_hub_download, snapshot_download


def test_hub_downloads_ask_for_the_pinned_dataset_files(tmp_path, monkeypatch):
    import huggingface_hub

    root = tmp_path / "hub"
    test, train = write_hpdv2(root, n_test=3, n_train=5)
    small_hpdv2(monkeypatch)
    calls: list = []
    file_dl, snap_dl = fake_hub(root, calls)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", file_dl)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snap_dl)
    monkeypatch.delenv(data.SOURCE_ENV, raising=False)
    out = tmp_path / "dataset"
    assert run(["fetch", "hpdv2", "--out", str(out)]) == 0
    assert calls == [("file", HPD, "train.json", "dataset", HPD_REV), ("file", HPD, "test.json", "dataset", HPD_REV)]
    assert (out / "hpdv2" / "test.txt").read_text().splitlines() == test
    assert (out / "hpdv2" / "train.txt").read_text().splitlines() == train


def test_offline_message_names_each_file_and_where_to_put_it(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls: list = []
    file_dl, _ = fake_hub(tmp_path / "empty", calls)  # nothing cached, no connection
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", file_dl)
    monkeypatch.delenv(data.SOURCE_ENV, raising=False)
    out = tmp_path / "dataset"
    assert run(["fetch", "hpdv2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    for name in ("train.json", "test.json"):
        assert f"https://huggingface.co/datasets/{HPD}/resolve/{HPD_REV}/{name}" in err
        assert f"put it at FOLDER/{HPD}/{name}" in err
    assert "flowrl data fetch hpdv2 --source FOLDER" in err and data.SOURCE_ENV in err
    assert "LocalEntryNotFoundError" in err
    assert len(calls) == 1  # after the network failed once the second file is not retried
    assert not (out / "hpdv2").exists()


def test_missing_mirror_file_is_reported_and_env_source_is_used(tmp_path, monkeypatch, capsys):
    root = tmp_path / "mirror"
    write_hpdv2(root, n_test=3, n_train=5)
    (root / HPD / "train.json").unlink()
    small_hpdv2(monkeypatch)
    monkeypatch.setenv(data.SOURCE_ENV, str(root))
    assert run(["fetch", "hpdv2", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"not in --source: no file {root / HPD / 'train.json'}" in err
    assert f"put it at {root}/{HPD}/train.json" in err
    assert "test.json  (ok)" in err


def test_present_files_are_not_fetched_again_unless_forced(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    root = tmp_path / "mirror"
    write_hpdv2(root, n_test=3, n_train=5)
    small_hpdv2(monkeypatch)
    out = tmp_path / "dataset"
    assert run(["fetch", "hpdv2", "--source", str(root), "--out", str(out)]) == 0
    calls: list = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hub(tmp_path / "empty", calls)[0])
    monkeypatch.delenv(data.SOURCE_ENV, raising=False)
    assert run(["fetch", "hpdv2", "--out", str(out)]) == 0 and calls == []  # up to date: offline is fine
    assert "up to date" in capsys.readouterr().out
    (out / "hpdv2" / "test.txt").write_text("edited\n")  # a file that no longer checks out is fetched again
    assert run(["fetch", "hpdv2", "--out", str(out)]) == 2 and len(calls) == 1
    assert run(["fetch", "hpdv2", "--force", "--source", str(root), "--out", str(out)]) == 0
    assert len((out / "hpdv2" / "test.txt").read_text().splitlines()) == 3


def write_geneval(root: Path, n_test: int = 553, n_train: int = 1_010) -> None:
    test = [
        {"tag": "single_object", "include": [{"class": f"obj{i}", "count": 1}], "prompt": f"a photo of obj{i}"}
        for i in range(n_test)
    ]
    train = [
        {"tag": "counting", "include": [{"class": f"thing{i}", "count": 2}], "prompt": f"a photo of two thing{i}s"}
        for i in range(n_train)
    ]
    train.insert(3, test[0])  # in the test set: dropped from train
    train.insert(9, train[0])  # a repeat: dropped
    train.insert(11, {"tag": "counting", "include": [], "prompt": "a  photo of\ttwo spaced things"})  # cleaned
    for repo, path, rows in (
        ("djghosh13/geneval", "prompts/evaluation_metadata.jsonl", test),
        ("yifan123/flow_grpo", "dataset/geneval/train_metadata.jsonl", train),
    ):
        (root / repo / path).parent.mkdir(parents=True, exist_ok=True)
        (root / repo / path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_github(root: Path, tmp_path: Path, monkeypatch) -> list[str]:
    """Downloads from raw.githubusercontent.com/<owner>/<repo>/<rev>/<path> served from the folder ``root`` (and the
    download cache under ``tmp_path``); returns the list the requested URLs are appended to."""
    import urllib.request

    urls: list[str] = []

    def urlopen(url, timeout=None):
        urls.append(url)
        owner, repo, _rev, path = url.removeprefix("https://raw.githubusercontent.com/").split("/", 3)
        return io.BytesIO((root / owner / repo / path).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(data, "_cache_dir", lambda: tmp_path / "hf" / "flowrl-data")
    return urls


def test_geneval_over_https_keeps_metadata_aligned(tmp_path, monkeypatch):
    root = tmp_path / "github"
    write_geneval(root)
    urls = fake_github(root, tmp_path, monkeypatch)
    out = tmp_path / "dataset"
    data.fetch("geneval", out, log=lambda _: None)
    assert urls == [
        "https://raw.githubusercontent.com/yifan123/flow_grpo/main/dataset/geneval/train_metadata.jsonl",
        "https://raw.githubusercontent.com/djghosh13/geneval/main/prompts/evaluation_metadata.jsonl",
    ]
    for split, n in (("test", 553), ("train", 1_011)):
        prompts = (out / "geneval" / f"{split}.txt").read_text().splitlines()
        meta = [json.loads(line) for line in (out / "geneval" / f"{split}_metadata.jsonl").read_text().splitlines()]
        assert len(prompts) == n and [m["prompt"] for m in meta] == prompts
    assert "a photo of obj0" not in (out / "geneval" / "train.txt").read_text()
    assert "a photo of two spaced things" in (out / "geneval" / "train.txt").read_text().splitlines()
    assert (tmp_path / "hf" / "flowrl-data" / "github" / "djghosh13" / "geneval" / "main").is_dir()


def test_drawbench_glob_and_pickscore_split_from_parquet(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import huggingface_hub
    import pyarrow.parquet as pq

    root = tmp_path / "hub"
    (root / "Jialuo21/DrawBench/data").mkdir(parents=True)
    bench = [f"drawbench prompt {i}" for i in range(199)] + ["drawbench prompt 0"]  # a repeat is kept
    pq.write_table(
        pa.table({"prompts": bench, "category": ["Colors"] * 200}),
        root / "Jialuo21/DrawBench/data/test-00000-of-00001.parquet",
    )
    calls: list = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub(root, calls)[1])
    monkeypatch.delenv(data.SOURCE_ENV, raising=False)
    out = tmp_path / "dataset"
    data.fetch("drawbench", out, log=lambda _: None)
    assert calls == [("snapshot", "Jialuo21/DrawBench", ("data/test-*.parquet",), "dataset", "main")]
    assert (out / "drawbench" / "test.txt").read_text().splitlines() == bench

    spec = data.PROMPT_SETS["pickscore"]
    captions = [f"a photo of  caption {i} in the\tsnow" for i in range(7_100)] * 2 + ["too short words"] * 3
    parquet = root / spec.remotes["captions"].mirror
    parquet.parent.mkdir(parents=True)
    pq.write_table(pa.table({"caption": captions}), parquet)
    data.fetch("pickscore", out, root, log=lambda _: None)
    test = (out / "pickscore" / "test.txt").read_text().splitlines()
    train = (out / "pickscore" / "train.txt").read_text().splitlines()
    assert len(test) == 2048 and len(train) == 7_100 - 2048 and not set(test) & set(train)
    assert set(test) | set(train) == {" ".join(c.split()) for c in captions[:7_100]}
    assert test == data.convert_pickscore({"captions": [parquet]})["test.txt"]  # deterministic split


def test_unknown_name_is_refused_with_the_accepted_names(tmp_path, capsys):
    assert run(["fetch", "hpdv", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown prompt set 'hpdv' (did you mean 'hpdv2'?)" in err
    assert "['drawbench', 'geneval', 'hpdv2', 'ocr', 'pickscore']" in err


def test_every_preset_prompt_path_under_dataset_is_a_known_set():
    """Each ``dataset/<name>/<file>`` a shipped preset names is produced by ``flowrl data fetch <name>``."""
    produced = {f"dataset/{s.name}/{o.file}" for s in data.PROMPT_SETS.values() for o in s.outputs}
    named = set()
    for config in CONFIG_DIR.rglob("*.yaml"):
        for line in config.read_text().splitlines():
            key, _, value = line.strip().partition(":")
            if key in ("train", "eval") and value.strip().startswith("dataset/"):
                named.add(value.strip())
    assert named and named <= produced, named - produced
    assert "configs/sd35/flow_grpo_pickscore.yaml" in data.used_by(data.PROMPT_SETS["pickscore"])


def test_list_shows_files_counts_and_presets(tmp_path, hpd_mirror, capsys):
    root, _, _ = hpd_mirror
    assert run(["fetch", "hpdv2", "--source", str(root), "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert run(["list", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"{tmp_path}/hpdv2/test.txt: 400 lines; present, 400 lines" in text
    assert f"{tmp_path}/pickscore/test.txt: 2,048 lines; missing" in text
    assert "configs/flux/dance_grpo_hps.yaml" in text


# ---- ocr: Flow-GRPO's text-rendering prompts ------------------------------------------------------------------
OCR_REPO = "yifan123/flow_grpo"


def write_ocr(root: Path, test: list[str], train: list[str]) -> Path:
    """Flow-GRPO's dataset/ocr/{test,train}.txt under ``root/yifan123/flow_grpo`` (as written: no line cleaning)."""
    folder = root / OCR_REPO / "dataset" / "ocr"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test.txt").write_text("\n".join(test))  # no newline at the end, as the real test.txt
    (folder / "train.txt").write_text("\n".join(train) + "\n")
    return folder


def small_ocr(monkeypatch, test_count: int = 3, sha256: str | None = None) -> data.PromptSet:
    """The ocr set with a small test count (and checksum) and train floor, for tiny fake files."""
    spec = data.PROMPT_SETS["ocr"]
    small = dataclasses.replace(
        spec,
        outputs=(
            dataclasses.replace(spec.outputs[0], min_count=2),
            dataclasses.replace(spec.outputs[1], count=test_count, sha256=sha256),
        ),
    )
    monkeypatch.setitem(data.PROMPT_SETS, "ocr", small)
    return small


OCR_TEST = ['A shop sign reading "Open Late"', 'A  poster with   "Sale Today"  in red', 'A cake saying "Happy 40th"']
OCR_TRAIN = ['A mug printed with "Best Dad"', "", 'A billboard: "Drive Safe"', 'A mug printed with "Best Dad"']


def test_ocr_from_a_mirror_keeps_every_quoted_prompt_in_order(tmp_path, monkeypatch):
    root = tmp_path / "mirror"
    write_ocr(root, OCR_TEST, OCR_TRAIN)
    small_ocr(monkeypatch)
    out = tmp_path / "dataset"
    assert run(["fetch", "ocr", "--source", str(root), "--out", str(out)]) == 0
    assert (out / "ocr" / "test.txt").read_text().splitlines() == [
        'A shop sign reading "Open Late"',
        'A poster with "Sale Today" in red',
        'A cake saying "Happy 40th"',
    ]
    train = (out / "ocr" / "train.txt").read_text().splitlines()
    assert train == ['A mug printed with "Best Dad"', 'A billboard: "Drive Safe"', 'A mug printed with "Best Dad"']
    manifest = json.loads((out / "ocr" / "manifest.json").read_text())
    assert {s["revision"] for s in manifest["sources"]} == {data_sets.OCR_REVISION}
    assert [s["path"] for s in manifest["sources"]] == ["dataset/ocr/train.txt", "dataset/ocr/test.txt"]


def test_ocr_line_without_a_quoted_target_fails_naming_file_and_line(tmp_path, monkeypatch, capsys):
    root = tmp_path / "mirror"
    folder = write_ocr(root, OCR_TEST, [OCR_TRAIN[0], "", "A mug printed with Best Dad", 'An empty "" sign'])
    small_ocr(monkeypatch)
    out = tmp_path / "dataset"
    assert run(["fetch", "ocr", "--source", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'train.txt'}, line 3: 'A mug printed with Best Dad'" in err
    assert "no pair of double quotes; accepted: a prompt with the target text between double quotes" in err
    assert not (out / "ocr").exists()


def test_ocr_comes_from_the_pinned_flow_grpo_commit_and_its_test_split_is_checked(tmp_path, monkeypatch, capsys):
    root = tmp_path / "github"
    write_ocr(root, OCR_TEST, OCR_TRAIN)
    urls = fake_github(root, tmp_path, monkeypatch)
    spec = data.PROMPT_SETS["ocr"]
    assert spec.outputs[1].count == 1_018 and spec.outputs[1].sha256 == data_sets.OCR_TEST_SHA256  # the real split
    small_ocr(monkeypatch, sha256=spec.outputs[1].sha256)  # 3 fake lines cannot match the real file's checksum
    assert run(["fetch", "ocr", "--out", str(tmp_path / "dataset")]) == 2
    assert urls == [
        f"https://raw.githubusercontent.com/{OCR_REPO}/{data_sets.OCR_REVISION}/dataset/ocr/{f}.txt"
        for f in ("train", "test")
    ]
    assert f"expected {data_sets.OCR_TEST_SHA256} for prompt set 'ocr'" in capsys.readouterr().err
    assert sorted(data.used_by(spec)) == [
        "configs/sd35/crd_ocr.yaml",
        "configs/sd35/flow_grpo_ocr.yaml",
        "configs/sd35/gdro_ocr.yaml",
        "configs/sd35/nft_ocr.yaml",
    ]
