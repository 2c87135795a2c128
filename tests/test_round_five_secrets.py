"""Issue 63, round five, secrets (docs/reliability.md, "Round five"): ``flowrl compare`` writes and prints no reward
secret (``commands.sh``, ``results.md``, ``status.json``, its "Commands:" block) and a resumed comparison still runs;
a URL with ``user:password@`` is refused at load without showing the password; a secret in a URL's query is
redacted wherever a config is written, and the ``remote`` reward takes a key from the environment instead."""

from __future__ import annotations

import http.server
import json
import shlex
import threading
from pathlib import Path

import pytest

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.config.secrets import REDACTED, redact_command, redact_kwargs
from flowrl_rewards.core.urls import redact_url

KEY = "sk-round5-0123456789abcdef"
QUERY_KEY = "qk-round5-fedcba9876543210"
PASSWORD = "pw-round5-HUNTER2"


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]


# ---- 1. flowrl compare -----------------------------------------------------------------------------------------
JUDGE = (
    "eval.rewards=[{name: vlm_judge, kwargs: "
    f"{{url: 'http://127.0.0.1:9/v1?api_key={QUERY_KEY}', api_key: {KEY}, question: 'Is it red?'}}}}]"
)


def _compare_args(tmp_path: Path) -> list[str]:
    config = tmp_path / "secret.yaml"
    config.write_text("loss: {kl_ref: 0}\n")
    return [
        "compare",
        f"S={config}",
        "prompts.train=a red circle|a blue square",
        "prompts.eval=a red circle|a dog",
        JUDGE,
        "--seeds",
        "0",
        "1",
        "--budget",
        "iterations=1",
        "--out",
        str(tmp_path / "cmp"),
    ]


