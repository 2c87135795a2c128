"""Gradient signal-to-noise (``flowrl snr``): the estimator on known mixtures, and the measured
gradient is exactly the one the first update steps along."""

from __future__ import annotations

import pytest
import torch

from flowrl.commands.snr import adam_normalised, gradient_snr, split_signal_noise
from flowrl.config.schema import TrainConfig
from flowrl.training.trainer import Trainer
from tests.conftest import make_model
from tests.test_trainer import tiny_config


def draws(signal_norm: float, noise_std: float, n: int = 16, dims: int = 20_000, seed: int = 0) -> torch.Tensor:
    """n gradients [n, dims] = a fixed direction of norm ``signal_norm`` + isotropic noise."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(dims, generator=gen)
    direction = direction / direction.norm() * signal_norm
    return direction + noise_std * torch.randn(n, dims, generator=gen)


def test_estimator_recovers_known_signal_and_noise():
    # S = 1, noise per batch N = 0.02² · 20,000 = 8: SNR 1/8, a batch of 64 needs 512 samples for SNR 1
    out = split_signal_noise(draws(1.0, 0.02), samples_per_batch=64)
    assert out["signal_detected"] == 1.0
    assert out["signal"] == pytest.approx(1.0, rel=0.25)
    assert out["noise"] == pytest.approx(8.0, rel=0.05)
    assert out["samples_for_snr_1"] == pytest.approx(512, rel=0.3)
    assert out["mean_pairwise_cosine"] == pytest.approx(1 / 9, rel=0.3)


def test_pure_noise_is_not_called_signal():
    out = split_signal_noise(draws(0.0, 0.02, seed=3), samples_per_batch=64)
    assert out["signal_detected"] == 0.0
    assert abs(out["signal"]) < 3 * out["signal_error"]


@pytest.mark.parametrize("seed", range(5))
def test_undetected_signal_gives_a_lower_bound_that_holds(seed):
    # S = 0.01, N = 8: the truth is 64 · 8 / 0.01 = 51,200 samples; too weak to detect in 16 draws
    out = split_signal_noise(draws(0.1, 0.02, seed=seed), samples_per_batch=64)
    assert out["signal_detected"] == 0.0
    assert 64 < out["samples_for_snr_1_at_least"] <= 51_200


def test_jackknife_error_matches_leave_one_out_by_brute_force():
    g = draws(0.3, 0.05, n=7, dims=50, seed=1)
    n = g.shape[0]
    gram = g.double() @ g.double().T

    def mean_pairs(idx):
        return sum(float(gram[i, j]) for i in idx for j in idx if i < j) / (len(idx) * (len(idx) - 1) / 2)

    loo = torch.tensor([mean_pairs([i for i in range(n) if i != k]) for k in range(n)], dtype=torch.float64)
    expected = float(((n - 1) / n * (loo - loo.mean()).pow(2).sum()).sqrt())
    out = split_signal_noise(g, 8)
    assert out["signal"] == pytest.approx(mean_pairs(list(range(n))), rel=1e-9)
    assert out["signal_error"] == pytest.approx(expected, rel=1e-6)


def test_estimator_rejects_two_draws():
    with pytest.raises(ValueError, match=r"N >= 3"):
        split_signal_noise(torch.zeros(2, 5), 8)


def test_adam_normalisation_gives_unit_rms_columns_and_keeps_zero_columns():
    g = torch.randn(6, 4) * torch.tensor([1e-6, 1.0, 1e3, 0.0])
    normed = adam_normalised(g)
    assert torch.allclose(normed[:, :3].pow(2).mean(0), torch.ones(3, dtype=torch.float64))
    assert torch.equal(normed[:, 3], torch.zeros(6, dtype=torch.float64))


def test_policy_gradient_is_the_first_update_gradient_and_leaves_weights_alone(tmp_path):
    cfg = tiny_config(tmp_path, "snr", "loss.kl_ref=0")
    trainer = Trainer(cfg, model=make_model("sd3"))
    before = [p.detach().clone() for p in trainer.params]
    measured, samples = trainer.policy_gradient(0)
    assert samples == 8  # the forest's leaves
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))
    assert all(p.grad is None for p in trainer.params)
    assert measured.abs().sum() > 0

    stepped = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: stepped.append(
            torch.cat([p.grad.detach().reshape(-1).clone() for p in trainer.params])
        )
    )
    cfg.optim.grad_clip = 1e9  # compare unclipped gradients
    forest, _ = trainer.rollout(0)
    trainer.credit.assign(forest)
    trainer.update(forest, 0)
    assert torch.allclose(stepped[0], measured, rtol=1e-5, atol=1e-12)
    # the same iteration thrice is the same draw: all power is "signal", cosine 1
    draws = [trainer.policy_gradient(1)[0] for _ in range(3)]
    stats = split_signal_noise(torch.stack(draws), 8)
    assert stats["mean_pairwise_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_gradient_snr_runs_independent_iterations(tmp_path, monkeypatch):
    import flowrl.config.build as build

    model = make_model("sd3")
    monkeypatch.setattr(build, "build_model", lambda *a, **k: model)
    out = gradient_snr(tiny_config(tmp_path, "snr2", "loss.kl_ref=0"), batches=3, progress=False)
    assert out["batches"] == 3 and out["samples_per_batch"] == 8
    assert out["noise"] > 0  # different iterations draw different prompts and noise
    assert -1.0 <= out["mean_pairwise_cosine"] < 1.0 - 1e-6
    assert ("samples_for_snr_1" in out) != ("samples_for_snr_1_at_least" in out)
    assert "adam_mean_pairwise_cosine" in out


def test_cli_rejects_one_batch_with_a_clear_error(tmp_path, capsys):
    from flowrl.commands.main import main

    assert main(["snr", "--batches", "2", f"train.output_dir={tmp_path}"]) == 2
    assert "--batches=2 must be >= 3" in capsys.readouterr().err


def test_checkpoint_measures_the_iterations_the_run_would_do_next(tmp_path, monkeypatch):
    import flowrl.config.build as build

    monkeypatch.setattr(build, "build_model", lambda *a, **k: make_model("sd3"))
    cfg = tiny_config(
        tmp_path, "snr3", "loss.kl_ref=0", "train.max_steps=2", "train.checkpoint_every=2", "prompts.eval=null"
    )
    Trainer(cfg).train()
    seen = []

    def fake_gradient(self, iteration):
        seen.append(iteration)
        return torch.randn(10), 8

    monkeypatch.setattr(Trainer, "policy_gradient", fake_gradient)
    gradient_snr(
        tiny_config(tmp_path, "snr3", "loss.kl_ref=0"), batches=3, checkpoint=str(tmp_path / "snr3"), progress=False
    )
    assert seen == [2, 3, 4]


@pytest.mark.parametrize("preset", ["grpo", "branchgrpo", "tp_grpo", "solrl", "nft"])
def test_snr_runs_on_every_kind_of_plan(tmp_path, monkeypatch, preset):
    """Chains, tree, probed and explore presets: samples are counted on the forests, not from chain keys."""
    import flowrl.config.build as build

    model = make_model("sd3")
    monkeypatch.setattr(build, "build_model", lambda *a, **k: model)
    cfg = TrainConfig.from_yaml(
        f"configs/shapes/{preset}.yaml",
        [
            "prompts.per_step=2",
            f"train.output_dir={tmp_path}",
            "train.num_threads=1",
            "model.full_finetune=false",
            "model.lora.rank=2",
        ],
    )
    out = gradient_snr(cfg, batches=3, progress=False)
    assert out["batches"] == 3 and out["samples_per_batch"] > 0 and out["noise"] > 0


SUBCLASS = '''
from dataclasses import dataclass

from flowrl.objectives.nft import NFTLoss


@dataclass
class SharpNFT(NFTLoss):
    """An out-of-tree variant of NFT: its reward-free point is NFT's, declared by the base."""

    extra_scale: float = 1.0
