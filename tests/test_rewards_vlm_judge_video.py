"""``vlm_judge`` on videos (issue 55, item 4): a video [F, 3, H, W] reaches the judge whole, as a ``video_url`` part of
its JPEG frames (or one ``image_url`` per frame) for a served judge, through the processor's ``videos=`` input in
process; the ``motion`` template; the reward's declared modality."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowrl_rewards import MultiReward, build_reward
from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.judges.vlm_judge import DEFAULT_QUESTION, MOTION_QUESTION, VlmJudge
from tests.test_rewards_vlm_judge import (  # noqa: F401 (serve, tiny_vlm: fixtures)
    CHAT_TEMPLATE,
    FAST,
    NO_LP,
    P_YES,
    YES_LP,
    completion,
    serve,
    tiny_vlm,
)


def videos(b=2, f=5, h=16, w=20, seed=0):
    """Smooth videos [b, f, 3, h, w] in [0, 1] (JPEG keeps them close): a gradient per frame, each frame its own
    brightness, so frames differ and their order shows."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 0.5, w).expand(h, w)
    base = torch.rand(b, 1, 3, 1, 1, generator=g) * 0.3
    step = torch.arange(f).view(1, f, 1, 1, 1) * (0.4 / max(f - 1, 1))
    return (base + step + 0.1 * ramp).clamp(0, 1)