def _fake_train(calls: list[list[str]], fail: set[str] = frozenset()):
    """A stand-in for the ``flowrl train`` process: records its command, writes a run's metrics (or fails)."""

    def call(command, stdout=None, stderr=None, env=None):
        calls.append(list(command))
        name = next(c.split("=", 1)[1] for c in command if c.startswith("train.name="))
        folder = Path(next(c.split("=", 1)[1] for c in command if c.startswith("train.output_dir="))) / name
        folder.mkdir(parents=True, exist_ok=True)
        records = [{"step": 1, "reward_mean": 0.5, "leaves": 4}, {"step": 1, "eval/judge_mean": 0.25}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 1 if name in fail else 0

    return call


def test_compare_writes_and_prints_no_secret_and_a_resumed_comparison_still_runs(tmp_path, monkeypatch, capsys):
    """The key and the URL's query key reach every run's command, and appear in nothing compare writes or prints
    (before: verbatim in commands.sh, results.md, status.json and the "Commands:" block). Resumed, the comparison runs
    the rest with the key given again; a line of commands.sh run as it stands asks for the key (status 2)."""
    import flowrl.commands.compare as compare

    calls: list[list[str]] = []
    monkeypatch.setattr(compare.subprocess, "call", _fake_train(calls, fail={"S-s1"}))
    args = _compare_args(tmp_path)
    out = tmp_path / "cmp"
    assert main(args) == 1  # S-s1 failed: its command is kept in status.json, redacted too
    printed = capsys.readouterr()
    assert len(calls) == 2 and all(KEY in " ".join(c) and QUERY_KEY in " ".join(c) for c in calls)
    for secret in (KEY, QUERY_KEY):
        assert _files_holding(out, secret) == []
        assert secret not in printed.out and secret not in printed.err
    assert "Commands:" in printed.out and f"api_key: {REDACTED}" in printed.out
    assert f"api_key={REDACTED}" in (out / "commands.sh").read_text()
    status = json.loads((out / "status.json").read_text())
    assert status["S-s1"]["state"] == "failed" and REDACTED in " ".join(status["S-s1"]["command"])

    # resumed: the failed run runs again, with the key of this invocation; still nothing written holds it
    calls.clear()
    monkeypatch.setattr(compare.subprocess, "call", _fake_train(calls))
    assert main(args) == 0
    assert [next(c for c in call if c.startswith("train.name=")) for call in calls] == ["train.name=S-s1"]
    assert KEY in " ".join(calls[0])
    assert _files_holding(out, KEY) == [] and KEY not in capsys.readouterr().out

    # a line of commands.sh as it stands: the run asks for the key instead of sending the placeholder
    line = (out / "commands.sh").read_text().splitlines()[0]
    argv = shlex.split(line)
    assert argv[1:4] == ["-m", "flowrl", "train"]
    assert main(argv[3:]) == 2
    err = capsys.readouterr().err
    assert "eval.rewards[0].kwargs." in err and f"{REDACTED}" in err and "give it again" in err, err


def test_a_resumed_comparison_given_the_redacted_override_asks_for_the_key(tmp_path, monkeypatch, capsys):
    """A comparison started again with the override as results.md shows it (``api_key: <redacted>``) is refused at
    load, naming the key, before any run."""
    import flowrl.commands.compare as compare

    calls: list[list[str]] = []
    monkeypatch.setattr(compare.subprocess, "call", _fake_train(calls))
    args = _compare_args(tmp_path)
    shown = [redact_command([a])[0] for a in args]
    assert shown != args and KEY not in " ".join(shown)
    assert main(shown) == 2 and calls == []
    err = capsys.readouterr().err
    assert "eval.rewards[0].kwargs." in err and "<redacted>: a run folder never stores a secret" in err, err


@pytest.mark.parametrize(
    "item,secret",
    [
        (f"rewards.0.kwargs.api_key={KEY}", KEY),
        (f"rewards[0].kwargs.headers.Authorization=Bearer {KEY}", KEY),
        (f"eval.rewards.0.kwargs.url=http://h:1/score?token={QUERY_KEY}", QUERY_KEY),
        (f"rewards=[{{name: remote, kwargs: {{url: 'http://h:1/s?x=1&api_key={QUERY_KEY}'}}}}]", QUERY_KEY),
        (f"rewards.0={{name: remote, kwargs: {{headers: {{X-Key: {KEY}}}}}}}", KEY),
        (f"rewards.0.kwargs.headers.X-Team={KEY}", KEY),
        (f"rewards.0.kwargs={{auth: {{password: {KEY}}}}}", KEY),
    ],
)
def test_every_form_of_a_reward_secret_in_an_override_is_redacted(item, secret):
    """Dotted, indexed, whole-list and URL forms: the secret goes, the rest of the override stays as given."""
    (shown,) = redact_command([item])
    assert secret not in shown and REDACTED in shown and shown.split("=", 1)[0] == item.split("=", 1)[0]


def test_overrides_without_a_reward_secret_are_written_as_given():
    command = ["python", "-m", "flowrl", "train", "a.yaml", "train.seed=0", "rewards=[{name: brightness}]"]
    command += ["model.tokenizer_max_length=77", "rewards.0.kwargs.url=http://h:1/score?n=2"]
    assert redact_command(command) == command


# ---- 3. credentials in a URL ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "term",
    [
        "rewards=[{{name: remote, kwargs: {{url: '{url}/score'}}}}]",
        "eval.rewards=[{{name: vlm_judge, kwargs: {{url: '{url}', question: 'Is it red?'}}}}]",
    ],
)
def test_a_url_with_a_user_and_password_is_refused_at_load_without_showing_it(tmp_path, term, capsys):
    """``http://user:PASSWORD@host:port``: refused at load naming the key, the password never printed (before: an
    unreachable server, "Name or service not known", the password in the message); nothing written."""
    url = f"http://user:{PASSWORD}@127.0.0.1:8000"
    override = term.format(url=url)
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.kwargs\.url=.*user:<redacted>@.*user name and password"):
        TrainConfig.from_yaml("configs/shapes/grpo.yaml", [override])
    args = ["train", "configs/shapes/grpo.yaml", override, f"train.output_dir={tmp_path / 'runs'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert PASSWORD not in err and "user name and password" in err, err
    assert not (tmp_path / "runs").exists()


def test_the_judge_and_the_remote_reward_refuse_a_user_part_when_built_too():
    from flowrl_rewards.core.registry import build_reward

    for name, kwargs in (
        ("remote", {"url": f"http://user:{PASSWORD}@127.0.0.1:1/score"}),
        ("vlm_judge", {"url": f"http://user:{PASSWORD}@127.0.0.1:1", "question": "Is it red?"}),
    ):
        with pytest.raises(ValueError, match="user name and password") as caught:
            build_reward(name, **kwargs)
        assert PASSWORD not in str(caught.value)


# ---- 4. a secret in a URL's query ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["api_key", "apikey", "token", "access_token", "key", "X-Amz-Signature", "sig", "auth", "password"]
)
def test_query_parameters_named_as_secrets_are_redacted(name):
    url = f"https://h:8443/score?n=3&{name}={QUERY_KEY}&keyword=cat"
    assert redact_url(url) == f"https://h:8443/score?n=3&{name}={REDACTED}&keyword=cat"


def test_other_urls_and_strings_are_left_as_written():
    for text in ("http://h:8000/score", "http://h/s?page=2&keyword=x&passage=y", "not a url", "a=b&token=c"):
        assert redact_url(text) == text
    assert redact_kwargs({"url": f"http://h/s?token={QUERY_KEY}"}) == {"url": f"http://h/s?token={REDACTED}"}


