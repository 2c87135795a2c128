"""A vision-language model as judge: a question about each image or video, its answer turned into a score in [0, 1].

Images [B, 3, H, W] and videos [B, F, 3, H, W] (a video family's decode; every ``frame_stride``-th frame) are judged
alike: the reward declares ``modality = "any"``, so a video reaches the judge whole, as a video, not frame by frame.
The question is ``question``, or a named ``template`` (:data:`TEMPLATES`: VQAScore's; ``motion``, a yes/no question
about the video's motion; UnifiedReward's pointwise prompts for an image, ``unifiedreward``, or a video,
``unifiedreward_video``, each with the way its answer is read).

Three ways to score an answer (``score``):

- ``vqascore`` (VQAScore, Lin et al. 2024, arXiv 2404.01291, as t2v_metrics computes it): the judge answers a yes/no
  question; the score is P("Yes"), the probability of the answer token ``Yes`` as the first answer token, over the
  whole vocabulary (not normalised by "No");
- ``yes_probability`` (the default): the same question, the score P(yes) / (P(yes) + P(no)) over the first answer
  token, every "Yes"-like token (``Yes``, `` yes``, ``YES``, …) counted as yes and every "No"-like one as no;
- ``pattern`` (UnifiedReward, Wang et al. 2025, arXiv 2503.05236, as Flow-GRPO reads it): the judge writes an
  answer ending in e.g. ``Final Score: 4``; the number the regex ``pattern`` captures is mapped from
  ``score_range`` [low, high] to [0, 1] (clipped there). An answer without a match, or whose number is not
  finite ("nan", "inf"), scores NaN (counted, with the reason). The UnifiedReward templates read it as UnifiedReward's
  own scripts do: the first run of digits after the last ``Final Score:`` (:data:`UNIFIEDREWARD_PATTERN`).

Two backends (``backend``): ``openai``, any OpenAI-compatible chat-completions server (vLLM, sglang), one
request per image or video (a video as one ``video_url`` part of JPEG frames, or with ``video_input: frames`` one
``image_url`` part per frame), ``concurrency`` in flight, with remote.py's retries and a total deadline of
``timeout`` per request (:mod:`flowrl_rewards.judges.vlm_judge_served`); a reply whose log-probabilities are not
log-probabilities (NaN, infinite, above 0, ``top_logprobs`` not a list or shorter than asked) is a failed request,
raised or (``on_error: nan``) counted; ``transformers``, the judge in this process
(:mod:`flowrl_rewards.judges.vlm_judge_local`; a video through the processor's ``videos=`` input).
Settings, serving commands and failure behaviour: docs/rewards/vlm_judge.md. The questions are
:mod:`flowrl_rewards.judges.vlm_judge_templates`, the settings' checks :mod:`flowrl_rewards.judges.vlm_judge_settings`,
the answers read as scores :mod:`flowrl_rewards.judges.vlm_judge_answers`.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from flowrl_rewards.core.base import Reward, check_frame_stride
from flowrl_rewards.judges.vlm_judge_answers import (  # noqa: F401 (re-exported)
    ANSWER,
    answer_probability,
    bare,
    pattern_score,
    read_pattern,
    yes_share,
)
from flowrl_rewards.judges.vlm_judge_served import (
    VIDEO_INPUTS,
    MalformedReply,
    ServedJudge,
    api_key_of,
    content_parts,
    first_token_candidates,
)
from flowrl_rewards.judges.vlm_judge_settings import (  # noqa: F401 (re-exported)
    check_choice,
    check_number,
    check_pattern,
    check_range,
    check_template,
)
from flowrl_rewards.judges.vlm_judge_templates import (  # noqa: F401 (re-exported)
    DEFAULT_FPS,
    DEFAULT_MODEL,
    DEFAULT_PATTERN,
    DEFAULT_QUESTION,
    MOTION_QUESTION,
    PATTERN_MAX_TOKENS,
    TEMPLATES,
    UNIFIEDREWARD_IMAGE,
    UNIFIEDREWARD_PATTERN,
    UNIFIEDREWARD_VIDEO,
    Template,
)
from flowrl_rewards.serving.remote import ON_ERROR, RemoteRewardError

log = logging.getLogger(__name__)

BACKENDS = ("openai", "transformers")
SCORES = ("yes_probability", "vqascore", "pattern")
YES_NO = ("yes_probability", "vqascore")
"""The scores read from the first answer token of a yes/no question."""


class VlmJudge(Reward):
    """A VLM's answer to ``question`` about each image or video as a score float32 [B] in [0, 1] (NaN: no score).

    Settings (docs/rewards/vlm_judge.md): ``backend`` (``openai`` | ``transformers``), ``model`` (served name or
    hub id / folder), ``question`` / ``system`` templates (``{prompt}`` filled in) or a named ``template``
    (``vqascore`` | ``motion`` | ``unifiedreward`` | ``unifiedreward_video``), ``fps`` (the videos' frame rate before
    ``frame_stride``), ``score`` (``yes_probability`` | ``vqascore`` | ``pattern``; default: the template's,
    yes_probability for a yes/no question), ``pattern``, ``score_range`` (default: the template's, else
    UnifiedReward's ``Final Score`` on [1, 5]), ``max_tokens`` (default 1 for a yes/no score, the template's or 512
    for pattern), ``top_logprobs``; served: ``url``, ``api_key`` / ``api_key_env``,
    ``concurrency``, ``timeout``, ``retries``, ``backoff``, ``max_backoff``, ``on_error`` (``raise`` | ``nan``),
    ``video_input`` (``video`` | ``frames``); in process: ``processor``, ``device``, ``dtype``, ``batch_size``.
    """

    name = "vlm_judge"
    modality = "any"  # images as images; a video [F, 3, H, W] whole, as the judge's video input

    def __init__(
        self,
        backend: str = "openai",  # openai (a served judge: vLLM, sglang) | transformers (the judge in this process)
        model: str = DEFAULT_MODEL,  # the served model's name (as GET /v1/models lists it), or the hub id / folder
        question: str | None = None,  # the question template ({prompt} its only field); null: the template's
        template: str | None = None,  # a named question instead of question: vqascore (default) | motion |
        # unifiedreward | unifiedreward_video (docs/rewards/vlm_judge.md)
        system: str | None = None,  # an optional system prompt, a template like question
        score: str | None = None,  # how an answer becomes a score: vqascore | yes_probability | pattern; null: the
        # template's (yes_probability for a yes/no question)
        pattern: str | None = None,  # pattern scores: the regex whose first group is the number (the last match
        # counts); null: the template's
        score_range: Sequence[float] | None = None,  # pattern scores: the judge's scale [low, high], mapped to [0, 1];
        # null: the template's, else [1, 5]
        max_tokens: int | None = None,  # tokens of the answer; null: 1 for a yes/no score, else the template's or 512
        top_logprobs: int = 20,  # served yes/no scores: alternatives per token asked for (vLLM's --max-logprobs)
        url: str = "http://127.0.0.1:8000",  # served: the server, with or without /v1
        api_key: str | None = None,  # served: a bearer token (not with api_key_env)
        api_key_env: str | None = None,  # served: the environment variable holding the bearer token
        concurrency: int = 8,  # served: requests in flight at once (one image or video each)
        timeout: float = 60.0,  # served: seconds for one request in total (connecting and the whole reply)
        retries: int = 2,  # served: extra attempts after a transient failure
        backoff: float = 1.0,  # served: the first retry delay in seconds, doubled each retry
        max_backoff: float = 30.0,  # served: the longest retry delay in seconds
        on_error: str = "raise",  # served: raise (a request that still fails fails the step) | nan (its score NaN)
        video_input: str = "video",  # served videos: video (one video_url of JPEG frames) | frames (an image each)
        fps: float = DEFAULT_FPS,  # videos: their frame rate as sampled; the judge is told fps / frame_stride
        processor: str | None = None,  # in process: the processor (tokenizer, image processor); null: model's
        device: str = "auto",  # in process: auto (cuda if available) or a torch device
        dtype: str = "auto",  # in process: auto or fp32 | fp16 | bf16
        batch_size: int = 8,  # in process: images or videos per forward pass
    ):
        self.backend = check_choice(
            "backend",
            backend,
            BACKENDS,
            " (openai: a served judge, e.g. by vLLM or sglang; transformers: the judge in this process)",
        )
        self._read_question(question, template, system, score, pattern, score_range, max_tokens)
        self.top_logprobs = int(check_number("top_logprobs", top_logprobs, 1, integer=True))
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.video_input = check_choice(
            "video_input",
            video_input,
            VIDEO_INPUTS,
            " (video: one video_url part of JPEG frames, as vLLM takes a video; frames: one image_url per frame)",
        )
        self.fps = float(check_number("fps", fps, 0, strict=True))
        if not isinstance(model, str) or not model:
            raise ValueError(f"vlm_judge: model={model!r} must be the served model name or a hub id / folder")
        self.model = model
        self.failed = self.unscored = 0  # totals over the calls
        self.served = self.local = None
        if self.backend == "openai":
            check_number("concurrency", concurrency, 1, integer=True)
            check_number("retries", retries, 0, integer=True)
            check_number("timeout", timeout, 0, strict=True)
            check_number("backoff", backoff, 0)
            check_number("max_backoff", max_backoff, 0)
            self.served = ServedJudge(
                url,
                model,
                api_key_of(api_key, api_key_env),
                float(timeout),
                retries,
                float(backoff),
                float(max_backoff),
                concurrency,
            )
        else:
            from flowrl_rewards.judges.vlm_judge_local import LocalJudge

            self.local = LocalJudge(model, processor or model, device, dtype, batch_size, self.mode)

    def _read_question(self, question, template, system, score, pattern, score_range, max_tokens) -> None:
        """The question (``question``, or the named ``template``'s), the ``system`` prompt and how the answer is read:
        the score (default: the template's, yes_probability for a yes/no question), the pattern, its range and the
        answer's length."""
        spec = self.template_of(question, template)
        self.question = check_template("question", question) if spec is None else spec.question
        default = "pattern" if spec is not None and spec.kind == "pattern" else "yes_probability"
        self.mode = check_choice("score", default if score is None else score, SCORES)
        if template is not None and (self.mode == "pattern") != (spec.kind == "pattern"):
            reads = "score: pattern" if spec.kind == "pattern" else "score: yes_probability or vqascore"
            raise ValueError(
                f"vlm_judge: template={template!r} is read by {reads}, not score={self.mode!r} "
                f"({'its answer ends in a score' if spec.kind == 'pattern' else 'it asks a yes/no question'}); "
                "leave score out, or give a question of your own"
            )
        self.system = None if system is None else check_template("system", system)
        self.pattern = check_pattern(pattern if pattern is not None else spec.pattern if spec else DEFAULT_PATTERN)
        self.low, self.high = check_range(
            score_range if score_range is not None else spec.score_range if spec else (1, 5)
        )
        if max_tokens is not None:
            check_number("max_tokens", max_tokens, 1, integer=True)
        answer_length = spec.max_tokens if spec is not None else PATTERN_MAX_TOKENS
        self.max_tokens = max_tokens or (1 if self.mode in YES_NO else answer_length)

    @staticmethod
    def template_of(question: str | None, template: str | None) -> Template | None:
        """The named template in use: ``template`` (default ``vqascore``), or None with a ``question`` of its own."""
        if question is not None and template is not None:
            raise ValueError(
                f"vlm_judge: give question or template, not both (question={question!r}, template={template!r})"
            )
        if question is not None:
            return None
        return TEMPLATES[check_choice("template", "vqascore" if template is None else template, tuple(TEMPLATES))]

    @staticmethod
    def question_of(question: str | None, template: str | None) -> str:
        """The question: ``question`` (a template of its own), else the named ``template`` (default ``vqascore``)."""
        spec = VlmJudge.template_of(question, template)
        return check_template("question", question) if spec is None else spec.question

    def check_ready(self) -> None:
        """The served judge answers and serves ``model`` (the in-process one is loaded at build)."""
        if self.served is not None:
            self.served.check_ready()

    def fill(self, prompts: Sequence[str]) -> tuple[list[str], list[str | None]]:
        """The question and the system prompt (None without one) of every prompt."""
        return (
            [self.question.format(prompt=p) for p in prompts],
            [None if self.system is None else self.system.format(prompt=p) for p in prompts],
        )

    def score(self, images, prompts, meta):
        """Scores float32 [B] in [0, 1] for images [B, 3, H, W] or videos [B, F, 3, H, W] in [0, 1] (every
        ``frame_stride``-th frame judged, at ``fps / frame_stride`` frames per second); NaN where none was given."""
        fps = self.fps
        if images.ndim == 5:
            stride = check_frame_stride(self.name, self.frame_stride)
            images, fps = images[:, ::stride], self.fps / stride
        questions, systems = self.fill(prompts)
        if self.served is not None:
            scores, reasons, failures = self.score_served(images, questions, systems, fps)
        elif self.mode in YES_NO:
            probability = (
                self.local.yes_probability if self.mode == "yes_probability" else self.local.answer_probability
            )
            scores, failures = probability(images, questions, systems, fps).tolist(), []
            reasons = [None if math.isfinite(s) else "a non-finite yes/no probability" for s in scores]
        else:
            texts = self.local.generate(images, questions, systems, self.max_tokens, fps)
            scores, reasons = zip(*(self.from_text(t) for t in texts)) if texts else ((), ())
            failures = []
        self.record(meta, len(prompts), reasons, failures)
        return torch.tensor(scores, dtype=torch.float32)

    def score_served(self, images, questions, systems, fps) -> tuple[list[float], list[str | None], list[str]]:
        """Scores, why each NaN score has none, and the failed requests' errors (``on_error="nan"``), for images
        [B, 3, H, W] or videos [B, F, 3, H, W] (a ``video_url`` of F frames carries vLLM's ``media_io_kwargs``: all F
        frames at ``fps``)."""
        options: dict = {"max_tokens": self.max_tokens}
        if self.mode in YES_NO:
            options.update(logprobs=True, top_logprobs=self.top_logprobs)
        if images.ndim == 5 and self.video_input == "video":
            options["media_io_kwargs"] = {"video": {"num_frames": images.shape[1], "fps": fps}}
        payloads = [
            self.served.body(content_parts(x, self.video_input), q, s, options)
            for x, q, s in zip(images, questions, systems)
        ]
        try:
            choices = self.served.ask_all(payloads, keep_going=self.on_error == "nan")
        except RemoteRewardError as e:
            raise RemoteRewardError(f"vlm_judge: {e}") from e
        scores, reasons, failures = [], [], []
        for choice in choices:
            if isinstance(choice, str):
                scores.append(float("nan"))
                reasons.append(None)
                failures.append(choice)
                continue
            try:
                value, why = self.from_choice(choice)
            except MalformedReply as e:
                message = f"POST {self.served.chat_url}: malformed reply: {e}"
                if self.on_error == "raise":
                    raise RemoteRewardError(f"vlm_judge: {message}") from e
                value, why = float("nan"), None
                failures.append(message)
            scores.append(value)
            reasons.append(why)
        return scores, reasons, failures

    def from_choice(self, choice: dict) -> tuple[float, str | None]:
        """(score, None) or (NaN, why) from a chat-completions choice."""
        if self.mode == "pattern":
            message = choice.get("message") or {}
            return self.from_text(message.get("content") if isinstance(message, dict) else None)
        candidates = first_token_candidates(choice, self.top_logprobs)
        if candidates is None:
            raise RuntimeError(
                f"vlm_judge: the server at {self.served.chat_url} answered without log-probabilities "
                f"(choices[0].logprobs.content is empty), which score={self.mode!r} needs; serve the judge "
                f"with vLLM, which returns up to --max-logprobs (default 20, >= top_logprobs={self.top_logprobs}) "
                "per token, or set score: pattern with a question that asks for a score"
            )
        value = yes_share(candidates) if self.mode == "yes_probability" else answer_probability(candidates)
        if math.isnan(value):
            return value, (
                f"neither 'yes' nor 'no' among the first answer token's top {len(candidates)} "
                f"log-probabilities (top: {[t for t, _ in candidates[:5]]})"
            )
        return value, None

    def from_text(self, text: str | None) -> tuple[float, str | None]:
        """(score, None) or (NaN, why) from an answer's text (pattern mode)."""
        return read_pattern(text or "", self.pattern, self.low, self.high)

    def record(self, meta: dict, n: int, reasons: Sequence[str | None], failures: Sequence[str]) -> None:
        """Counts into ``meta`` (``<name>/failed``: requests masked after retries; ``<name>/unscored``: answers
        without a score), the totals, and :attr:`last_error` saying why scores are NaN."""
        unscored = [r for r in reasons if r]
        why = []
        if failures:
            why.append(f"{len(failures)} of {n} requests failed ({failures[0]})")
            log.warning("vlm_judge: %d of %d requests masked with NaN: %s", len(failures), n, failures[0])
        if unscored:
            why.append(f"{len(unscored)} of {n} answers had no score ({unscored[0]})")
        self.last_error = "; ".join(why) or None
        meta[f"{self.name}/failed"] = len(failures)
        meta[f"{self.name}/unscored"] = len(unscored)
        self.failed += len(failures)
        self.unscored += len(unscored)
