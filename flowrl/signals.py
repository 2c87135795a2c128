"""Ctrl-C during training: finish the iteration, save, stop (a second Ctrl-C aborts at once)."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class StopFlag:
    requested = False


@contextlib.contextmanager
def stop_on_first_interrupt() -> Iterator[StopFlag]:
    """First Ctrl-C: finish the current iteration, then stop (the loop saves a checkpoint).
    Second Ctrl-C: interrupt at once. Only installed in the main thread."""
    flag = StopFlag()
    try:
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if flag.requested:
                raise KeyboardInterrupt
            flag.requested = True
            print("\nCtrl-C: finishing this iteration, then saving a checkpoint (Ctrl-C again to abort)")

        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield flag
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
