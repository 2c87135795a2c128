"""Issue 63, round five, the reward server (docs/reliability.md, "Round five"): it stops on SIGINT and SIGTERM to its
process group however it was started (a non-interactive shell's background job inherits SIGINT ignored), workers
and LitServe's manager included, quietly (no "Monitoring worker crashed", no traceback) and with the signal's exit
status; requests it refuses are named in its JSON error form."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _background_job(log: Path) -> subprocess.Popen:
    """``python -m flowrl_rewards.serving.serve brightness --port 0`` as a non-interactive shell's ``&`` starts it:
    SIGINT (and SIGQUIT) ignored, its own session here so the test can find every process it starts."""

    def as_a_background_job() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "flowrl_rewards.serving.serve", "brightness", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
            preexec_fn=as_a_background_job,
            start_new_session=True,
        )


def _ready_port(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> int:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(timeout) else ""
    assert line.startswith("serving brightness on http://127.0.0.1:"), (line, log.read_text()[-3000:])
    return int(line.rsplit(":", 1)[1].split("/")[0])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_background_server_stops_on_a_signal_to_its_group_quietly_with_every_process(tmp_path, signum):
    """Before: after SIGINT every process stayed alive, the port listening and /health hanging; after SIGTERM (what
    ``timeout`` sends the group) the log held "Monitoring worker crashed" and a BrokenPipeError traceback."""
    pytest.importorskip("litserve", reason="the reward server needs the 'serve' extra")
    log = tmp_path / "server.log"
    proc = _background_job(log)
    try:
        port = _ready_port(proc, log)
        started = _session(proc.pid)
        assert len(started) >= 3, started  # the main process, the HTTP server, a scoring worker, the manager …
        os.killpg(proc.pid, signum)
        rc = proc.wait(30)
        deadline = time.monotonic() + 10
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(proc.pid) == [], "processes left behind"
        assert not _listening(port)
        assert rc == 128 + signum, (rc, log.read_text()[-3000:])
        text = log.read_text()
        assert "Traceback" not in text and "ERROR" not in text and "crashed" not in text, text[-3000:]
    finally:
        for pid in _session(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


# ---- the requests it refuses, in its JSON error form --------------------------------------------------------------
@pytest.fixture(scope="module")
def server_port():
    pytest.importorskip("litserve", reason="the reward server needs the 'serve' extra")
    from flowrl_rewards.serving.serve_process import RewardServerProcess

    with RewardServerProcess("brightness", args=["--max-body-mb", "1"], cwd=ROOT) as server:
        yield int(server.url.rsplit(":", 1)[1].split("/")[0])


def _first_reply(port: int, request: bytes, wait: float = 10.0) -> tuple[float, int, dict]:
    """(seconds until the whole reply's head and body arrived, status, JSON body) of one raw request."""
    import json

    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(wait)
        start = time.monotonic()
        conn.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - start
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), data[:400]
    return elapsed, int(head.split()[1]), json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_a_prompt_that_is_not_a_string_is_named_by_its_type(server_port):
    """``"prompts": [5]`` (and an image count that matches): before, a message about counts."""
    import base64
    import json

    from tests.test_reward_server import black_png

    body = json.dumps({"images": [base64.b64encode(black_png(4, 4)).decode()], "prompts": [5]}).encode()
    request = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    _, status, reply = _first_reply(server_port, request)
    assert status == 400 and "prompts[0] is int (5), expected a string" in reply["error"], reply


@pytest.mark.parametrize(
    "head,body",
    [
        (b"Content-Length: 2", b'{"images": [], "prompts": []}'),
        (b"Content-Length: abc", b"{}"),
        (b"Content-Length: 2\r\nContent-Length: 3", b"{}"),
    ],
    ids=["shorter than the body", "not a number", "given twice"],
)
def test_a_lying_content_length_gets_the_json_error_form(server_port, head, body):
    """Before: uvicorn's plain-text "Invalid HTTP request received."."""
    _, status, reply = _first_reply(server_port, b"POST /score HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n" + body)
    assert status == 400 and "not a valid HTTP request" in reply["error"] and "Content-Length" in reply["error"]


def test_a_body_declaring_99999999999_bytes_is_refused_at_once_with_413(server_port):
    """Before: the server waited for the body (to drain it) and the client saw nothing."""
    elapsed, status, reply = _first_reply(
        server_port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}"
    )
    assert status == 413 and "99999999999 bytes exceeds the limit" in reply["error"] and elapsed < 2.0, elapsed


def test_the_server_scores_a_16_bit_png_by_its_value(server_port):
    """brightness of a 16-bit grey PNG of 0.61: before, 1.0 (PIL clipped it to 8 bits)."""
    import base64
    import io
    import json

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), round(0.61 * 65535), dtype=np.uint16)).save(buffer, format="PNG")
    body = json.dumps({"images": [base64.b64encode(buffer.getvalue()).decode()], "prompts": ["p"]}).encode()
    request = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    _, status, reply = _first_reply(server_port, request)
    assert status == 200 and abs(reply["scores"][0] - 0.61) < 1 / 255, reply