class _Scores(http.server.BaseHTTPRequestHandler):
    """A reward server that scores every image 0.5 and records each request line."""

    seen: list[str] = []

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 — the stdlib's name
        self.seen.append(f"GET {self.path} {self.headers.get('Authorization')}")
        self._reply({"status": "ok", "reward": "half"})

    def do_POST(self):  # noqa: N802
        self.seen.append(f"POST {self.path} {self.headers.get('Authorization')}")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply({"scores": [0.5] * len(body["images"])})

    def log_message(self, *args):
        pass


@pytest.fixture
def scores_server():
    _Scores.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scores)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Scores.seen
    server.shutdown()
    server.server_close()


def _remote_run(tmp_path: Path, kwargs: str) -> TrainConfig:
    from tests.test_trainer import PROMPTS

    return TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=2",
            "rollout.group_size=2",
            "rollout.steps=2",
            "rollout.window.mode=all",
            f"prompts.train={PROMPTS}",
            "prompts.per_step=2",
            "prompts.eval=null",
            "train.max_steps=1",
            "train.checkpoint_every=1",
            "train.async_reward=false",
            f"train.output_dir={tmp_path}",
            "train.name=q",
            "train.progress=false",
            f"rewards=[{{name: remote, kwargs: {kwargs}}}]",
        ],
    )


def test_a_secret_in_a_remote_urls_query_is_stored_nowhere_and_asked_for_again(tmp_path, scores_server):
    """``url: …/score?api_key=…``: the server receives it, config.yaml and checkpoints/step-1/trainer_state.pt do
    not hold it (before: both did), and the saved config used again asks for it."""
    from flowrl.run.model import run_config
    from flowrl.training.trainer import Trainer
    from tests.conftest import make_model

    base, seen = scores_server
    cfg = _remote_run(tmp_path, f"{{url: '{base}/score?api_key={QUERY_KEY}'}}")
    Trainer(cfg, model=make_model("sd3")).train()
    assert any(line.startswith(f"POST /score?api_key={QUERY_KEY}") for line in seen), seen
    run = tmp_path / "q"
    assert (run / "checkpoints" / "step-1" / "trainer_state.pt").is_file()
    assert _files_holding(run, QUERY_KEY) == []
    assert f"/score?api_key={REDACTED}" in (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.kwargs\.url is .*api_key=<redacted>.*give it again"):
        run_config(str(run), None, [])


def test_the_remote_reward_sends_a_key_from_the_environment(tmp_path, scores_server, monkeypatch):
    """``api_key_env``: the key travels as ``Authorization: Bearer <key>`` and is written nowhere; unset or with a
    newline it is refused at build, naming the variable and never the key."""
    import torch

    from flowrl_rewards.core.registry import build_reward

    base, seen = scores_server
    monkeypatch.setenv("ROUND5_REWARD_KEY", KEY)
    reward = build_reward("remote", url=f"{base}/score", api_key_env="ROUND5_REWARD_KEY")
    assert reward(torch.rand(2, 3, 8, 8), ["a", "b"], {}).tolist() == [0.5, 0.5]
    assert seen[-1] == f"POST /score Bearer {KEY}"
    monkeypatch.setenv("ROUND5_REWARD_KEY", KEY + "\n")
    with pytest.raises(ValueError, match="ROUND5_REWARD_KEY.*newline") as caught:
        build_reward("remote", url=f"{base}/score", api_key_env="ROUND5_REWARD_KEY")
    assert KEY not in str(caught.value)
    monkeypatch.delenv("ROUND5_REWARD_KEY")
    with pytest.raises(ValueError, match="ROUND5_REWARD_KEY is not set"):
        build_reward("remote", url=f"{base}/score", api_key_env="ROUND5_REWARD_KEY")


def test_a_count_of_tokens_is_no_secret_but_every_named_key_is():
    """``max_tokens`` (the judge's answer length) was redacted as a "token" and a saved config then asked for it
    again; a key is still hidden by any of its spellings."""
    from flowrl.config.secrets import is_secret

    assert not any(map(is_secret, ("max_tokens", "tokenizer", "top_logprobs", "api_key_env", "url")))
    assert all(map(is_secret, ("api_key", "apiKey", "x-api-key", "hf_token", "accessToken", "client_secret")))
    command = ["eval.rewards=[{name: vlm_judge, kwargs: {max_tokens: 5, api_key: " + KEY + "}}]"]
    assert redact_command(command) == [
        f"eval.rewards=[{{name: vlm_judge, kwargs: {{max_tokens: 5, api_key: {REDACTED}}}}}]"
    ]
