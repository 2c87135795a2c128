"""The served backend of :mod:`flowrl_rewards.judges.vlm_judge`: a judge behind an OpenAI-compatible chat-completions
server (vLLM, sglang), one request per image or video, ``concurrency`` requests in flight, through
:mod:`flowrl_rewards.serving.transport` (its retries and backoff; ``timeout`` bounds each request in total,
connection and whole reply; a redirect to another scheme, host or port is refused, so the key never leaves for another
server).

- the server: ``url`` with or without ``/v1`` (:func:`api_base`), an optional bearer key (:func:`api_key_of`,
  refused at build when it holds whitespace or control characters, without showing it), checked with
  ``GET {base}/models`` (:meth:`ServedJudge.check_ready`);
- a request: ``POST {base}/chat/completions`` with the sample's content parts (:func:`content_parts`: an image as a
  base64 PNG data URL; a video as one ``video_url`` of its JPEG frames, vLLM's ``data:video/jpeg;base64,<f0>,<f1>,…``,
  or as one PNG ``image_url`` per frame) and the question, after an optional system turn, ``temperature`` 0
  (:meth:`ServedJudge.body`);
- a reply: its first choice; in yes/no mode the first answer token's log-probabilities
  (:func:`first_token_candidates`), each checked: finite and at most 0, ``top_logprobs`` a list of at least the
  alternatives asked for; a reply that breaks this is a :class:`MalformedReply` naming what and quoting it.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.core.urls import check_url
from flowrl_rewards.serving.remote import encode_png
from flowrl_rewards.serving.transport import (
    RemoteRewardError,
    TransientError,
    fetch,
    post_json_retrying,
    unsafe_character,
)

log = logging.getLogger(__name__)


VIDEO_INPUTS = ("video", "frames")
"""How a served judge receives a video: one ``video_url`` part of JPEG frames, or one ``image_url`` part per frame."""
JPEG_QUALITY = 95  # a video's frames travel as JPEGs (vLLM's frame-sequence video is JPEG only)


def encode_jpeg(frames: torch.Tensor, quality: int = JPEG_QUALITY) -> list[str]:
    """Frames [F, 3, H, W] float in [0, 1] → base64 strings of 8-bit RGB JPEGs at ``quality``."""
    from PIL import Image

    out = []
    for arr in to_uint8(frames):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def image_part(png: str) -> dict:
    """An ``image_url`` content part holding a base64 PNG."""
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}


def content_parts(sample: torch.Tensor, video_input: str = "video") -> list[dict]:
    """The content parts carrying one sample: an image [3, H, W] as one PNG ``image_url``; a video [F, 3, H, W] as one
    ``video_url`` whose data URL is its F JPEG frames joined by commas (``video_input="video"``: vLLM's
    ``data:video/jpeg;base64,<f0>,<f1>,…``) or as F PNG ``image_url`` parts in frame order (``"frames"``)."""
    if sample.ndim == 3:
        return [image_part(encode_png(sample[None])[0])]
    if video_input == "frames":
        return [image_part(png) for png in encode_png(sample)]
    url = "data:video/jpeg;base64," + ",".join(encode_jpeg(sample))
    return [{"type": "video_url", "video_url": {"url": url}}]


class MalformedReply(RemoteRewardError):
    """A reply that cannot be a judge's answer (log-probabilities out of range, ``top_logprobs`` not a list…)."""