def decode(data: str) -> np.ndarray:
    """A base64 PNG or JPEG → uint8 [H, W, 3]."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def yes_reply(req):
    return completion("Yes", [("Yes", YES_LP), ("No", NO_LP)])


# ---- the served judge ------------------------------------------------------------------------------------
def test_a_video_goes_as_one_video_url_of_its_jpeg_frames_with_the_motion_question(serve):
    server = serve(yes_reply)
    reward = build_reward("vlm_judge", url=server.url, model="judge", template="motion", **FAST)
    reward.frame_stride = 2  # as the combiner sets it from the term's kwargs
    x = videos(2, 5)
    meta = {}
    scores = reward(x, ["a cat runs", "a red circle"], meta)
    assert scores.shape == (2,) and torch.allclose(scores, torch.full((2,), P_YES)) and meta["vlm_judge/failed"] == 0
    assert len(server.requests) == 2  # one request per video, not per frame
    for request in server.requests:
        parts = request["messages"][-1]["content"]
        assert [p["type"] for p in parts] == ["video_url", "text"]
        prompt = "a cat runs" if "a cat runs" in parts[1]["text"] else "a red circle"
        assert parts[1]["text"] == MOTION_QUESTION.format(prompt=prompt)
        url = parts[0]["video_url"]["url"]
        assert url.startswith("data:video/jpeg;base64,")
        frames = np.stack([decode(d) for d in url.removeprefix("data:video/jpeg;base64,").split(",")])
        sent = to_uint8(x[0 if prompt == "a cat runs" else 1, ::2])  # frames 0, 2, 4
        assert frames.shape == sent.shape == (3, 16, 20, 3)
        error = np.abs(frames.astype(float) - sent.astype(float)).mean(axis=(1, 2, 3))
        assert (error < 3).all()  # JPEG at quality 95, within 3 of 255 on average
        # the order is kept: each decoded frame is nearest its own
        nearest = [int(np.argmin([np.abs(fr.astype(float) - s).mean() for s in sent])) for fr in frames]
        assert nearest == [0, 1, 2]
        assert request["media_io_kwargs"] == {"video": {"num_frames": 3, "fps": 8.0}}  # 16 fps / stride 2


def test_video_input_frames_sends_one_png_per_frame_and_an_image_stays_one_image(serve):
    server = serve(yes_reply)
    reward = build_reward("vlm_judge", url=server.url, model="judge", video_input="frames", **FAST)
    x = videos(1, 3)
    reward(x, ["a cat"])
    parts = server.requests[0]["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * 3 + ["text"]
    sent = np.stack([decode(p["image_url"]["url"].removeprefix("data:image/png;base64,")) for p in parts[:3]])
    assert np.array_equal(sent, to_uint8(x[0]))  # lossless, in order
    assert "media_io_kwargs" not in server.requests[0]
    reward(x[:, 0], ["a cat"])  # an image [B, 3, H, W]: one image part, as before
    assert [p["type"] for p in server.requests[1]["messages"][-1]["content"]] == ["image_url", "text"]


def test_the_combiner_hands_the_judge_each_video_whole_at_its_frame_stride(serve):
    server = serve(yes_reply)
    kwargs = dict(url=server.url, model="judge", frame_stride=3, **FAST)
    combined = MultiReward([{"name": "vlm_judge", "kwargs": kwargs}])
    scores = combined(videos(2, 7), ["a", "b"])
    assert torch.allclose(scores, torch.full((2,), P_YES))
    assert len(server.requests) == 2  # an image reward would have been asked once per scored frame
    assert all(r["media_io_kwargs"]["video"]["num_frames"] == 3 for r in server.requests)  # frames 0, 3, 6


def test_the_judge_declares_it_scores_images_and_videos():
    from flowrl.training.scoring import check_modality

    reward = VlmJudge()
    assert reward.modality == "any"
    for modality in ("image", "video"):  # neither an image nor a video model refuses it at load
        check_modality(SimpleNamespace(modality=modality, family="x"), [("rewards", MultiReward([reward]))])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(template="motions"),
            r"template='motions' is not one of \('vqascore', 'motion', 'unifiedreward', 'unifiedreward_video'\)",
        ),
        (dict(template="motion", question="Is it {prompt}?"), "give question or template, not both"),
        (dict(video_input="mp4"), r"video_input='mp4' is not one of \('video', 'frames'\)"),
        (dict(fps=0), r"fps=0 must be a number > 0"),
    ],
)
def test_bad_video_settings_fail_at_build_naming_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VlmJudge(**kwargs)


def test_templates_name_their_questions():
    assert VlmJudge().question == VlmJudge(template="vqascore").question == DEFAULT_QUESTION
    assert VlmJudge(template="motion").fill(["a dog"])[0] == [MOTION_QUESTION.format(prompt="a dog")]
    assert "motion" in MOTION_QUESTION and "yes or no" in MOTION_QUESTION  # a yes/no question: yes_probability


# ---- the in-process judge on a tiny random Qwen2-VL ------------------------------------------------------
VIDEO_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>",
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>",
)  # Qwen's layout: a video as its vision tokens, <|video_pad|> expanded by the processor


@pytest.fixture(scope="module")
def video_judge(tiny_vlm, tmp_path_factory):
    """The tiny Qwen2-VL judge with a processor whose chat template places videos (its own folder)."""
    from transformers import AutoProcessor

    assert VIDEO_TEMPLATE != CHAT_TEMPLATE
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    processor.chat_template = VIDEO_TEMPLATE
    folder = tmp_path_factory.mktemp("tiny_qwen2_vl_video_processor")
    processor.save_pretrained(folder)
    return build_reward(
        "vlm_judge", backend="transformers", model=tiny_vlm, processor=str(folder), device="cpu", batch_size=4
    )


class Spy:
    """Forwards to a processor, recording the keywords of every call."""

    def __init__(self, processor):
        self.processor, self.calls = processor, []

    def __getattr__(self, name):
        return getattr(self.processor, name)

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.processor(**kwargs)


def test_local_judge_gives_the_processor_the_video_and_its_frame_rate(video_judge, monkeypatch):
    spy = Spy(video_judge.local.processor)
    monkeypatch.setattr(video_judge.local, "processor", spy)
    monkeypatch.setattr(video_judge, "frame_stride", 2)
    x = videos(2, 4, 16, 16)
    scores = video_judge(x, ["a cat", "a red circle and two red circle"])
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert ((scores > 0) & (scores < 1)).all()
    (call,) = spy.calls
    assert "images" not in call and len(call["videos"]) == 2
    for got, video in zip(call["videos"], x):
        assert np.array_equal(got, to_uint8(video[::2]))  # frames 0 and 2, uint8 [F, H, W, 3]
    assert [m["fps"] for m in call["video_metadata"]] == [8.0, 8.0]
    assert all("<|video_pad|>" in t and "<|image_pad|>" not in t for t in call["text"])


def test_local_video_score_is_the_softmax_yes_share_and_changes_with_the_video(video_judge):
    processor, model = video_judge.local.processor, video_judge.local.model
    tok = processor.tokenizer
    yes = [tok.convert_tokens_to_ids(t) for t in ("Yes", "ĠYes", "yes", "Ġyes")]
    no = [tok.convert_tokens_to_ids(t) for t in ("No", "ĠNo", "no", "Ġno")]
    x = videos(1, 3, 16, 16, seed=3)
    text = (
        '<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Does this figure show "a cat"? '
        "Please answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = processor(text=[text], videos=[to_uint8(x[0])], return_tensors="pt")
    assert inputs["video_grid_thw"][0, 0] == 3  # the three frames, each its own temporal patch
    with torch.no_grad():
        probs = model(**inputs).logits[0, -1].double().softmax(-1)
    expected = (probs[yes].sum() / (probs[yes].sum() + probs[no].sum())).item()
    score = video_judge(x, ["a cat"]).item()
    assert 0 < score < 1 and score == pytest.approx(expected, abs=1e-6)
    # the judge sees the video as a whole: the same frames in reverse order (the motion reversed) score otherwise
    assert abs(video_judge(x.flip(1), ["a cat"]).item() - score) > 1e-4
    assert abs(video_judge(videos(1, 3, 16, 16, seed=4), ["a cat"]).item() - score) > 1e-4
    # and alone or in a left-padded batch alike
    both = video_judge(torch.cat([x, x.flip(1)]), ["a cat", "two red circle a cat"])
    assert both[0].item() == pytest.approx(score, abs=1e-5)


def test_a_processor_without_a_video_input_is_refused_naming_it(video_judge, monkeypatch):
    image_only = SimpleNamespace(video_processor=None, apply_chat_template=lambda *a, **k: "q")  # e.g. a LLaVA's
    monkeypatch.setattr(video_judge.local, "processor", image_only)
    with pytest.raises(ValueError, match=r"SimpleNamespace has no video processor, so it cannot judge videos"):
        video_judge(videos(1, 2, 16, 16), ["a cat"])
