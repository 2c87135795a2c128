"""One process owns a run folder at a time: :class:`FolderLock`, an OS lock on its lock file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from flowrl.run.outputs import LOCK_FILE


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.flowrl.lock``, which holds the owner's pid, host and start time
    for a refusal to name. The kernel drops it when the process ends, ``kill -9`` included."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock (the folder must exist): None when taken, else a description of the holder."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return self.holder()
            try:
                mine = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                mine = False
            if not mine:  # the holder removed the file as it let go: take the next one
                os.close(fd)
                continue
            record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(record).encode())
            self.fd = fd
            return None
        raise OSError(f"could not lock {self.path}: it was replaced 100 times in a row")

    def holder(self) -> str:
        """The holder as its lock file names it (read again briefly while a new holder is writing it)."""
        for _ in range(20):
            try:
                record = json.loads(self.path.read_text())
                return f"pid {record['pid']} on host {record['host']}, since {record['since']}"
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.05)
        return "a process that has not written its pid yet"

    def release(self) -> None:
        """Remove the lock file (while still holding it, so nobody takes a file about to go) and let go."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None
