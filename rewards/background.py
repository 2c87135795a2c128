"""Scoring in the background, so scoring overlaps the next rollout::

    scorer = BackgroundScorer(multi_reward)           # or any Reward (a flowrl_rewards.Scorer)
    fut = scorer.submit(images, prompts, meta)        # returns at once
    ...                                               # next rollout runs meanwhile
    components = fut.result()                         # {name: float32 [B]}; re-raises a reward's error
    total = multi_reward.combine(components)
    scorer.close()

One worker thread, so batches are scored in submission order and a reward model is never used by two threads at
once. Until the future is done the scorer owns ``images`` and ``meta``: do not modify them in place (rewards may
write diagnostics into ``meta``; read them after ``result()``). Gradients are off in the worker
(``Reward.__call__`` is ``no_grad``). ``enabled=False`` (or ``"auto"`` without CUDA) scores synchronously inside
``submit`` and returns a finished future, so the calling code is the same either way.

A stop cuts a blocking reward short (:class:`RewardWaits`, the module's :data:`reward_waits`): while the training
loop's first Ctrl-C/SIGTERM stands (:func:`flowrl.run.signals.stop_on_first_interrupt` tells it), a wait of the main
thread on a reward (``result()``, a synchronous ``submit``, :func:`flowrl.rollout.scoring.components_of`) that lasts
:data:`GRACE_SECONDS` past both the stop and its own start raises :class:`RewardWaitCut` (a KeyboardInterrupt), so a
served judge that does not answer holds a stopping run for seconds, not a minute. The worker is a daemon thread: a
call still blocking there does not hold the process open once it ends.

It sits beside the port (:mod:`flowrl_rewards.core.port`), below the rollout plans that use it: it calls
:meth:`~flowrl_rewards.core.port.Scorer.components` and nothing of flowrl. What flowrl gives rewards for its prompts (an
edit prompt's instruction text and source image, :func:`flowrl.rollout.scoring.components_of`) comes in as
``inputs``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
import signal
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from flowrl_rewards.core.port import Scorer

Inputs = Callable[[Sequence[str], dict[str, Any], torch.Tensor], "tuple[list[str], dict[str, Any]]"]
"""``(prompts, meta, images) → (prompts, meta)``: what the rewards receive for the prompts of ``images``."""


GRACE_SECONDS = 5.0  # how long a reward may still take once a stop was asked for
POLL_SECONDS = 0.25  # the slices a wait on the worker is cut into (signal handlers run between them)


class RewardWaitCut(KeyboardInterrupt):
    """A stop cut the main thread's wait on a reward short: the iteration it belonged to did not finish."""


