"""The ``remote`` reward's credentials (issue 54): its ``headers`` never follow a redirect to another scheme, host or
port (refused, naming the URL and the Location), a redirect within the origin is followed with the POST's body, and a
header value with control characters or whitespace at an end is refused at load without being shown."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from flowrl_rewards.serving.remote import RemoteReward, RemoteRewardError


class Server:
    """A server on 127.0.0.1 that records every request (method, path, headers, body) and answers with
    ``answer(handler, body)``."""

    def __init__(self, answer):
        self.seen = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def handle_any(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length) if length else b""
                outer.seen.append((self.command, self.path, dict(self.headers), body))
                answer(self, body)

            do_GET = do_POST = handle_any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def send(handler, status, body=b"", headers=()):
    handler.send_response(status)
    for key, value in headers:
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def scores_for(body):
    n = len(json.loads(body)["images"]) if body else 0
    return json.dumps({"scores": [0.5] * n, "status": "ok"}).encode()


@pytest.fixture
def servers():
    made = []

    def start(answer):
        made.append(Server(answer))
        return made[-1]

    yield start
    for s in made:
        s.close()


HEADERS = {"Authorization": "Bearer s3cret", "X-Api-Key": "k3y"}


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_port_is_refused_and_the_headers_never_reach_it(servers, status):
    elsewhere = servers(lambda h, body: send(h, 200, scores_for(body)))
    hop = servers(lambda h, body: send(h, status, headers=[("Location", elsewhere.url + h.path)]))
    remote = RemoteReward(hop.url + "/score", headers=HEADERS, retries=0, timeout=5)
    with pytest.raises(
        RemoteRewardError,
        match=rf"{hop.url}/score answered HTTP {status} redirecting to Location: "
        rf"{elsewhere.url}/score; not followed: .*credentials",
    ) as e:
        remote(torch.rand(1, 3, 8, 8), ["a"])
    assert "s3cret" not in str(e.value) and "k3y" not in str(e.value)
    with pytest.raises(
        RemoteRewardError,
        match=rf"health check {hop.url}/health failed.*Location: "
        rf"{elsewhere.url}/health; not followed",
    ):
        remote.health()
    assert elsewhere.seen == []  # neither the POST nor the health check reached it
    assert [s[:2] for s in hop.seen] == [("POST", "/score"), ("GET", "/health")]


def test_a_redirect_to_another_host_or_scheme_is_refused_too(servers):
    for target in ("http://localhost:{port}/score", "https://127.0.0.1:{port}/score"):
        hop = servers(
            lambda h, body, t=target: send(h, 307, headers=[("Location", t.format(port=h.server.server_address[1]))])
        )
        with pytest.raises(RemoteRewardError, match="not followed: it leads to another scheme, host or port"):
            RemoteReward(hop.url + "/score", headers=HEADERS, retries=0, timeout=5)(torch.rand(1, 3, 8, 8), ["a"])
        assert len(hop.seen) == 1


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_within_the_origin_is_followed_with_the_body(servers, status):
    def answer(h, body):
        if h.path == "/old":
            send(h, status, headers=[("Location", "/score")])
        else:
            send(h, 200, scores_for(body))

    server = servers(answer)
    scores = RemoteReward(server.url + "/old", headers=HEADERS, retries=0, timeout=5)(
        torch.rand(2, 3, 8, 8), ["a", "b"]
    )
    assert scores.tolist() == [0.5, 0.5]
    (m1, p1, _, b1), (m2, p2, h2, b2) = server.seen
    assert (
        (m1, p1, m2, p2) == ("POST", "/old", "POST", "/score") and b1 == b2 and h2["Authorization"] == "Bearer s3cret"
    )


def test_a_302_of_a_post_within_the_origin_is_refused_naming_why(servers):
    server = servers(lambda h, body: send(h, 302, headers=[("Location", "/elsewhere")]))
    with pytest.raises(
        RemoteRewardError,
        match=r"HTTP 302 redirecting to Location: http://127.0.0.1:\d+/elsewhere; "
        r"not followed: a 302 turns the POST into a GET without its body",
    ):
        RemoteReward(server.url + "/score", retries=0, timeout=5)(torch.rand(1, 3, 8, 8), ["a"])
    assert [s[:2] for s in server.seen] == [("POST", "/score")]


@pytest.mark.parametrize(
    "value, what",
    [
        ("Bearer s3cret\n", r"a newline \(U\+000A\) at its end"),
        ("Bearer s3cret\r\nX-Evil: 1", r"a carriage return \(U\+000D\) at character 14"),
        (" Bearer s3cret", r"a space \(U\+0020\) at its start"),
    ],
)
def test_a_header_value_with_control_characters_is_refused_at_load_without_showing_it(value, what):
    with pytest.raises(ValueError, match=rf"remote: headers\['Authorization'\] holds {what}") as e:
        RemoteReward("http://127.0.0.1:1/score", headers={"Authorization": value})
    assert "s3cret" not in str(e.value)
    with pytest.raises(ValueError, match=r"headers\['X-Count'\] must be a string, got int"):
        RemoteReward("http://127.0.0.1:1/score", headers={"X-Count": 3})
    RemoteReward("http://127.0.0.1:1/score", headers={"Authorization": "Bearer s3cret"})  # a space inside is fine
