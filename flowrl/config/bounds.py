"""Stated maxima of the sizes that drive a command's memory or time, checked before any work starts, so a typo
such as ``--num 100000000`` or ``eval.steps=100000000`` fails at once naming the flag or key instead of with a
MemoryError after minutes (or minutes of silence). They sit far above any real use: flow models sample in 10–50
steps (1,000 covers any solver), and ``flowrl sample`` keeps every image of a call for its grid."""

from __future__ import annotations

from typing import Any

from flowrl.errors import ConfigError

MAX_STEPS = 1000  # sampling steps: --steps, eval.steps, rollout.steps (and a plan's other step counts)
MAX_IMAGES = 10_000  # images per prompt of one flowrl sample call (--num)
MAX_SIDE = 8192  # pixels of an image side: model.height/width, eval.height/width (the largest families train at 2048;
# far beyond, FLUX's resolution-dependent shift exp(mu) overflows: 20,000² gave a bare OverflowError)
SIDE_KEYS = ("model.height", "model.width", "eval.height", "eval.width")
PEAK_TFLOPS = (0.001, 10_000.0)
"""The accepted range of ``train.peak_tflops`` (bf16 TFLOP/s of one device, the denominator of ``perf/mfu``): from a
GFLOP/s (a small CPU) to 10 PFLOP/s, several times the dense bf16 peak of any GPU; 1e-300 made MFU
2.6e298, 1e300 made it 2e-302."""
STEP_KEYS = ("steps", "preview_steps")  # keys of the rollout section counting sampling steps, where a plan has them


def at_most(name: str, value: float, limit: float, what: str) -> None:
    """``value`` of flag or key ``name`` is at most ``limit``; else a ConfigError naming both and why."""
    if value > limit:
        raise ConfigError(
            f"{name}={value!r} is more than {limit:,g}, the most flowrl accepts ({what}); a size this "
            "large would run out of memory or run for hours, so nothing was started"
        )


def check_sizes(cfg: Any) -> None:
    """The step counts of a loaded config (``eval.steps``, ``rollout.steps``, ``rollout.preview_steps``) within
    :data:`MAX_STEPS`, and the image sides (:data:`SIDE_KEYS`) within :data:`MAX_SIDE`."""
    at_most("eval.steps", cfg.eval.steps, MAX_STEPS, "ODE steps of each held-out image")
    for key in SIDE_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            at_most(key, value, MAX_SIDE, "pixels of an image side")
    for key in STEP_KEYS:
        value = getattr(cfg.rollout, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            at_most(f"rollout.{key}", value, MAX_STEPS, "sampling steps of each rollout")
