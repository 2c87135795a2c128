"""Ctrl-C (SIGINT) or SIGTERM (schedulers, ``docker stop``) during training: finish the iteration, save a
checkpoint, stop (a second signal aborts at once). Outside the loop (the start: loading, the first eval) both
abort at once as KeyboardInterrupt, so the run folder's owner can remove what a stopped start created."""

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


@contextlib.contextmanager
def abort_on_terminate() -> Iterator[None]:
    """While held, SIGTERM raises KeyboardInterrupt as Ctrl-C does (its default would end the process where it
    stands, past every ``finally``); :func:`stop_on_first_interrupt` inside it takes over for the loop and
    gives it back. Only installed in the main thread."""

    def handler(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while held: a clean-up that is already under way (a stopped start removing
    its folder) is not cut short by another Ctrl-C and left half done."""
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
