"""Ctrl-C (SIGINT) or SIGTERM (schedulers, ``docker stop``) during training: finish the iteration, save a
checkpoint, stop (a second signal aborts at once). A reward that blocks (a served judge that does not answer) is
not waited for: once a stop was asked for, a wait on a reward that lasts
:data:`~flowrl_rewards.background.GRACE_SECONDS` more is cut short
(:class:`~flowrl_rewards.background.RewardWaitCut`, a KeyboardInterrupt: the iteration did not finish, nothing of
it is saved). Outside the loop (the start: loading, the first eval) both abort at once as KeyboardInterrupt, so the
run folder's owner can remove what a stopped start created."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

from flowrl_rewards.background import RewardWaitCut, reward_waits


class StopFlag:
    requested = False


def _named(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"


@contextlib.contextmanager
def stop_on_first_interrupt() -> Iterator[StopFlag]:
    """First SIGINT/SIGTERM: finish the current iteration (or eval), then stop (the loop saves a checkpoint); a wait
    on a reward still going :data:`~flowrl_rewards.background.GRACE_SECONDS` after it (or after its own start) raises
    :class:`~flowrl_rewards.background.RewardWaitCut`. Second: interrupt at once. Only installed in the main
    thread."""
    flag = StopFlag()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.getsignal(s) for s in signals}

        def handler(signum, frame):
            if reward_waits.take_wakeup():  # the grace period of a stop is over (not a user's signal)
                if not reward_waits.waiting_now():
                    return  # the reward answered meanwhile
                print(
                    f"\n{_named(signum)}: the reward did not answer within {reward_waits.grace:g} s of the stop; "
                    "stopping without this iteration (the last saved checkpoint stands)",
                    flush=True,
                )
                raise RewardWaitCut(f"{_named(signum)}: the reward wait was cut short")
            if flag.requested:
                raise KeyboardInterrupt
            flag.requested = True
            print(
                f"\n{_named(signum)}: finishing this iteration, then saving a checkpoint (a reward that has not "
                f"answered {reward_waits.grace:g} s from now is not waited for; again to abort)",
                flush=True,
            )
            reward_waits.stop_requested(signum)

        for s in signals:
            signal.signal(s, handler)
    except ValueError:  # not the main thread
        previous = {}
    reward_waits.reset()
    try:
        yield flag
    finally:
        reward_waits.reset()
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
