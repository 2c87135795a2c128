"""Issue 63, round five, images (docs/reliability.md, "Round five"): one reader (``rgb_image``) converts every image by
its own range — a 16-bit PNG is no longer clipped to white in an edit prompt's source, in the reward server, or in
``flowrl sample --reward``'s scores; a folder given as an image says so; a PNG whose text chunks are too large is
named with its prompt file and line; a ``]`` in an image's path is written ``\\]``."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.errors import ConfigError
from flowrl.models.image_prompts import (
    image_prompt,
    load_source_image,
    read_image,
    reward_inputs,
    rgb_image,
    split_image_prompt,
)
from flowrl.prompts.checks import check_prompt_images

GREY = 0.61


def grey16(path, value: float = GREY, size=(8, 6)):
    """A 16-bit greyscale PNG (PIL reads it as mode ``I;16``) of one value in [0, 1]."""
    Image.fromarray(np.full(size[::-1], round(value * 65535), dtype=np.uint16)).save(path)
    assert Image.open(path).mode == "I;16"
    return str(path)


def test_a_16_bit_png_source_reads_as_its_value_not_white(tmp_path):
    """Before: ``convert("RGB")`` clipped every value above 255 of 65535 to 255: 99.6 % of a source became 1.0."""
    read_image.cache_clear()
    load_source_image.cache_clear()
    path = grey16(tmp_path / "grey16.png")
    source = load_source_image(path, 6, 8)
    assert source.shape == (3, 6, 8)
    assert abs(source.mean().item() - GREY) < 1 / 255, source.mean()
    _, meta = reward_inputs([image_prompt("keep it", path)], {}, torch.rand(1, 3, 4, 4))
    assert abs(meta["source_images"].mean().item() - GREY) < 1 / 255


def test_flowrl_sample_reward_scores_a_16_bit_source_by_its_value(tmp_path):
    """``flowrl sample --reward`` scores its images with :func:`grid_scores`: ``source_fidelity`` of a sample equal to
    its 16-bit grey source is 1 (before: 1 − 0.39, the source read as white)."""
    from flowrl.training.grids import grid_scores
    from flowrl_rewards import MultiReward

    read_image.cache_clear()
    load_source_image.cache_clear()
    path = grey16(tmp_path / "grey16.png", size=(16, 16))
    images = torch.full((1, 3, 16, 16), round(GREY * 255) / 255)
    reward = MultiReward([{"name": "source_fidelity"}])
    score = grid_scores(images, [image_prompt("keep it", path)], reward)
    assert score.item() > 0.99, score


@pytest.mark.parametrize(
    "mode,values,expected",
    [
        ("I;16", np.array([[0, 65535, 39976]], dtype=np.uint16), [0, 255, 156]),
        ("I", np.array([[0, 65535, 32768]], dtype=np.int32), [0, 255, 128]),
        ("F", np.array([[0.0, 1.0, 0.5]], dtype=np.float32), [0, 255, 128]),
    ],
)
def test_wide_modes_are_converted_by_their_own_range(mode, values, expected):
    image = Image.fromarray(values, mode) if mode != "I;16" else Image.fromarray(values)
    assert image.mode == mode
    assert np.asarray(rgb_image(image, "the image"))[0, :, 0].tolist() == expected


def test_a_wide_image_outside_its_range_is_refused_naming_it():
    image = Image.fromarray(np.array([[-5, 70000]], dtype=np.int32), "I")
    with pytest.raises(
        ValueError, match=r"the image 'x.tif' is a 32-bit integer image \(mode 'I'\) with values from -5 to 70000"
    ):
        rgb_image(image, "the image 'x.tif'")


def test_the_reward_servers_decoders_read_a_16_bit_png_by_its_value():
    """The server's request decoder (and the remote module's ``decode_png``) scored a 16-bit grey of 0.61 as 1.0."""
    from flowrl_rewards.serving.remote import decode_png
    from flowrl_rewards.serving.serve_batching import decode_images
    from flowrl_rewards.serving.serve_limits import Limits, probe_request

    data = _png16_bytes()
    request = probe_request({"images": [base64.b64encode(data).decode()], "prompts": ["p"]}, Limits())
    assert abs(decode_images(request).mean() / 255 - GREY) < 1 / 255
    assert abs(decode_png([base64.b64encode(data).decode()]).mean().item() - GREY) < 1 / 255


def _png16_bytes(size=(8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full(size, round(GREY * 65535), dtype=np.uint16)).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- clear words for image paths ------------------------------------------------------------------------------
def _check(spec: str):
    check_prompt_images(spec, "prompts.train", edits=True, family="qwen_image_edit")


def test_a_folder_given_as_an_image_is_named_a_folder(tmp_path):
    """Before: "no such image", though it exists."""
    (tmp_path / "photos").mkdir()
    prompts = tmp_path / "edits.txt"
    prompts.write_text(f"[image: {tmp_path}/photos] make it blue\n")
    with pytest.raises(ConfigError, match=r"edits.txt.*line 1: .*'.*photos' is a folder, not an image file"):
        _check(str(prompts))


def test_a_png_whose_text_chunks_are_too_large_is_named_with_its_file_and_line(tmp_path, monkeypatch):
    """A PNG with more text than PIL reads (100 MB in the issue; PIL's limit lowered to 1 MiB here, a 2 MiB chunk):
    before, PIL's bare ValueError named neither the prompt file, the line nor the image."""
    import struct
    import zlib

    from PIL import PngImagePlugin

    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", 1 << 20)
    read_image.cache_clear()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)
    pixels = zlib.compress((b"\x00" + b"\x80" * 12) * 4)
    text = b"Comment\x00" + b"x" * (2 << 20)
    png = tmp_path / "chatty.png"
    png.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"tEXt", text)
        + chunk(b"IDAT", pixels)
        + chunk(b"IEND", b"")
    )
    prompts = tmp_path / "edits.txt"
    prompts.write_text(f"[image: {png}] make it blue\n")
    with pytest.raises(ConfigError, match=r"edits.txt.*line 1: .*the image '.*chatty.png' holds more text"):
        _check(str(prompts))


def test_a_bracket_in_an_images_path_is_written_escaped(tmp_path):
    """``a]b.png`` could not be named in a prompt (the first ``]`` ended the path); ``\\]`` now names it, and
    :func:`image_prompt` writes the escape."""
    read_image.cache_clear()
    odd = tmp_path / "a]b.png"
    Image.new("RGB", (4, 4), (0, 0, 255)).save(odd)
    written = f"[image: {tmp_path}/a\\]b.png] make it red"
    assert split_image_prompt(written) == ("make it red", str(odd))
    assert image_prompt("make it red", odd) == written
    assert split_image_prompt(image_prompt("x", "c:\\d\\]e")) == ("x", "c:\\d\\]e")
    assert split_image_prompt("[image: photos\\dog.png] x") == ("x", "photos\\dog.png")  # any other backslash
    prompts = tmp_path / "edits.txt"
    prompts.write_text(written + "\n")
    _check(str(prompts))
    assert load_source_image(split_image_prompt(written)[1], 4, 4)[2].mean().item() == 1.0
