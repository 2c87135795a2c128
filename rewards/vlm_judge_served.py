"""The served backend of :mod:`flowrl_rewards.vlm_judge`: a judge behind an OpenAI-compatible chat-completions server
(vLLM, sglang), one request per image, ``concurrency`` requests in flight, through :mod:`flowrl_rewards.remote`'s
transport (its retries, backoff and timeouts).

- the server: ``url`` with or without ``/v1`` (:func:`api_base`), an optional bearer key (:func:`api_key_of`),
  checked at build with ``GET {base}/models`` (:meth:`ServedJudge.check_ready`);
- a request: ``POST {base}/chat/completions`` with the image as a base64 PNG data URL and the question, after an
  optional system turn, ``temperature`` 0 (:meth:`ServedJudge.body`);
- a reply: its first choice; in yes/no mode the first answer token's log-probabilities
  (:func:`first_token_candidates`).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowrl_rewards.remote import RemoteRewardError, post_json_retrying

log = logging.getLogger(__name__)


def api_key_of(api_key: str | None, api_key_env: str | None) -> str | None:
    """The API key: ``api_key`` itself, or the value of the environment variable ``api_key_env`` names."""
    if api_key is not None and api_key_env is not None:
        raise ValueError("vlm_judge: give api_key or api_key_env, not both")
    if api_key_env is None:
        return api_key
    if api_key_env not in os.environ:
        raise ValueError(f"vlm_judge: api_key_env={api_key_env!r} but the environment variable {api_key_env} "
                         "is not set")
    return os.environ[api_key_env]


def api_base(url: Any) -> str:
    """The ``/v1`` prefix of an OpenAI-compatible server: ``url`` with a trailing ``/`` dropped, ``/v1`` appended
    unless it already ends so (``http://h:8000`` and ``http://h:8000/v1/`` both give ``http://h:8000/v1``)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"vlm_judge: url={url!r} must start with http:// or https:// (the server, e.g. "
                         "'http://127.0.0.1:8000', with or without /v1)")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def first_token_candidates(choice: dict) -> list[tuple[str, float]] | None:
    """(token, log-probability) of the first answer token and its top alternatives; None without log-probs."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return None
    first = content[0]
    top = [(str(t.get("token", "")), float(t["logprob"])) for t in first.get("top_logprobs") or []
           if isinstance(t, dict) and isinstance(t.get("logprob"), (int, float))]
    if isinstance(first.get("logprob"), (int, float)) and first.get("token") not in {t for t, _ in top}:
        top.append((str(first.get("token", "")), float(first["logprob"])))
    return top or None


class ServedJudge:
    """A judge behind ``POST {base}/chat/completions``; one image per request, ``concurrency`` requests at once.

    Transient failures (refused or dropped connections, timeouts, 5xx, 429) are retried ``retries`` times with
    backoff through :func:`flowrl_rewards.remote.post_json_retrying` (remote.py's transport); a request that still fails
    raises :class:`RemoteRewardError` naming the URL, the HTTP status and the server's message.
    """

    def __init__(self, url: str, model: str, api_key: str | None, timeout: float, retries: int, backoff: float,
                 max_backoff: float, concurrency: int):
        self.url, self.model, self.concurrency = url, model, concurrency
        base = api_base(url)
        self.chat_url, self.models_url = base + "/chat/completions", base + "/models"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff

    def body(self, png: str, question: str, system: str | None, options: dict) -> bytes:
        """The chat-completions request for one base64 PNG and its question."""
        user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                            {"type": "text", "text": question}]}
        messages = ([{"role": "system", "content": system}] if system else []) + [user]
        return json.dumps({"model": self.model, "messages": messages, "temperature": 0, **options}).encode("utf-8")

    def post(self, payload: bytes) -> dict:
        """The first choice of the server's reply to ``payload``, after retries (RemoteRewardError otherwise)."""
        try:
            body = post_json_retrying(self.chat_url, payload, self.timeout, self.headers, self.retries, self.backoff,
                                      self.max_backoff, f"vlm_judge at {self.chat_url}", log)
        except RemoteRewardError as e:
            raise RemoteRewardError(f"POST {self.chat_url}: {e}") from e
        try:
            choice = json.loads(body)["choices"][0]
            if not isinstance(choice, dict):
                raise TypeError(f"choices[0] is {type(choice).__name__}")
            return choice
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RemoteRewardError(f"POST {self.chat_url}: malformed reply, no choices[0] ({type(e).__name__}: "
                                    f"{e}); first bytes: {body[:200]!r}") from e

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
        """``GET {base}/models`` answers and lists ``model`` (a RuntimeError naming ``url`` or the served models)."""
        req = urllib.request.Request(self.models_url, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                served = [m.get("id") for m in json.loads(r.read()).get("data", []) if isinstance(m, dict)]
        except (OSError, ValueError, AttributeError, http.client.HTTPException) as e:
            raise RuntimeError(
                f"vlm_judge: no judge server answers at url={self.url!r} (GET {self.models_url}: "
                f"{type(e).__name__}: {e}); start one serving model={self.model!r} (e.g. `vllm serve {self.model} "
                "--port 8000`, docs/rewards/vlm_judge.md) or point the key url at where it listens") from e
        if self.model not in served:
            raise RuntimeError(f"vlm_judge: the server at url={self.url!r} serves the models {served}, not "
                               f"model={self.model!r}; set model to one of them (vLLM names a model by its path "
                               "unless --served-model-name renames it)")
