"""Ctrl-C (SIGINT) or SIGTERM (schedulers, ``docker stop``) during training: finish the iteration, save a
checkpoint, stop (a second signal aborts at once)."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class StopFlag:
    requested = False


@contextlib.contextmanager
def stop_on_first_interrupt() -> Iterator[StopFlag]:
    """First SIGINT/SIGTERM: finish the current iteration (or eval), then stop (the loop saves a checkpoint).
    Second: interrupt at once. Only installed in the main thread."""
    flag = StopFlag()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.getsignal(s) for s in signals}

        def handler(signum, frame):
            if flag.requested:
                raise KeyboardInterrupt
            flag.requested = True
            what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
            print(f"\n{what}: finishing this iteration, then saving a checkpoint (again to abort)")

        for s in signals:
            signal.signal(s, handler)
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
