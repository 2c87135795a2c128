"""VQAScore as a ``vlm_judge`` score (issue 64, part 3): P("Yes") of the first answer token to VQAScore's question,
not normalised by P("No") — served (from the reply's log-probabilities) and in process (the tiny Qwen2-VL's softmax,
computed here by hand), for images and videos — and ``flowrl eval --benchmark vqascore``, its mean over a prompt
file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flowrl_rewards import build_reward
from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.judges import vlm_judge_local
from flowrl_rewards.judges.vlm_judge import DEFAULT_QUESTION, answer_probability
from tests.test_rewards_vlm_judge import (  # noqa: F401 (serve, tiny_vlm: fixtures)
    FAST,
    NO_LP,
    P_YES,
    YES_LP,
    completion,
    free_port,
    images,
    question_of,
    serve,
    tiny_vlm,
)
from tests.test_rewards_vlm_judge_video import VIDEO_TEMPLATE, videos

VQA = 'Does this figure show "{}"? Please answer yes or no.'  # t2v_metrics' default_question_template


def vqascore_judge(url, **kw):
    return build_reward("vlm_judge", url=url, model="judge", score="vqascore", **{**FAST, **kw})


# ---- served ----------------------------------------------------------------------------------------------
def test_served_vqascore_is_p_yes_alone_where_yes_probability_divides_by_yes_and_no(serve):
    server = serve(lambda req: completion("Yes", [("Yes", YES_LP), ("No", NO_LP), ("The", -3.0)]))
    reward, meta = vqascore_judge(server.url), {}
    scores = reward(images(2), ["a red circle", "two cats"], meta)
    assert torch.allclose(scores, torch.full((2,), math.exp(YES_LP)))  # 0.905, not P_YES = 0.909
    assert abs(math.exp(YES_LP) - P_YES) > 1e-3
    assert meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 0}
    request = server.requests[0]
    assert question_of(request) in (VQA.format("a red circle"), VQA.format("two cats"))
    assert request["max_tokens"] == 1 and request["logprobs"] is True and request["top_logprobs"] == 20
    normalised = build_reward("vlm_judge", url=server.url, model="judge", **FAST)  # the default score
    assert normalised.mode == "yes_probability"
    assert torch.allclose(normalised(images(1), ["a"]), torch.tensor([P_YES]))


@pytest.mark.parametrize(
    "top, expected",
    [
        ([("Yes", -0.5), (" Yes", -1.0), ("No", -1.2)], math.exp(-0.5)),  # the most probable "Yes" token, not a sum
        ([("ĠYes", -0.7), ("No", -1.0)], math.exp(-0.7)),  # a BPE space mark
        ([("▁Yes", -0.2)], math.exp(-0.2)),  # a SentencePiece one
        ([("yes", -0.1), ("No", -3.0)], 0.0),  # "yes" is another token than the answer "Yes"
        ([("No", -0.01), ("Maybe", -5.0)], 0.0),  # P("Yes") below the least listed: 0
        ([("Maybe", -0.1), ("Yesterday", -1.0)], float("nan")),  # no yes/no answer at all
    ],
)
def test_answer_probability_reads_the_yes_token(top, expected):
    got = answer_probability(top)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, abs=1e-12)


def test_served_answers_without_yes_score_zero_and_without_yes_or_no_are_unscored(serve):
    replies = {"a": [("No", -0.05), ("Maybe", -4.0)], "b": [("Maybe", -0.1), ("Perhaps", -1.0)]}
    server = serve(lambda req: completion("x", replies[question_of(req).split('"')[1]]))
    reward, meta = vqascore_judge(server.url), {}
    scores = reward(images(2), ["a", "b"], meta)
    assert scores[0].item() == 0.0 and math.isnan(scores[1].item())
    assert meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 1}
    assert "neither 'yes' nor 'no'" in reward.last_error


def test_served_vqascore_of_a_video_is_asked_once_with_its_frames(serve):
    server = serve(lambda req: completion("Yes", [("Yes", -0.3), ("No", -1.5)]))
    reward = vqascore_judge(server.url)
    reward.frame_stride = 2
    scores = reward(videos(2, 5), ["a cat runs", "a dog"])
    assert torch.allclose(scores, torch.full((2,), math.exp(-0.3)))
    assert len(server.requests) == 2
    for request in server.requests:
        assert [p["type"] for p in request["messages"][-1]["content"]] == ["video_url", "text"]
        assert request["media_io_kwargs"] == {"video": {"num_frames": 3, "fps": 8.0}}


# ---- in process ------------------------------------------------------------------------------------------
def first_token_probs(model, inputs) -> torch.Tensor:
    """The softmax over the vocabulary after the prompt, float64 [V]."""
    with torch.no_grad():
        return model(**inputs).logits[0, -1].double().softmax(-1)


def test_local_vqascore_is_the_softmax_probability_of_the_yes_token(tiny_vlm):
    from PIL import Image

    reward = build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", score="vqascore")
    processor, model = reward.local.processor, reward.local.model
    yes = processor.tokenizer.convert_tokens_to_ids("Yes")
    assert reward.local.answer_id == yes and reward.max_tokens == 1
    x = images(3, 16, 16, seed=5)
    prompts = ["a red circle", "two", "a cat with two red circle"]
    expected, shares = [], []
    for i, prompt in enumerate(prompts):
        text = (
            f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{VQA.format(prompt)}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        probs = first_token_probs(
            model, processor(text=[text], images=[Image.fromarray(to_uint8(x)[i])], return_tensors="pt")
        )
        expected.append(probs[yes].item())
        shares.append((probs[reward.local.yes_ids].sum() / probs[reward.local.yes_ids + reward.local.no_ids].sum()))
    scores = reward(x, prompts)  # one left-padded batch
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx(expected, rel=1e-4)
    assert not np.allclose(scores.numpy(), [float(s) for s in shares], rtol=1e-2)  # not the normalised share
    alone = torch.cat([reward(x[i : i + 1], prompts[i : i + 1]) for i in range(3)])
    assert torch.allclose(alone, scores, rtol=1e-4)


@pytest.fixture(scope="module")
def video_vqascore(tiny_vlm, tmp_path_factory):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    processor.chat_template = VIDEO_TEMPLATE
    folder = tmp_path_factory.mktemp("tiny_qwen2_vl_vqascore_video")
    processor.save_pretrained(folder)
    return build_reward(
        "vlm_judge", backend="transformers", model=tiny_vlm, processor=str(folder), device="cpu", score="vqascore"
    )


def test_local_vqascore_of_a_video_is_p_yes_given_the_whole_video(video_vqascore):
    processor, model = video_vqascore.local.processor, video_vqascore.local.model
    yes = processor.tokenizer.convert_tokens_to_ids("Yes")
    x = videos(1, 3, 16, 16, seed=6)
    text = (
        f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{VQA.format('a cat')}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    expected = first_token_probs(model, processor(text=[text], videos=[to_uint8(x[0])], return_tensors="pt"))[
        yes
    ].item()
    score = video_vqascore(x, ["a cat"]).item()
    assert score == pytest.approx(expected, rel=1e-4)
    assert video_vqascore(x.flip(1), ["a cat"]).item() != pytest.approx(score, rel=1e-4)  # the frames' order counts


def test_a_tokenizer_without_a_one_token_answer_is_refused_for_vqascore_only(tiny_vlm, monkeypatch):
    monkeypatch.setattr(vlm_judge_local, "ANSWER", "Yesss maybe")  # as a tokenizer would split its "Yes"
    with pytest.raises(ValueError, match=r"encodes 'Yesss maybe' as \d+ tokens .*score: vqascore is the probability"):
        build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", score="vqascore")
    judge = build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu")  # yes_probability
    assert judge.local.answer_id is None


def test_default_question_is_vqascores():
    assert DEFAULT_QUESTION.format(prompt="a b") == VQA.format("a b")


# ---- flowrl eval --benchmark vqascore --------------------------------------------------------------------
def bench_args(tiny_vlm, prompts, out, **kwargs):
    """The shapes preset's embedded model, 2 images per prompt, judged in process by the tiny Qwen2-VL (its term asks
    the motion question: the benchmark asks VQAScore's)."""
    term = {"backend": "transformers", "model": tiny_vlm, "device": "cpu", "template": "motion", **kwargs}
    return [
        "eval",
        "--benchmark",
        "vqascore",
        "--prompts",
        str(prompts),
        *(["--out", str(out)] if out else []),
        "--images-per-prompt",
        "2",
        "eval.steps=2",
        "train.progress=false",
        "eval.rewards=" + json.dumps([{"name": "vlm_judge", "kwargs": term}]),
    ]


