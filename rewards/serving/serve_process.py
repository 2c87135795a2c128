"""Start ``python -m flowrl_rewards.serving.serve`` as a child process and wait until it answers (tests, notebooks).

    with RewardServerProcess("brightness") as server:
        remote = build_reward("remote", url=server.url)

The server runs in its own session; :meth:`RewardServerProcess.close` sends it SIGTERM (it then stops its
workers, and exits with 143) and kills it after ``grace`` seconds if it has not ended (the processes it started leave
its process group and die with it). Its log (stderr) is kept in a temporary file:
:attr:`RewardServerProcess.log` reads it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

READY_PREFIX = "serving "


class RewardServerProcess:
    """A reward server in a child process.

    name: the reward (registry name, ``module:Class`` or ``file.py:Class``). kwargs: the reward's kwargs.
    args: more flags of ``python -m flowrl_rewards.serving.serve`` (``--token-env``, ``--batch-size``, …).
    env: the child's environment (default: this one). timeout: seconds to wait for the ready line.
    RuntimeError (with the server's log) if it exits or stays silent instead.
    """

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any] | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | Path | None = None,
    ):
        import json

        self._log = tempfile.NamedTemporaryFile(prefix="reward-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "flowrl_rewards.serving.serve", name, "--port", "0", *args]
        if kwargs:
            cmd += ["--kwargs", json.dumps(kwargs)]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=cwd, start_new_session=True
        )
        line = self._ready_line(timeout)
        self.reward_name, _, self.url = line[len(READY_PREFIX) :].strip().partition(" on ")
        self.base_url = self.url.rsplit("/", 1)[0]

    def _ready_line(self, timeout: float) -> str:
        import selectors

        line = None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout):
                line = self.proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return line
        if line == "":  # stdout closed: the server is exiting on its own; its own exit code, not close()'s SIGTERM
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.close()
        log = self.log
        self.remove_log()
        why = (
            f"no ready line within {timeout:g} s, stopped"
            if line is None
            else f"it exited with code {self.proc.returncode}"
            if line == ""
            else f"it printed {line.strip()[:200]!r} instead of its ready line"
        )
        raise RuntimeError(f"the reward server did not start ({why}); its log:\n{log[-4000:]}")

    @property
    def log(self) -> str:
        """The server's log (stderr) so far."""
        return Path(self._log.name).read_text(errors="replace")

    def close(self, grace: float = 15.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL of its process group after ``grace`` s); its exit code (143 for a
        stop by SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever it started and left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def remove_log(self) -> None:
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> RewardServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.remove_log()