def api_key_of(api_key: str | None, api_key_env: str | None) -> str | None:
    """The API key: ``api_key`` itself, or the value of the environment variable ``api_key_env`` names; a
    ValueError naming where it came from (never the key) when it holds whitespace or a control character."""
    if api_key is not None and api_key_env is not None:
        raise ValueError("vlm_judge: give api_key or api_key_env, not both")
    if api_key_env is None:
        key, source = api_key, "api_key"
    elif api_key_env not in os.environ:
        raise ValueError(
            f"vlm_judge: api_key_env={api_key_env!r} but the environment variable {api_key_env} is not set"
        )
    else:
        key, source = os.environ[api_key_env], f"the environment variable {api_key_env} (api_key_env)"
    if key is not None:
        if not isinstance(key, str):
            raise ValueError(f"vlm_judge: api_key must be a string, got {type(key).__name__}")
        bad = unsafe_character(key, inner_spaces=False)
        if bad:
            raise ValueError(
                f"vlm_judge: the key in {source} holds {bad}; a key holds no whitespace or control "
                "characters (a key read from a file often ends in a newline: strip it); the key is not "
                "shown"
            )
    return key


def api_base(url: Any) -> str:
    """The ``/v1`` prefix of an OpenAI-compatible server: ``url`` with a trailing ``/`` dropped, ``/v1`` appended
    unless it already ends so (``http://h:8000`` and ``http://h:8000/v1/`` both give ``http://h:8000/v1``)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(
            f"vlm_judge: url={url!r} must start with http:// or https:// (the server, e.g. "
            "'http://127.0.0.1:8000', with or without /v1)"
        )
    base = check_url(url, "vlm_judge: url").rstrip("/")  # no user:password@ (refused, the password not shown)
    return base if base.endswith("/v1") else base + "/v1"


def first_token_candidates(choice: dict, asked: int) -> list[tuple[str, float]] | None:
    """(token, log-probability) of the first answer token and its top alternatives; None when the reply holds no
    log-probabilities at all (``choices[0].logprobs.content`` missing or empty). :class:`MalformedReply`, quoting
    the reply, when what it holds cannot be them: ``top_logprobs`` not a list or with fewer than ``asked``
    entries, an entry without a token string, a log-probability that is not a number, NaN, infinite or above 0."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content:
        return None
    first = content[0]
    quoted = excerpt(first)
    if not isinstance(first, dict):
        raise MalformedReply(
            f"choices[0].logprobs.content[0] is {type(first).__name__}, not an object; the reply held {quoted}"
        )
    top = first.get("top_logprobs")
    where = "choices[0].logprobs.content[0].top_logprobs"
    if not isinstance(top, list):
        raise MalformedReply(
            f"{where} is {type(top).__name__}, not a list of {{token, logprob}}; the reply held {quoted}"
        )
    if len(top) < asked:
        raise MalformedReply(
            f"{where} holds {len(top)} alternative{'s' if len(top) != 1 else ''}, fewer than the "
            f"top_logprobs={asked} asked for (a server that ignored the request would decide by the "
            f"first token alone); the reply held {quoted}"
        )
    out = [checked_entry(t, f"{where}[{i}]", quoted) for i, t in enumerate(top)]
    if "logprob" in first or "token" in first:
        token, logprob = checked_entry(first, "choices[0].logprobs.content[0]", quoted)
        if token not in {t for t, _ in out}:
            out.append((token, logprob))
    return out


