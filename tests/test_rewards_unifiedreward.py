"""UnifiedReward as ``vlm_judge`` templates (issue 64, part 4): its published pointwise prompts for an image
(``unifiedreward``, 1–5) and a video (``unifiedreward_video``, 1–10), sent verbatim, and the answer read as
UnifiedReward's scripts read it (the first digits after the last ``Final Score:``), served and in process."""

from __future__ import annotations

import math
import re

import pytest
import torch

from flowrl_rewards import build_reward
from flowrl_rewards.judges import vlm_judge_local
from flowrl_rewards.judges.vlm_judge import (
    UNIFIEDREWARD_IMAGE,
    UNIFIEDREWARD_PATTERN,
    UNIFIEDREWARD_VIDEO,
    VlmJudge,
    check_pattern,
    read_pattern,
)
from tests.test_rewards_vlm_judge import FAST, completion, images, question_of, serve, tiny_vlm  # noqa: F401
from tests.test_rewards_vlm_judge_video import videos


def unifiedreward_parse(text: str) -> int | None:
    """UnifiedReward's own reading (DiffusionDPO/sift_dpo_data.py, VideoDPO/sift_dpo_data.py): the text after the last
    'Final Score:', its first run of digits; None where it finds none (their scripts then write 0)."""
    digits = re.findall(r"\d+", text.split("Final Score:")[-1].strip())
    return int(digits[0]) if digits else None


ANSWERS = [
    "red (color): 1\ncircle (shape): 1\nFinal Score: 4",
    "Final Score: **5**",
    "Final Score: 3.5",
    "Final Score: 2\nOn reflection, Final Score: 5",
    "Final Score:\n\n1 out of 5",
    "Final Score: 2 ... Final Score: none",
    "visual quality: 4\ntemporal consistency: 3\nFinal Score: 7",
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_the_template_pattern_reads_an_answer_as_unifiedreward_does(answer):
    pattern = check_pattern(UNIFIEDREWARD_PATTERN)
    theirs = unifiedreward_parse(answer)
    score, why = read_pattern(answer, pattern, 1, 10)
    if theirs is None:
        assert math.isnan(score) and "no number matching" in why  # their 0 for "no score" is NaN here (masked)
    else:
        assert why is None and score == pytest.approx((theirs - 1) / 9)


def test_served_unifiedreward_sends_its_prompt_verbatim_and_maps_1_to_5(serve):
    answers = {"a red circle": "red (color): 1\ncircle (shape): 1\nFinal Score: 4", "two cats": "Final Score: **2**"}
    server = serve(lambda req: completion(answers[question_of(req).rsplit("[", 1)[1][:-1]]))
    reward, meta = build_reward("vlm_judge", url=server.url, model="judge", template="unifiedreward", **FAST), {}
    assert reward.mode == "pattern" and (reward.low, reward.high) == (1, 5) and reward.max_tokens == 512
    scores = reward(images(2), ["a red circle", "two cats"], meta)
    assert scores.tolist() == [0.75, 0.25] and meta["vlm_judge/unscored"] == 0
    for request in server.requests:
        prompt = "a red circle" if "a red circle" in question_of(request) else "two cats"
        assert question_of(request) == UNIFIEDREWARD_IMAGE.format(prompt=prompt)
        assert question_of(request).endswith(f"Text Caption: [{prompt}]")
        assert "assign a score from 1 to 5 after 'Final Score:'" in question_of(request)
        assert "logprobs" not in request and request["max_tokens"] == 512 and request["temperature"] == 0
        assert [p["type"] for p in request["messages"][-1]["content"]] == ["image_url", "text"]


def test_served_unifiedreward_video_asks_once_per_video_and_maps_1_to_10(serve):
    server = serve(lambda req: completion("visual quality: 4\ndynamic degree: 3\nFinal Score: 6"))
    reward = build_reward("vlm_judge", url=server.url, model="judge", template="unifiedreward_video", **FAST)
    assert (reward.low, reward.high) == (1, 10) and reward.max_tokens == 1024
    scores = reward(videos(2, 3), ["a cat runs", "a dog"])
    assert torch.allclose(scores, torch.full((2,), 5 / 9))
    assert len(server.requests) == 2
    for request in server.requests:
        parts = request["messages"][-1]["content"]
        assert [p["type"] for p in parts] == ["video_url", "text"]
        prompt = "a cat runs" if "a cat runs" in parts[1]["text"] else "a dog"
        assert parts[1]["text"] == UNIFIEDREWARD_VIDEO.format(prompt=prompt)
        assert parts[1]["text"].endswith(f"Text Prompt: [{prompt}]") and request["max_tokens"] == 1024


def test_settings_override_the_templates_and_a_mismatched_score_is_refused():
    flow_grpo = VlmJudge(template="unifiedreward", score_range=[0, 5])  # Flow-GRPO divides the 1-5 score by 5
    assert flow_grpo.from_text("Final Score: 4") == (0.8, None)
    assert VlmJudge(template="unifiedreward", max_tokens=64).max_tokens == 64
    assert VlmJudge(score="pattern").question == VlmJudge().question  # no template named: VQAScore's question
    with pytest.raises(ValueError, match=r"template='unifiedreward' is read by score: pattern, not score='vqascore'"):
        VlmJudge(template="unifiedreward", score="vqascore")
    with pytest.raises(ValueError, match=r"template='vqascore' is read by score: yes_probability or vqascore, not "):
        VlmJudge(template="vqascore", score="pattern")
    with pytest.raises(ValueError, match=r"template='unifiedreward2' is not one of \(.*'unifiedreward_video'\)"):
        VlmJudge(template="unifiedreward2")


def test_local_unifiedreward_reads_a_greedy_answer_even_without_yes_no_tokens(tiny_vlm, monkeypatch):
    monkeypatch.setattr(vlm_judge_local, "YES_WORDS", ("Jawohl indeed",))  # a tokenizer without a one-token yes
    with pytest.raises(ValueError, match="no single token for Yes"):
        build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu")  # yes_probability needs one
    reward = build_reward(
        "vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", template="unifiedreward", max_tokens=6
    )
    tok = reward.local.processor.tokenizer
    ids = tok.encode("Final Score: 4", add_special_tokens=False)
    # steer the random model's greedy answer to "Final Score: 4": each token after its predecessor
    reward.local.model.generation_config.sequence_bias = {
        (ids[0],): 50.0,
        **{(a, b): 100.0 for a, b in zip(ids, ids[1:])},
    }
    sent = []
    inputs = reward.local.inputs

    def spy(images, questions, systems, fps=0.0):
        sent.extend(questions)
        return inputs(images, questions, systems, fps)

    monkeypatch.setattr(reward.local, "inputs", spy)
    meta = {}
    scores = reward(images(2, 16, 16), ["a red circle", "two cat"], meta)
    assert scores.tolist() == [0.75, 0.75] and meta["vlm_judge/unscored"] == 0
    assert sent == [UNIFIEDREWARD_IMAGE.format(prompt=p) for p in ("a red circle", "two cat")]
    reward.local.model.generation_config.sequence_bias = None
