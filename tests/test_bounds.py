"""Bounds from the machine and files named on failure (issue 47, items 4 and 5): sizes that drive memory or time are
refused before work starts naming the flag or key; a prompt image whose header claims too many pixels is refused
naming the prompt file and line; a config or prompt file that is not UTF-8 is named; a full disk during a
checkpoint (safetensors' own error) is the documented message; a non-finite sampled image is an error naming the
setting, never a black PNG."""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import pytest

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)


def _one_line(capsys, rc_expected: int, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == rc_expected, (argv, err)
    lines = err.strip().splitlines()  # status 1 adds the hint "(add --debug to see the traceback)"
    assert len(lines) == 1 or (rc == 1 and lines[1:] == ["(add --debug to see the traceback)"]), err
    assert "Traceback (most recent" not in err
    for w in words:
        assert w in err, (w, err)
    return err


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` × ``height`` pixels (and holds none of them)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )
    return path


# ---- sizes that drive memory or time -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--num", "100000000"), ("--steps", "100000000")])
def test_sample_sizes_past_their_maximum_fail_at_once_naming_the_flag(flag, value, tmp_path, capsys):
    start = time.perf_counter()
    _one_line(
        capsys,
        2,
        ["sample", "--prompt", "a red circle", flag, value, "--out", str(tmp_path / "out")],
        f"{flag}={value} is more than",
        "the most flowrl accepts",
    )
    assert time.perf_counter() - start < 5  # was a MemoryError after 18 s, or minutes of silence
    assert not (tmp_path / "out").exists()


def test_sample_refuses_images_the_machine_cannot_hold_before_drawing_any(tiny_folder, tmp_path, capsys, monkeypatch):  # noqa: F811
    import flowrl.commands.common as common
    import flowrl.rollout.sampling as sampling
    import flowrl.training.evaluation  # noqa: F401 (imported before the patch: it binds ode_batches at import)

    monkeypatch.setattr(common, "available_memory", lambda: 100_000)  # 100 kB free
    monkeypatch.setattr(sampling, "ode_batches", lambda *a, **k: pytest.fail("sampled although it cannot be held"))
    err = _one_line(
        capsys,
        2,
        [
            "sample",
            "--prompt",
            "a red circle",
            "--num",
            "50",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "out"),
            f"model.path={tiny_folder}",
            "model.family=sd3",
        ],
        "--num=50",
        "more than this machine can hold",
        "a smaller --num",
    )
    assert "50 images" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["eval.steps", "rollout.steps"])
def test_step_keys_past_their_maximum_are_refused_at_load(key, tmp_path, capsys):
    _one_line(
        capsys,
        2,
        ["train", "configs/shapes/grpo.yaml", f"{key}=100000000", f"train.output_dir={tmp_path / 'runs'}"],
        f"{key}=100000000 is more than 1,000",
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key", ["eval.height", "model.width"])
def test_an_image_side_past_its_maximum_is_refused_at_load(key, tmp_path, capsys):
    """FLUX at eval.height=eval.width=20000 ended in an OverflowError from the schedule's shift; every image side is
    refused at load past 8,192 pixels, naming the key."""
    _one_line(
        capsys,
        2,
        ["train", "configs/flux/nft_pickscore.yaml", f"{key}=20000", f"train.output_dir={tmp_path / 'runs'}"],
        f"{key}=20000 is more than 8,192",
        "pixels of an image side",
    )
    assert not (tmp_path / "runs").exists()


# ---- prompt images whose header claims too many pixels --------------------------------------------------------------
@pytest.mark.parametrize("side", [100_000, 12_000])
def test_an_image_prompt_claiming_too_many_pixels_is_refused_naming_file_and_line(side, tmp_path, capsys):
    from flowrl.models.image_prompts import read_image
    from flowrl.prompts.checks import check_prompt_images

    small = tmp_path / "small.png"
    from PIL import Image

    Image.new("RGB", (8, 8), (10, 20, 30)).save(small)
    bomb = _png_header(tmp_path / "bomb.png", side, side)
    prompts = tmp_path / "edits.txt"
    prompts.write_text(f"[image: {small}] make it blue\n[image: {bomb}] make it red\n")
    with pytest.raises(ConfigError, match=r"^prompts.train=.*edits.txt.*, line 2: .*bomb.png.*pixels"):
        check_prompt_images(str(prompts), "prompts.train", edits=True, family="qwen_image_edit")
    read_image.cache_clear()
    _one_line(
        capsys,
        2,
        [
            "train",
            "model.family=qwen_image_edit",
            f"prompts.train={prompts}",
            "prompts.eval=null",
            "rewards=[{name: brightness}]",
            "eval.rewards=null",
            f"train.output_dir={tmp_path / 'runs'}",
        ],
        "edits.txt",
        "line 2",
        "bomb.png",
    )
    assert not (tmp_path / "runs").exists()


# ---- files that are not UTF-8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["utf-16", "latin-1"])
def test_a_config_or_prompt_file_that_is_not_utf8_is_named(encoding, tmp_path, capsys):
    config = tmp_path / "café.yaml"
    config.write_bytes("# café\nrollout:\n  group_size: 4\n".encode(encoding))
    _one_line(capsys, 2, ["train", str(config), f"train.output_dir={tmp_path / 'runs'}"], str(config), "not a UTF-8")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red circle\nun café rouge\n".encode(encoding))
    _one_line(
        capsys,
        2,
        ["train", f"prompts.train={prompts}", f"train.output_dir={tmp_path / 'runs'}"],
        str(prompts),
        "not a UTF-8",
    )
    from flowrl.training.benchmarks import read_benchmark_prompts

    meta = tmp_path / "meta.jsonl"
    meta.write_bytes('{"prompt": "un café"}\n'.encode(encoding))
    with pytest.raises(ConfigError, match=r"meta\.jsonl.*not a UTF-8"):
        read_benchmark_prompts(str(meta))
    assert not (tmp_path / "runs").exists()


# ---- a full disk while safetensors writes a checkpoint -------------------------------------------------------------
def test_safetensors_running_out_of_space_is_the_documented_message(tiny_folder, tmp_path, capsys, monkeypatch):  # noqa: F811
    """safetensors reports a full disk as its own SafetensorError ('I/O error: No space left on device (os error
    28)'), which used to reach the user as such; the checkpoint write says it as docs/reliability.md does."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the second checkpoint's LoRA
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    run = tmp_path / "run"
    err = _one_line(
        capsys,
        1,
        ["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=3", "prompts.eval=null")],
        f"could not write checkpoint {run / 'checkpoints' / 'step-2'}: No space left on device; "
        "the previous checkpoints are intact",
    )
    assert "SafetensorError" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]  # no half-written step-2
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert (
        main(
            [
                "train",
                *tiny_args(
                    tiny_folder, tmp_path, "run", "train.max_steps=3", "prompts.eval=null", "train.resume=latest"
                ),
            ]
        )
        == 0
    )


# ---- a sampled image that is not finite ------------------------------------------------------------------------------
def test_a_non_finite_sample_is_an_error_naming_the_guidance_not_a_black_png(tiny_folder, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    _one_line(
        capsys,
        3,
        [
            "sample",
            "--prompt",
            "a red circle",
            "--num",
            "2",
            "--steps",
            "4",
            "--guidance",
            "1e30",
            "--out",
            str(out),
            f"model.path={tiny_folder}",
            "model.family=sd3",
        ],
        "--guidance=1e+30",
        "non-finite image",
        "'a red circle'",
        "seed 0",
    )
    assert not list(out.glob("*.png"))  # nothing written as if it were a sample


def test_a_prompt_file_with_a_byte_order_mark_reads_as_without_one(tmp_path):
    """A UTF-8 byte-order mark (as Windows editors write) is not text of line 1: the file gives the prompts of the same
    file without it, and the shapes reward scores line 1 (it refused '\\ufeffa red circle' before)."""
    from flowrl.prompts.checks import check_prompts
    from flowrl.prompts.source import read_prompts
    from flowrl_rewards import build_reward

    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("a red circle\ntwo blue squares\n", encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_prompts(str(marked)) == read_prompts(str(plain)) == ["a red circle", "two blue squares"]
    check_prompts(str(marked), "prompts.train", build_reward("shapes").check_prompt)


def test_a_large_benchmark_derives_each_images_seed_when_its_batch_is_drawn(monkeypatch):
    """100,000 prompts × 64 images printed nothing for 45 s while 6.4 M seeds were derived up front: the seeds are
    now derived per batch (the same ones: the held-out eval's seed of image k of prompt i)."""
    import flowrl.training.evaluation as evaluation
    from flowrl.training.benchmarks import ImageSeeds

    mine = list(range(1, 100_000, 2))  # rank 1 of 2
    seeds = ImageSeeds(7, mine, 64)
    assert len(seeds) == 50_000 * 64
    assert seeds[:130] == [evaluation.prompt_seeds(7, [i], k)[0] for i in mine[:3] for k in range(64)][:130]
    assert (
        seeds[-1] == evaluation.prompt_seeds(7, [mine[-1]], 63)[0]
        and seeds[64] == evaluation.prompt_seeds(7, [3], 0)[0]
    )
    derived = []
    real = evaluation.prompt_seeds
    monkeypatch.setattr(evaluation, "prompt_seeds", lambda *a: derived.append(a) or real(*a))
    assert len(seeds[1000:1016]) == 16 and len(derived) == 16  # a batch's seeds, not the run's