def test_benchmark_vqascore_averages_each_images_p_yes_over_the_prompt_file(tiny_vlm, tmp_path, capsys):
    from PIL import Image

    from flowrl.commands.main import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo cat\na cat\n")
    out = tmp_path / "bench"
    assert main(bench_args(tiny_vlm, prompts, out)) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["index"], r["prompt"]) for r in rows] == [
        (i, p) for i, p in enumerate(prompts.read_text().split("\n")[:3]) for _ in range(2)
    ]
    judge = build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", score="vqascore")
    processor, model = judge.local.processor, judge.local.model
    yes = processor.tokenizer.convert_tokens_to_ids("Yes")
    expected = []
    for r in rows:  # each written image (8 bits, as the judge reads it) scored by hand with VQAScore's question
        image = Image.open(out / r["filename"]).convert("RGB")
        text = (
            f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{VQA.format(r['prompt'])}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        expected.append(
            first_token_probs(model, processor(text=[text], images=[image], return_tensors="pt"))[yes].item()
        )
    assert [r["score"] for r in rows] == pytest.approx(expected, rel=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean"] == pytest.approx(sum(expected) / 6, rel=1e-4)
    per_prompt = [sum(expected[2 * i : 2 * i + 2]) / 2 for i in range(3)]
    assert summary["prompt_mean"] == pytest.approx(sum(per_prompt) / 3, rel=1e-4)
    assert summary["n/images"] == 6 and summary["n/scored"] == 6 and summary["unscored"] == 0
    assert "VQAScore benchmark: 6 images of 3 prompts" in printed and f"{summary['mean']:.4f}" in printed


def test_benchmark_vqascore_needs_a_prompt_file(tiny_vlm, capsys):
    from flowrl.commands.main import main

    args = bench_args(tiny_vlm, "x", None)
    i = args.index("--prompts")
    assert main(args[:i] + args[i + 2 :]) == 2
    assert "--benchmark vqascore has no prompt set of its own; name one with --prompts FILE" in capsys.readouterr().err


def test_benchmark_vqascore_checks_a_served_judge_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from flowrl.commands import eval as eval_command
    from flowrl.commands.main import main

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the judge was checked")

    monkeypatch.setattr(eval_command, "load_model", never)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    url = f"http://127.0.0.1:{free_port()}"
    args = bench_args("judge", prompts, None)
    args[-1] = "eval.rewards=" + json.dumps([{"name": "vlm_judge", "kwargs": {"url": url, "model": "judge", **FAST}}])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"no judge server answers at url={url!r}" in err and "loaded" not in err


def test_benchmark_vqascore_leaves_out_unscored_images_and_asks_vqascores_question(serve, tmp_path, capsys):
    from flowrl.commands.main import main

    replies = {"a cat": [("Yes", -0.2), ("No", -1.8)], "a dog": [("Maybe", -0.1), ("Perhaps", -1.0)]}
    server = serve(lambda req: completion("x", replies[question_of(req).split('"')[1]]))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    term = {"url": server.url, "model": "judge", "question": "Rate {prompt}.", "system": "Be strict.", **FAST}
    args = bench_args("judge", prompts, tmp_path / "out")
    args[-1] = "eval.rewards=" + json.dumps([{"name": "vlm_judge", "kwargs": term}])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert {question_of(r) for r in server.requests} == {VQA.format("a cat"), VQA.format("a dog")}
    assert all(len(r["messages"]) == 1 and r["logprobs"] is True for r in server.requests)  # no system turn
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == [pytest.approx(math.exp(-0.2))] * 2 + [None, None]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mean"] == pytest.approx(math.exp(-0.2)) and summary["prompt_mean"] == pytest.approx(math.exp(-0.2))
    assert (summary["n/images"], summary["n/scored"], summary["n/prompts"], summary["unscored"]) == (4, 2, 1, 2)
    assert "VQAScore benchmark: 4 images of 2 prompts (2 without a score, left out)" in printed