def checked_entry(entry: Any, where: str, quoted: str) -> tuple[str, float]:
    """(token, log-probability) of one ``{token, logprob}`` entry; :class:`MalformedReply` naming ``where``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        raise MalformedReply(f"{where} is not an object with a 'token' string; the reply held {quoted}")
    value = entry.get("logprob")
    token = entry["token"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedReply(f"{where}.logprob={value!r} (token {token!r}) is not a number; the reply held {quoted}")
    if math.isnan(value):
        raise MalformedReply(f"{where}.logprob is NaN (token {token!r}): no probability; the reply held {quoted}")
    if not math.isfinite(value) or value > 0:
        raise MalformedReply(
            f"{where}.logprob={value!r} (token {token!r}) is not a log-probability: one is finite "
            f"and at most 0 (a probability at most 1); the reply held {quoted}"
        )
    return token, float(value)


def excerpt(value: Any, limit: int = 200) -> str:
    """At most ``limit`` characters of ``value`` as JSON (its repr when not JSON-able), for an error message."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class ServedJudge:
    """A judge behind ``POST {base}/chat/completions``; one sample per request, ``concurrency`` requests at once.

    Transient failures (refused or dropped connections, timeouts, 5xx, 429) are retried ``retries`` times with
    backoff through :func:`flowrl_rewards.serving.remote.post_json_retrying` (remote.py's transport); a request that
    still fails
    raises :class:`RemoteRewardError` naming the URL, the HTTP status and the server's message.
    """

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
    ):
        self.url, self.model, self.concurrency = url, model, concurrency
        base = api_base(url)
        self.chat_url, self.models_url = base + "/chat/completions", base + "/models"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff

    def body(self, parts: list[dict], question: str, system: str | None, options: dict) -> bytes:
        """The chat-completions request for one sample's content parts (:func:`content_parts`) and its question."""
        user = {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
        messages = ([{"role": "system", "content": system}] if system else []) + [user]
        return json.dumps({"model": self.model, "messages": messages, "temperature": 0, **options}).encode("utf-8")

    def post(self, payload: bytes) -> dict:
        """The first choice of the server's reply to ``payload``, after retries (RemoteRewardError otherwise)."""
        try:
            body = post_json_retrying(
                self.chat_url,
                payload,
                self.timeout,
                self.headers,
                self.retries,
                self.backoff,
                self.max_backoff,
                f"vlm_judge at {self.chat_url}",
                log,
            )
        except RemoteRewardError as e:
            raise RemoteRewardError(f"POST {self.chat_url}: {e}") from e
        try:
            choice = json.loads(body)["choices"][0]
            if not isinstance(choice, dict):
                raise TypeError(f"choices[0] is {type(choice).__name__}")
            return choice
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RemoteRewardError(
                f"POST {self.chat_url}: malformed reply, no choices[0] ({type(e).__name__}: "
                f"{e}); first bytes: {body[:200]!r}"
            ) from e

    def ask_all(self, payloads: list[bytes], keep_going: bool) -> list[dict | str]:
        """Every request's first choice in order; with ``keep_going`` a failed one is its error message instead
        of raising (the other requests still run)."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(payloads)))) as pool:
            futures = [pool.submit(self.post, p) for p in payloads]
            out: list[dict | str] = []
            try:
                for f in futures:
                    try:
                        out.append(f.result())
                    except RemoteRewardError as e:
                        if not keep_going:
                            raise
                        out.append(str(e))
            finally:
                for f in futures:
                    f.cancel()
        return out

    def check_ready(self) -> None:
        """``GET {base}/models`` answers and lists ``model`` (a RuntimeError naming ``url``, what the server
        answered, or the served models)."""
        try:
            body = fetch(self.models_url, self.timeout, headers=self.headers)
        except TransientError as e:
            raise RuntimeError(
                f"vlm_judge: no judge server answers at url={self.url!r} (GET {self.models_url}: {e}); start one "
                f"serving model={self.model!r} (e.g. `vllm serve {self.model} --port 8000`, "
                "docs/rewards/vlm_judge.md) or point the key url at where it listens"
            ) from e
        except RemoteRewardError as e:
            raise RuntimeError(f"vlm_judge: the server at url={self.url!r} refused GET {self.models_url}: {e}") from e
        try:
            served = [m.get("id") for m in json.loads(body).get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError) as e:
            raise RuntimeError(
                f"vlm_judge: the server at url={self.url!r} answered GET {self.models_url} with no "
                f"model list ({type(e).__name__}: {e}); first bytes: {body[:200]!r}; is it an "
                "OpenAI-compatible server?"
            ) from e
        if self.model not in served:
            raise RuntimeError(
                f"vlm_judge: the server at url={self.url!r} serves the models {served}, not "
                f"model={self.model!r}; set model to one of them (vLLM names a model by its path "
                "unless --served-model-name renames it)"
            )
