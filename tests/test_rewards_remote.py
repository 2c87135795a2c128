"""remote + serve: a real server on 127.0.0.1, and servers that refuse, hang, fail and babble.

The real server (LitServe, the `serve` extra) runs in a child process, one per reward for the module; the
server's own limits, token and batching are in tests/test_reward_server.py."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from flowrl_rewards import Reward, build_reward
from flowrl_rewards.serving.remote import RemoteReward, RemoteRewardError
from flowrl_rewards.serving.serve_process import RewardServerProcess

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(timeout=0.5, retries=2, backoff=0.01, max_backoff=0.05)


class MetaEcho(Reward):
    """The mean pixel (as ``brightness``); writes per-sample (the request's ``ids`` and prompts) and scalar diagnostics
    into meta. The module's one real server serves it (a server start costs 3–6 s here)."""

    name = "echo"

    def score(self, images, prompts, meta):
        meta["echo/len"] = len(prompts)
        meta["echo/prompts"] = list(prompts)
        meta["echo/ids"] = [int(i) for i in meta.get("ids", [])]
        return images.mean(dim=(1, 2, 3))


ECHO = f"{__file__}:MetaEcho"


class Boom(Reward):
    name = "boom"

    def score(self, images, prompts, meta):
        raise RuntimeError("model exploded")


@pytest.fixture(scope="module")
def served():
    """``served(name)`` → the score URL of ``python -m flowrl_rewards.serving.serve name`` (started once per module)."""
    pytest.importorskip("litserve", reason="the reward server needs the 'serve' extra")
    servers: dict[str, RewardServerProcess] = {}

    def start(name):
        if name not in servers:
            servers[name] = RewardServerProcess(name, cwd=ROOT)
        return servers[name].url

    yield start
    for server in servers.values():  # all stop at once
        server.proc.terminate()
    for server in servers.values():
        server.close()
        server.remove_log()


def _fake_server(behaviour):
    """An HTTP server whose POST does ``behaviour(handler)``; counts requests."""
    count = {"n": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            count["n"] += 1
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            behaviour(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score", count


def _send(handler, status, body: bytes):
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _images(b=5, seed=0):
    return torch.rand(b, 3, 16, 12, generator=torch.Generator().manual_seed(seed))


def test_remote_matches_local_reward_in_batches(served):
    url = served(ECHO)
    remote = build_reward("remote", url=url, batch_size=2)
    x = _images()
    s = remote(x, ["p"] * 5)
    q = (x * 255).round() / 255  # the server sees 8-bit PNGs
    assert s.dtype == torch.float32 and s.shape == (5,)
    assert torch.allclose(s, q.mean(dim=(1, 2, 3)), atol=1e-6)
    assert torch.equal(s, remote(x, ["p"] * 5))
    assert remote.health() == {"status": "ok", "reward": "echo"}


def test_meta_goes_both_ways_and_is_sliced_per_batch(served):
    url = served(ECHO)
    remote = RemoteReward(url, batch_size=2, name="echo_remote")
    assert remote.name == "echo_remote"
    ids = [7, 3, 9, 1, 5]
    meta = {"ids": ids, "tensor_ids": torch.tensor(ids), "scalar": 3.5, "opaque": object()}
    x = _images()
    s = remote(x, [f"p{i}" for i in range(5)], meta)
    assert torch.allclose(s, ((x * 255).round() / 255).mean(dim=(1, 2, 3)), atol=1e-6)  # the batches' scores, in order
    assert meta["echo/ids"] == ids  # each batch got its own slice of the per-sample meta, in order
    assert meta["echo/prompts"] == [f"p{i}" for i in range(5)]  # per-sample lists concatenated
    assert meta["echo/len"] == 1  # scalars: the last batch's


def test_server_reports_bad_requests_and_reward_failures(served):
    url = served(ECHO)

    def post(body):
        req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=5)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]
        return 200, None

    assert post(b"{not json")[0] == 400
    code, err = post(json.dumps({"images": ["!!"], "prompts": ["a"]}).encode())
    assert code == 400 and "images[0]" in err
    code, err = post(json.dumps({"images": [], "prompts": ["a"]}).encode())
    assert code == 400 and "one prompt string per image" in err


def test_a_server_error_is_retried_then_reported_with_its_message():
    """The client's part of a reward failure on the server (the server's part, a failure isolated and answered 500 with
    its message: test_reward_server.py::test_score_requests_merges_splits_and_isolates_failures; both through a real
    server: the slow test below)."""

    server, url, count = _fake_server(
        lambda handler: _send(handler, 500, json.dumps({"error": "RuntimeError: model exploded"}).encode())
    )
    try:
        with pytest.raises(RemoteRewardError, match="HTTP 500.*model exploded") as info:
            RemoteReward(url, **FAST)(_images(2), ["a", "b"])
        assert "3 attempts" in str(info.value) and count["n"] == 3
    finally:
        server.shutdown()


@pytest.mark.slow  # a server of its own (6–9 s); the twin above and the server's isolation test hold the behaviour
def test_a_reward_that_fails_on_a_real_server_is_reported_with_its_message(served):
    with pytest.raises(RemoteRewardError, match="HTTP 500.*model exploded") as info:
        RemoteReward(served(f"{__file__}:Boom"), **FAST)(_images(2), ["a", "b"])
    assert "3 attempts" in str(info.value)


def test_connection_refused_is_retried_then_clear():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = RemoteReward(f"http://127.0.0.1:{port}/score", **FAST)
    with pytest.raises(RemoteRewardError, match="health check"):
        remote.health()
    t = time.monotonic()
    with pytest.raises(RemoteRewardError, match="connection refused.*3 attempts"):
        remote(_images(2), ["a", "b"])
    assert time.monotonic() - t < 3


def test_hanging_server_times_out_within_bounds():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    conns = []

    def accept_and_hang():
        while True:
            try:
                conns.append(listener.accept()[0])  # never answers
            except OSError:
                return

    threading.Thread(target=accept_and_hang, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    try:
        remote = RemoteReward(url, timeout=0.3, retries=1, backoff=0.01)
        t = time.monotonic()
        with pytest.raises(RemoteRewardError, match="timed out after 0.3 s.*2 attempts"):
            remote(_images(2), ["a", "b"])
        assert time.monotonic() - t < 3
        masked = RemoteReward(url, timeout=0.2, retries=0, on_error="nan", batch_size=1, name="slow")
        meta = {}
        s = masked(_images(2), ["a", "b"], meta)
        assert torch.isnan(s).all() and s.shape == (2,)
        assert meta["slow/failed_batches"] == 2 and meta["slow/failed_samples"] == 2
        assert masked.failed_batches == 2
    finally:
        listener.close()
        for c in conns:
            c.close()


def test_500_is_retried_with_backoff_and_can_be_masked():
    server, url, count = _fake_server(lambda h: _send(h, 500, b'{"error": "overloaded"}'))
    try:
        with pytest.raises(RemoteRewardError, match="HTTP 500.*overloaded"):
            RemoteReward(url, **FAST)(_images(2), ["a", "b"])
        assert count["n"] == 3
        meta = {}
        s = RemoteReward(url, on_error="nan", **FAST)(_images(2), ["a", "b"], meta)
        assert torch.isnan(s).all() and meta["remote/failed_batches"] == 1
    finally:
        server.shutdown()
        server.server_close()


def test_4xx_is_not_retried():
    server, url, count = _fake_server(lambda h: _send(h, 403, b"forbidden"))
    try:
        with pytest.raises(RemoteRewardError, match="HTTP 403.*forbidden"):
            RemoteReward(url, **FAST)(_images(1), ["a"])
        assert count["n"] == 1
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "body,match",
    [
        (b"<html>garbage</html>", "malformed reply: reply is not JSON"),
        (b'{"score": [1]}', "no 'scores' list"),
        (b'{"scores": [1.0]}', "list of 2 numbers, got 1 scores"),
        (b'{"scores": [1.0, "high"]}', r"scores\[1\] = 'high' is not a number"),
    ],
)
def test_malformed_replies_fail_clearly_without_retry(body, match):
    server, url, count = _fake_server(lambda h: _send(h, 200, body))
    try:
        with pytest.raises(RemoteRewardError, match=match):
            RemoteReward(url, **FAST)(_images(2), ["a", "b"])
        assert count["n"] == 1
        meta = {}
        s = RemoteReward(url, on_error="nan", **FAST)(_images(2), ["a", "b"], meta)
        assert torch.isnan(s).all() and meta["remote/failed_samples"] == 2
    finally:
        server.shutdown()
        server.server_close()


def test_non_http_garbage_is_a_clear_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def babble():
        try:
            conn = listener.accept()[0]
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")
            conn.close()
        except OSError:
            pass

    threading.Thread(target=babble, daemon=True).start()
    try:
        with pytest.raises(RemoteRewardError, match="malformed HTTP reply"):
            RemoteReward(f"http://127.0.0.1:{listener.getsockname()[1]}/score", retries=0, timeout=2)(_images(1), ["a"])
    finally:
        listener.close()


def test_bad_remote_kwargs():
    with pytest.raises(ValueError, match="url='localhost:8000'"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match="on_error='skip'"):
        RemoteReward("http://x", on_error="skip")
    with pytest.raises(ValueError, match="timeout=0"):
        RemoteReward("http://x", timeout=0)
    with pytest.raises(ValueError, match="retries=-1"):
        RemoteReward("http://x", retries=-1)


@pytest.mark.slow  # 9–11 s, a server of its own: every RewardServerProcess of this file and test_reward_server.py runs
# this same command line (`python -m flowrl_rewards.serving.serve NAME --port 0 --kwargs ...`) and reads its first line
def test_serve_cli_end_to_end():
    pytest.importorskip("litserve", reason="the reward server needs the 'serve' extra")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowrl_rewards.serving.serve",
            "jpeg_incompressibility",
            "--port",
            "0",
            "--kwargs",
            '{"quality": 50}',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving jpeg_incompressibility on http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() else "",
        )
        url = line.split(" on ")[1].strip()
        x = _images(3)
        remote = RemoteReward(url, timeout=30)
        assert torch.allclose(remote(x, ["a"] * 3), build_reward("jpeg_incompressibility", quality=50)(x, ["a"] * 3))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_serve_cli_rejects_bad_kwargs(capsys):
    from flowrl_rewards.serving.serve import main

    for bad, msg in (("{oops", "not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(SystemExit) as info:
            main(["brightness", "--kwargs", bad])
        assert info.value.code == 2 and msg in capsys.readouterr().err