'''


def test_reward_only_takes_any_objective_that_declares_a_reward_free_point(tmp_path, monkeypatch):
    """``flowrl snr --reward-only`` asks the objective (its description's reward-free overrides, moving there): a
    subclass
    of NFT loaded from a file is measured, its old copy put at the weights and its teacher and kl_ref switched off; an
    objective that declares no such point is refused naming loss.objective."""
    import flowrl.config.build as build
    from flowrl.config.schema import ConfigError
    from flowrl.objectives.nft import NFTLoss

    plugin = tmp_path / "sharp.py"
    plugin.write_text(SUBCLASS)
    model = make_model("sd3")
    monkeypatch.setattr(build, "build_model", lambda *a, **k: model)
    moved = []
    monkeypatch.setattr(
        NFTLoss,
        "move_to_reward_free_point",
        lambda self: moved.append(type(self).__name__) or self._old.copy_from_policy(),
    )
    from tests.test_forward_process import tiny

    cfg = tiny(
        tmp_path,
        "sub",
        f"loss.objective={plugin}:SharpNFT",
        "loss.kl_ref=0.5",
        "loss.teacher={guidance: 3.0, anchor: 1.0}",
    )
    out = gradient_snr(cfg, batches=3, progress=False, reward_only=True)
    assert moved == ["SharpNFT"] and out["batches"] == 3
    assert cfg.loss.kl_ref == 0.0 and cfg.loss.teacher is None  # the objective's own reward-free overrides
    with pytest.raises(ConfigError, match=r"loss.objective='clipped' has no such point: PolicyLoss declares none"):
        gradient_snr(
            tiny_config(tmp_path, "clip", "loss.objective=clipped"), batches=3, progress=False, reward_only=True
        )
    from tests.test_forward_process import tiny as nft_config

    with pytest.raises(ConfigError, match=r"loss.center='teacher': centred on the teacher"):
        gradient_snr(
            nft_config(
                tmp_path,
                "centre",
                "loss.objective=nft",
                "loss.center=teacher",
                "loss.teacher={guidance: 3.0, anchor: 1.0}",
            ),
            batches=3,
            progress=False,
            reward_only=True,
        )
