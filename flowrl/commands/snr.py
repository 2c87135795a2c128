"""``flowrl snr``: is one update's batch big enough for its gradient to point somewhere?

Draws the policy gradient g_i of N independent iterations (fresh prompts and noise each, weights
unchanged) and splits the per-batch gradient power into signal and noise:

- signal S = |E g|², estimated without bias by the mean of the pairwise dot products ⟨g_i, g_j⟩ (i < j);
- per-batch power P = mean |g_i|²; noise N = P − S (the variance a batch of B samples leaves);
- SNR per batch = S/N, and the batch (in samples) for SNR 1: B·N/S — gradients of different batches
  agree on average with cosine S/P.

The standard error of S is the jackknife's (leave one draw out). If S is not above twice that error,
no signal is detected and the report gives a lower bound on the batch needed.
Adam rescales each coordinate by its RMS, so the same statistics are also reported on gradients
normalised per coordinate by their RMS over the N draws (``adam_*``): what the optimizer steps along.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.commands.common import OVERRIDES_HELP, Flag, load_config, split_config_arg
from flowrl.config.schema import TrainConfig


def split_signal_noise(grads: torch.Tensor, samples_per_batch: int) -> dict[str, float]:
    """Signal/noise statistics of N gradient draws ``grads`` [N, P] (N ≥ 3) of one batch size."""
    if grads.ndim != 2 or grads.shape[0] < 3:
        raise ValueError(
            f"need gradients [N >= 3, P] (the error of S drops one draw at a time), got shape {list(grads.shape)}"
        )
    g = grads.double()
    n = g.shape[0]
    gram = g @ g.T
    power = float(gram.diagonal().mean())
    off = gram.sum() - gram.diagonal().sum()  # 2 × the sum over pairs
    signal = float(off / (n * (n - 1)))
    # jackknife: drop one draw (and its n−1 pairs) at a time
    without = (off - 2.0 * (gram.sum(dim=1) - gram.diagonal())) / ((n - 1) * (n - 2))
    error = float(((n - 1) / n * (without - without.mean()).pow(2).sum()).sqrt())
    noise = max(power - signal, 0.0)
    detected = signal > 2.0 * error
    out = {
        "batches": float(n),
        "samples_per_batch": float(samples_per_batch),
        "signal": signal,
        "signal_error": error,
        "noise": noise,
        "mean_pairwise_cosine": signal / power if power > 0 else 0.0,
        "snr_per_batch": signal / noise if noise > 0 else float("inf"),
        "signal_detected": float(detected),
    }
    # batch (samples) at which S equals the noise of one batch: noise shrinks as 1/B
    if detected:
        out["samples_for_snr_1"] = samples_per_batch * noise / signal
    else:  # S is at most Ŝ + 2·error (≈ 97.5% one-sided): at least this many samples
        bound = max(signal, 0.0) + 2.0 * error  # 0 only when every draw is the zero gradient: no batch reaches SNR 1
        out["samples_for_snr_1_at_least"] = samples_per_batch * noise / bound if bound > 0 else float("inf")
    return out


def adam_normalised(grads: torch.Tensor) -> torch.Tensor:
    """``grads`` [N, P] divided per coordinate by its RMS over the N draws (zero columns stay 0)."""
    rms = grads.double().pow(2).mean(dim=0).sqrt()
    return torch.where(rms > 0, grads.double() / rms.clamp(min=1e-300), torch.zeros_like(grads, dtype=torch.float64))


def gradient_snr(
    cfg: TrainConfig,
    batches: int = 12,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    reward_only: bool = False,
) -> dict[str, float]:
    """Gradient signal-to-noise of ``cfg``'s objective at its initial weights (or a run's ``checkpoint``).

    Uses the ``batches`` iterations the run would do next (0.. at the start, from the checkpoint's step
    on), each a full rollout, reward and credit and one backward over all its trained edges.
    "Samples per batch" counts one iteration's leaves; with ``train.updates_per_epoch`` U > 1 an
    update sees 1/U of them. ``reward_only`` (forward-process objectives with an old copy): no teacher
    anchor, no ``kl_ref``, and the old copy set to the measured weights, so every term that does not
    depend on the reward has zero gradient and what is measured is the reward's share.
    """
    from flowrl.training.trainer import Trainer

    if batches < 3:
        raise ValueError(
            f"--batches={batches} must be >= 3 (the signal is the agreement between batches, "
            "its error drops one at a time)"
        )
    cfg.train.progress = False
    cfg.prompts.eval = None
    cfg.train.pipeline = "sync"  # gradients at fixed weights: no update for a rollout process to overlap
    if reward_only:
        for key, value in reward_free_overrides(cfg).items():
            setattr(cfg.loss, key, value)
    trainer = Trainer(cfg)
    if checkpoint:  # a run folder or a checkpoints/step-N folder
        from flowrl.run.checkpoint import find_checkpoint

        trainer.load_checkpoint(find_checkpoint(checkpoint)[0])
    if reward_only:
        trainer.objective.move_to_reward_free_point()
    first = trainer.step
    draws = [
        trainer.policy_gradient(i) for i in tqdm(range(first, first + batches), desc="gradients", disable=not progress)
    ]
    grads = torch.stack([g for g, _ in draws])
    samples = round(sum(n for _, n in draws) / len(draws))  # leaves per iteration, counted on the forests
    out = split_signal_noise(grads, samples)
    adam = split_signal_noise(adam_normalised(grads), samples)
    out.update({f"adam_{k}": v for k, v in adam.items() if k not in ("batches", "samples_per_batch")})
    return out


def reward_free_overrides(cfg: TrainConfig) -> dict:
    """``--reward-only``: the ``loss`` keys that switch off ``cfg``'s objective's reward-independent terms, as the
    objective declares them (:meth:`~flowrl.objectives.base.Objective.describe`'s ``reward_free_overrides``, a subclass
    of NFT
    included); a ConfigError naming ``loss.objective`` for one that declares no reward-free point."""
    from flowrl.config import build
    from flowrl.errors import ConfigError

    facts = build.build_loss(cfg).describe()
    if facts.reward_free_overrides is None:
        raise ConfigError(
            f"--reward-only measures the reward's share of an objective whose other terms can be put at "
            f"zero gradient; loss.objective={cfg.loss.objective!r} has no such point: "
            f"{facts.no_reward_free_point}"
        )
    return dict(facts.reward_free_overrides)


# ---- the command ----------------------------------------------------------------------------------
FLAGS: list[Flag] = [("--batches", 3, None, "independent iterations (the error of the signal drops one at a time)")]


def add_parser(sub, epilog: str) -> None:
    """``flowrl snr`` under ``flowrl``'s sub-parsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "snr",
        help="gradient signal-to-noise of one update: is the batch big enough?",
        description="Policy gradients of N independent iterations at fixed weights; their agreement "
        "is the signal, their spread the noise (docs/benchmarks.md).",
        epilog=epilog,
        formatter_class=fmt,
    )
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml, or the run's)")
    p.add_argument("--batches", type=int, default=12, help="independent iterations to draw (default 12)")
    p.add_argument("--checkpoint", help="measure at a run's newest checkpoint (runs/<name>) or a step-N folder")
    p.add_argument(
        "--reward-only",
        action="store_true",
        help="nft/awm: the reward's share alone (no teacher anchor, "
        "no kl_ref, the old copy set to the weights measured)",
    )
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


# ---- snr --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from flowrl.run.checkpoint import find_checkpoint

    config, overrides = split_config_arg(args.config, args.overrides)
    checkpoint = None
    if args.checkpoint:
        checkpoint, run_dir = find_checkpoint(args.checkpoint)
        config = config or str(run_dir / "config.yaml")
    cfg = load_config(config, overrides)
    result = gradient_snr(cfg, batches=args.batches, checkpoint=checkpoint, reward_only=args.reward_only)
    print(json.dumps(result, indent=2))
    if result["signal_detected"]:
        print(
            f"signal detected: SNR {result['snr_per_batch']:.3g} per batch of {int(result['samples_per_batch'])} "
            "samples; "
            f"about {result['samples_for_snr_1']:.0f} samples per update for SNR 1"
        )
    elif result["signal"] == result["noise"] == 0:
        print(
            f"every one of the {args.batches} gradients is zero: nothing in this objective depends on what was sampled"
        )
    else:
        print(
            f"no signal detected above noise in {args.batches} batches of {int(result['samples_per_batch'])} samples: "
            f"an update needs at least ~{result['samples_for_snr_1_at_least']:.0f} samples for SNR 1"
        )
    return 0