class RewardWaits:
    """The main thread's waits on a reward, and a stop that cuts one short (see the module docstring).

    The loop's signal handler calls :meth:`stop_requested` on the first signal; :meth:`waiting` wraps each wait. When
    a wait has lasted ``grace`` seconds past both the stop and its own start, a timer thread sends the stop's signal
    to the main thread again (which interrupts a blocking call there, a synchronous reward's too) after marking it a
    wake-up; the handler asks :meth:`take_wakeup` and raises :class:`RewardWaitCut` while :meth:`waiting_now`.
    :meth:`reset` forgets the stop (the loop's handler is uninstalled)."""

    def __init__(self, grace: float = GRACE_SECONDS):
        self.grace = grace
        self._lock = threading.RLock()  # re-entrant: the handler may run in the main thread while it holds it
        self._since: float | None = None  # when the main thread's current (outermost) wait began
        self._stop: tuple[float, int] | None = None  # when a stop was asked for, and by which signal
        self._timer: threading.Timer | None = None
        self._woken = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on a reward; nothing outside the main thread, nor for a wait inside another."""
        if threading.current_thread() is not threading.main_thread() or self._since is not None:
            yield
            return
        with self._lock:
            self._since = time.monotonic()
            self._arm()
        try:
            yield
        finally:
            with self._lock:
                self._since = None
                self._disarm()

    def waiting_now(self) -> bool:
        return self._since is not None

    def overdue(self) -> bool:
        """Whether the current wait has lasted ``grace`` seconds past both a standing stop and its start."""
        since, stop = self._since, self._stop
        return since is not None and stop is not None and time.monotonic() >= max(since, stop[0]) + self.grace

    def stop_requested(self, signum: int) -> None:
        """A stop was asked for (the loop's first signal ``signum``): the waits from now on have ``grace`` seconds."""
        with self._lock:
            if self._stop is None:
                self._stop = (time.monotonic(), int(signum))
            self._arm()

    def take_wakeup(self) -> bool:
        """Whether the signal being handled is this object's wake-up (then forgotten), not a user's."""
        with self._lock:
            woken, self._woken = self._woken, False
            return woken

    def reset(self) -> None:
        """No stop, no wait, no timer (the loop's signal handling starts or ends)."""
        with self._lock:
            self._since, self._stop, self._woken = None, None, False
            self._disarm()

    def _arm(self) -> None:
        """A timer for the current wait's deadline, when there is a wait and a stop (the lock held)."""
        if self._since is None or self._stop is None or self._timer is not None:
            return
        delay = max(self._since, self._stop[0]) + self.grace - time.monotonic()
        self._timer = threading.Timer(max(0.0, delay), self._wake)
        self._timer.daemon = True
        self._timer.start()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        """The timer: interrupt the main thread's wait, when it still stands (with the stop's signal, marked a
        wake-up first, so the handler does not take it for a second Ctrl-C)."""
        with self._lock:
            if self._timer is threading.current_thread():
                self._timer = None
            if self._since is None or self._stop is None or not hasattr(signal, "pthread_kill"):
                return
            self._woken = True
            signal.pthread_kill(threading.main_thread().ident, self._stop[1])


reward_waits = RewardWaits()
"""The process's one :class:`RewardWaits` (the main thread's waits, the loop's signal handler)."""


class _WaitedFuture(cf.Future):
    """A future whose :meth:`result` waits in :data:`POLL_SECONDS` slices as a wait on a reward
    (:data:`reward_waits`): a stop cuts it short past the grace period. A wait that a KeyboardInterrupt ends tells
    ``worker`` (the call is abandoned: closing the scorer does not wait for it)."""

    worker: "_Worker | None" = None

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._wait(timeout)
        except KeyboardInterrupt:
            if self.worker is not None and not self.done():
                self.worker.abandoned = True
            raise

    def _wait(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with reward_waits.waiting():
            while True:
                left = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
                try:
                    return super().result(left)
                except cf.TimeoutError:
                    if self.done() or (deadline is not None and time.monotonic() >= deadline):
                        raise  # the reward's own TimeoutError, or the caller's timeout
                if reward_waits.overdue():  # the timer's wake-up did not reach the main thread
                    raise RewardWaitCut(f"the reward did not answer within {reward_waits.grace:g} s of the stop")


class _Worker:
    """One daemon thread running submitted calls in order (a ThreadPoolExecutor's threads are joined at exit, so a
    reward blocking there would hold a stopped process open). ``abandoned``: a wait on one of its calls was
    interrupted; :meth:`shutdown` then neither waits for the call running nor starts the queued ones."""

    def __init__(self) -> None:
        self.abandoned = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _WaitedFuture:
        fut = _WaitedFuture()
        fut.worker = self
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 — delivered through the future
                fut.set_exception(e)

    def shutdown(self, wait: bool, cancel: bool) -> None:
        """Stop after the calls already queued (``cancel``: those not started are cancelled); ``wait``: join (neither
        waiting nor running what is queued once a call was ``abandoned``)."""
        if self.abandoned:
            wait, cancel = False, True
        if cancel:
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._queue.get_nowait()
                    if item is not None:
                        item[0].cancel()
        self._queue.put(None)
        if wait:
            self._thread.join()


def _score_when_ready(
    scorer: Scorer,
    inputs: Inputs | None,
    images: torch.Tensor,
    prompts: list[str],
    meta: dict[str, Any],
    ready: "torch.cuda.Event | None",
) -> dict[str, torch.Tensor]:
    """``scorer.components`` of images [B, 3, H, W] (videos [B, F, 3, H, W]) once their copies (``ready``; None: none
    in flight) have landed, the prompts and meta first through ``inputs``."""
    if ready is not None:
        ready.synchronize()
    if inputs is not None:
        prompts, meta = inputs(prompts, meta, images)
    return scorer.components(images, prompts, meta)


class BackgroundScorer:
    """Runs ``reward.components(images, prompts, meta)`` on one worker thread.

    Args:
      reward: a :class:`~flowrl_rewards.core.port.Scorer`: a :class:`~flowrl_rewards.MultiReward` or any
        :class:`~flowrl_rewards.Reward`.
      enabled: True (thread), False (synchronous) or ``"auto"`` (thread iff CUDA is available).
      inputs: ``(prompts, meta, images) → (prompts, meta)`` applied in the worker before scoring (None: as given).
    """

    def __init__(self, reward: Scorer, enabled: bool | str = True, inputs: Inputs | None = None):
        if not isinstance(reward, Scorer):
            raise TypeError(
                f"BackgroundScorer needs a flowrl_rewards.Reward (a flowrl_rewards.Scorer), got {type(reward).__name__}"
            )
        if enabled == "auto":
            enabled = torch.cuda.is_available()
        if not isinstance(enabled, bool):
            raise ValueError(f"BackgroundScorer: enabled={enabled!r} must be True, False or 'auto'")
        self.reward, self.enabled, self.inputs = reward, enabled, inputs
        self._pool = _Worker() if enabled else None
        self._closed = False

    def submit(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        meta: dict[str, Any] | None = None,
        ready: "torch.cuda.Event | None" = None,
    ) -> "cf.Future[dict[str, torch.Tensor]]":
        """Start scoring images [B, 3, H, W] (videos [B, F, 3, H, W]); a future of ``{name: float32 [B]}`` (the
        reward's exception, if it fails). ``ready``: an event the images wait for (copies still in flight,
        :func:`flowrl.rollout.decoding.decode_to_host`), waited for by the worker."""
        if self._closed:
            raise RuntimeError("BackgroundScorer.submit after close()")
        meta = {} if meta is None else meta
        args = (self.reward, self.inputs, images, list(prompts), meta, ready)
        if self._pool is not None:
            return self._pool.submit(_score_when_ready, *args)
        fut: cf.Future = _WaitedFuture()
        try:
            with reward_waits.waiting():  # the reward runs here: a stop cuts it short past the grace period
                fut.set_result(_score_when_ready(*args))
        except Exception as e:  # delivered through the future, as in the threaded mode
            fut.set_exception(e)
        return fut

    def close(self, wait: bool = True) -> None:
        """Stop the worker (after pending batches when ``wait``, else cancelling those not started; after a wait on
        a result was interrupted, as without ``wait``: a reward that does not answer does not hold the close)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel=not wait)

    def __enter__(self) -> "BackgroundScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
