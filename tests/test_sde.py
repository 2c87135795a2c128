"""Independent tests of flowrl/rollout/sde.py against docs/algorithms.md, "Conventions" and "Transition kernels".

Every expected value is computed here from the formulas in the spec, in float64 numpy, never by
calling back into the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl.rollout import sde

KERNELS = ("ode", "flow_grpo", "dance", "cps")
DEFAULT_ETA = {"ode": 0.0, "flow_grpo": 0.7, "dance": 0.3, "cps": 0.8}


# ---------------------------------------------------------------------------------------------
# float64 reference of the kernel table (docs/algorithms.md, "Transition kernels")
# ---------------------------------------------------------------------------------------------
def schedule(T: int = 10, shift: float = 3.0) -> np.ndarray:
    """SD3-style shifted schedule σ_0 = 1 > … > σ_T = 0."""
    t = np.linspace(1.0, 0.0, T + 1)
    return shift * t / (1.0 + (shift - 1.0) * t)


def _col(a, x: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        a = np.full(x.shape[0], float(a))
    return a.reshape(x.shape[0], *([1] * (x.ndim - 1)))


def ref_step(kernel, x, v, sigma, sigma_next, eta):
    """(mean, std[B]) of the kernel table, float64. σ' = σ_next on rows where σ = 1 (first step)."""
    x = np.asarray(x, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    s, sn, e = _col(sigma, x), _col(sigma_next, x), _col(eta, x)
    dt = sn - s
    if kernel == "ode":
        mean, std = x + v * dt, np.zeros_like(s)
    elif kernel == "flow_grpo":
        sp = np.where(s == 1.0, sn, s)  # σ' = σ, except σ' = σ_1 when σ = 1
        a = e * np.sqrt(s / (1.0 - sp))
        mean = x * (1.0 + a**2 * dt / (2.0 * s)) + v * (1.0 + a**2 * (1.0 - s) / (2.0 * s)) * dt
        std = a * np.sqrt(-dt)
    elif kernel == "dance":
        x0 = x - s * v
        score = -(x - (1.0 - s) * x0) / s**2
        mean = x + dt * (v - 0.5 * e**2 * score)
        std = e * np.sqrt(-dt)
    elif kernel == "cps":
        x0 = x - s * v
        x1 = x + (1.0 - s) * v
        std = sn * np.sin(e * np.pi / 2.0)
        mean = (1.0 - sn) * x0 + np.sqrt(sn**2 - std**2) * x1
    else:
        raise AssertionError(kernel)
    return mean, np.broadcast_to(std, s.shape).reshape(x.shape[0])


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


# ---------------------------------------------------------------------------------------------
# kernels vs the table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_table_per_sample_sigma_and_eta(kernel):
    sig = schedule(10)
    idx = np.array([0, 1, 3, 5, 8, 9])  # first step (σ = 1), mid-schedule, last step (→ 0)
    B = idx.size
    sigma = torch.tensor(sig[idx], dtype=torch.float32)
    sigma_next = torch.tensor(sig[idx + 1], dtype=torch.float32)
    eta = torch.tensor([0.7, 0.5, 0.9, 0.3, 0.6, 0.4], dtype=torch.float32)
    if kernel == "ode":
        eta = torch.zeros(B)
    x, v, noise = _rand((B, 2, 3, 3), 0), _rand((B, 2, 3, 3), 1), _rand((B, 2, 3, 3), 2)

    x_next, mean, std = sde.step(kernel, x, v, sigma, sigma_next, eta, noise)
    mean_ref, std_ref = ref_step(kernel, _np(x), _np(v), _np(sigma), _np(sigma_next), _np(eta))

    assert mean.shape == x.shape and x_next.shape == x.shape and std.shape == (B,)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32 and x_next.dtype == torch.float32
    np.testing.assert_allclose(_np(std), std_ref, rtol=2e-5, atol=1e-6, err_msg=f"{kernel}: std")
    np.testing.assert_allclose(_np(mean), mean_ref, rtol=2e-5, atol=2e-5, err_msg=f"{kernel}: mean")
    expected_next = _np(mean) + std_ref.reshape(B, 1, 1, 1) * _np(noise)
    np.testing.assert_allclose(
        _np(x_next), expected_next, rtol=2e-5, atol=2e-5, err_msg=f"{kernel}: x_next must be mean + std·noise"
    )
    assert torch.isfinite(x_next).all() and torch.isfinite(std).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("i", [0, 2, 6])
def test_kernel_matches_table_scalar_sigma(kernel, i):
    """Python-float sigma/eta (one step of a schedule for the whole batch)."""
    sig = schedule(8)
    s, sn, eta = float(sig[i]), float(sig[i + 1]), DEFAULT_ETA[kernel]
    x, v, noise = _rand((4, 3, 2, 2), 10 + i), _rand((4, 3, 2, 2), 20 + i), _rand((4, 3, 2, 2), 30 + i)
    x_next, mean, std = sde.step(kernel, x, v, s, sn, eta, noise)
    mean_ref, std_ref = ref_step(kernel, _np(x), _np(v), s, sn, eta)
    np.testing.assert_allclose(_np(std), std_ref, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(_np(mean), mean_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(_np(x_next), mean_ref + std_ref.reshape(-1, 1, 1, 1) * _np(noise), rtol=2e-5, atol=3e-5)


def test_flow_grpo_first_step_hand_values():
    """At σ = 1, σ' = σ_1 = sigma_next: a² = η²/(1−σ_1), so std = a·sqrt(1−σ_1) = η exactly and
    mean = x·(1 − η²/2) + v·dt (the v coefficient's a²(1−σ) term vanishes)."""
    s1 = float(schedule(10)[1])
    eta = 0.7
    x, v = _rand((3, 4), 3), _rand((3, 4), 4)
    _, mean, std = sde.step("flow_grpo", x, v, 1.0, s1, eta)
    assert torch.isfinite(std).all() and torch.isfinite(mean).all(), "σ = 1 must use σ' = σ_next (no 1/(1−σ) blow-up)"
    np.testing.assert_allclose(_np(std), np.full(3, eta), rtol=1e-5)
    np.testing.assert_allclose(_np(mean), _np(x) * (1 - eta**2 / 2) + _np(v) * (s1 - 1.0), rtol=1e-5, atol=1e-6)


def test_flow_grpo_first_step_mixed_batch():
    """Rows at σ = 1 and rows mid-schedule in one call: only σ = 1 rows use σ' = σ_next."""
    sig = schedule(10)
    sigma = torch.tensor([1.0, sig[4], 1.0, sig[7]], dtype=torch.float32)
    sigma_next = torch.tensor([sig[1], sig[5], sig[1], sig[8]], dtype=torch.float32)
    x, v = _rand((4, 5), 5), _rand((4, 5), 6)
    _, mean, std = sde.step("flow_grpo", x, v, sigma, sigma_next, 0.7)
    mean_ref, std_ref = ref_step("flow_grpo", _np(x), _np(v), _np(sigma), _np(sigma_next), 0.7)
    np.testing.assert_allclose(_np(std), std_ref, rtol=2e-5)
    np.testing.assert_allclose(_np(mean), mean_ref, rtol=2e-5, atol=2e-5)
    # mid-schedule rows: a = η·sqrt(σ/(1−σ)) (σ' = σ)
    s, sn = float(sigma[1]), float(sigma_next[1])
    assert float(std[1]) == pytest.approx(0.7 * math.sqrt(s / (1 - s)) * math.sqrt(s - sn), rel=1e-5)


def test_kernels_upcast_to_fp32():
    x, v = _rand((2, 3), 7).bfloat16(), _rand((2, 3), 8).bfloat16()
    x_next, mean, std = sde.step("dance", x, v, 0.5, 0.4, 0.3, _rand((2, 3), 9).bfloat16())
    assert x_next.dtype == mean.dtype == std.dtype == torch.float32


def test_unknown_kernel_raises():
    with pytest.raises(ValueError, match="kernel"):
        sde.step("euler_maruyama", torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, 0.3)


# ---------------------------------------------------------------------------------------------
# η = 0 is the ODE; ODE edges are never trained and never give NaN (docs/algorithms.md, "Transition kernels")
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("i", [0, 4, 9])
def test_eta_zero_is_ode(kernel, i):
    sig = schedule(10)
    s, sn = float(sig[i]), float(sig[i + 1])
    x, v, noise = _rand((3, 2, 4, 4), 40 + i), _rand((3, 2, 4, 4), 50 + i), _rand((3, 2, 4, 4), 60 + i)
    x_next, mean, std = sde.step(kernel, x, v, s, sn, 0.0, noise)
    ode = _np(x) + _np(v) * (np.float32(sn) - np.float32(s))
    assert torch.all(std == 0), f"{kernel}: η = 0 must give std 0, got {std}"
    # flow_grpo/dance reduce algebraically to x + v·dt; cps via (1−σn)x̂0 + σn·x̂1 (fp32 rounding)
    tol = 0 if kernel in ("ode", "flow_grpo", "dance") else 1e-5
    np.testing.assert_allclose(_np(mean), ode, atol=max(tol, 1e-6), rtol=0, err_msg=f"{kernel}: η = 0 mean")
    assert torch.equal(x_next, mean), f"{kernel}: std 0 must ignore the noise"
    lp = sde.log_prob(x_next, mean, std)
    assert torch.isfinite(lp).all() and torch.all(lp == 0), f"{kernel}: log_prob of std-0 rows must be 0, got {lp}"
    lp_off = sde.log_prob(x_next + 0.3, mean, std)  # even off the mean: not trained, never NaN
    assert torch.all(lp_off == 0)
    k = sde.kl(mean, mean + 0.1, std)
    assert torch.isfinite(k).all() and torch.all(k == 0), f"{kernel}: KL of std-0 rows must be 0"
    k = sde.kl(mean, mean + 0.1, std, form="flow_grpo", dt=sn - s)
    assert torch.all(k == 0)


@pytest.mark.parametrize("kernel", ("flow_grpo", "dance", "cps"))
def test_per_sample_eta_zero_rows_are_ode(kernel):
    sig = schedule(10)
    eta = torch.tensor([0.0, DEFAULT_ETA[kernel], 0.0, 0.5])
    x, v, noise = _rand((4, 6), 70), _rand((4, 6), 71), _rand((4, 6), 72)
    x_next, mean, std = sde.step(kernel, x, v, float(sig[3]), float(sig[4]), eta, noise)
    assert float(std[0]) == 0 and float(std[2]) == 0 and float(std[1]) > 0 and float(std[3]) > 0
    dt = np.float32(sig[4]) - np.float32(sig[3])
    np.testing.assert_allclose(_np(mean[[0, 2]]), _np(x[[0, 2]]) + _np(v[[0, 2]]) * dt, atol=2e-6)
    assert torch.equal(x_next[[0, 2]], mean[[0, 2]])
    lp = sde.log_prob(x_next, mean, std)
    assert torch.isfinite(lp).all() and lp[0] == 0 and lp[2] == 0 and lp[1] != 0


# ---------------------------------------------------------------------------------------------
# log_prob
# ---------------------------------------------------------------------------------------------
def test_log_prob_is_gaussian_density_mean_and_sum():
    B = 5
    mean = _rand((B, 3, 4, 4), 80)
    std = torch.tensor([0.05, 0.3, 1.0, 2.5, 0.7])
    x = mean + std.reshape(B, 1, 1, 1) * _rand((B, 3, 4, 4), 81) + 0.1
    dist = torch.distributions.Normal(mean.double(), std.double().reshape(B, 1, 1, 1).expand_as(mean))
    per_elem = dist.log_prob(x.double())
    lp_mean = sde.log_prob(x, mean, std)
    lp_sum = sde.log_prob(x, mean, std, reduction="sum")
    assert lp_mean.shape == (B,) and lp_mean.dtype == torch.float32
    np.testing.assert_allclose(_np(lp_mean), _np(per_elem.mean(dim=(1, 2, 3))), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(lp_sum), _np(per_elem.sum(dim=(1, 2, 3))), rtol=1e-5, atol=1e-3)
    # constants kept: at x = mean the per-element density is −log s − ½log 2π
    at_mean = sde.log_prob(mean, mean, std)
    np.testing.assert_allclose(_np(at_mean), -np.log(_np(std)) - 0.5 * np.log(2 * np.pi), rtol=1e-6, atol=1e-6)


def test_log_prob_std_zero_rows_zero_with_finite_grad():
    mean = _rand((3, 8), 90).requires_grad_(True)
    x = _rand((3, 8), 91)
    std = torch.tensor([0.0, 0.4, 0.0])
    lp = sde.log_prob(x, mean, std)
    assert lp[0] == 0 and lp[2] == 0 and torch.isfinite(lp).all()
    expected1 = torch.distributions.Normal(mean[1].double(), 0.4).log_prob(x[1].double()).mean()
    assert float(lp[1].detach()) == pytest.approx(float(expected1.detach()), rel=1e-5)
    lp.sum().backward()
    assert torch.isfinite(mean.grad).all(), "std-0 rows must not poison gradients with NaN/inf"
    assert torch.all(mean.grad[[0, 2]] == 0)
    # d/dμ of mean_j[−(x−μ)²/(2s²)] = (x−μ)/(s²·D)
    np.testing.assert_allclose(_np(mean.grad[1]), _np((x[1] - mean[1]) / (0.16 * 8)), rtol=1e-5, atol=1e-6)


def test_log_prob_bad_reduction_raises():
    with pytest.raises(ValueError, match="reduction"):
        sde.log_prob(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), reduction="max")


def test_replay_log_prob_of_own_sample_matches_noise_density():
    """log_prob of x_next = μ + s·ξ is mean(−ξ²/2) − log s − ½log 2π."""
    sig = schedule(10)
    x, v, xi = _rand((4, 2, 3, 3), 92), _rand((4, 2, 3, 3), 93), _rand((4, 2, 3, 3), 94)
    x_next, mean, std = sde.step("flow_grpo", x, v, float(sig[2]), float(sig[3]), 0.7, xi)
    lp = sde.log_prob(x_next, mean, std)
    expected = (-0.5 * _np(xi) ** 2).mean(axis=(1, 2, 3)) - np.log(_np(std)) - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(_np(lp), expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ("flow_grpo", "dance"))
def test_empirical_moments_of_x_next(kernel):
    """N = 40000 draws of ξ ~ N(0, I) for one state: the sample mean/std of x_next match (mean, std).
    Tolerance: 5 standard errors (std/sqrt(N) for the mean, std/sqrt(2N) for the std)."""
    N, D = 40000, 4
    sig = schedule(10)
    s, sn, eta = float(sig[3]), float(sig[4]), DEFAULT_ETA[kernel]
    x = _rand((1, D), 100).expand(N, D)
    v = _rand((1, D), 101).expand(N, D)
    xi = _rand((N, D), 102)
    x_next, mean, std = sde.step(kernel, x, v, s, sn, eta, xi)
    mean_ref, std_ref = ref_step(kernel, _np(x[:1]), _np(v[:1]), s, sn, eta)
    sd = float(std_ref[0])
    emp_mean = _np(x_next).mean(axis=0)
    emp_std = _np(x_next).std(axis=0)
    assert np.all(np.abs(emp_mean - mean_ref[0]) < 5 * sd / math.sqrt(N)), (emp_mean, mean_ref[0])
    assert np.all(np.abs(emp_std - sd) < 5 * sd / math.sqrt(2 * N)), (emp_std, sd)


# Gaussian data x0 ~ N(m, c²) per element: the marginal at σ is N((1−σ)m, (1−σ)²c² + σ²) and the exact
# velocity is v = (x − E[x0|x])/σ, so every kernel is an affine-Gaussian map x ↦ A·x + b + s·ξ whose
# pushed-forward marginal can be computed in closed form.
_M, _C = 0.7, 0.5


def _marginal(s):
    return (1 - s) * _M, (1 - s) ** 2 * _C**2 + s**2


def _velocity(x, s, c=_C):
    mu, var = (1 - s) * _M, (1 - s) ** 2 * c**2 + s**2
    x0 = _M + (1 - s) * c**2 / var * (x - mu)
    return (x - x0) / s


def _pushed_marginal_error(kernel, s, sn, eta, c=_C):
    x = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    _, mean, std = sde.step(kernel, x.float(), _velocity(x, s, c).float(), s, sn, eta)
    b = float(mean[0, 0])
    A = float(mean[1, 0]) - b
    sd = float(std[0])
    mu, var = (1 - s) * _M, (1 - s) ** 2 * c**2 + s**2
    mun, varn = (1 - sn) * _M, (1 - sn) ** 2 * c**2 + sn**2
    return abs(A * mu + b - mun), abs(A * A * var + sd * sd - varn)


@pytest.mark.parametrize("kernel", ("ode", "flow_grpo", "dance"))
def test_sde_kernels_preserve_marginals_to_second_order(kernel):
    """The kernels discretise marginal-preserving dynamics: one step from p_σ lands on p_σnext up to
    a local error O(dt²) (halving dt divides the variance error by ~4). A wrong drift correction
    (e.g. missing ½ or a sign) leaves an O(dt) error and fails the ratio."""
    eta = DEFAULT_ETA[kernel]
    errs = [_pushed_marginal_error(kernel, 0.6, 0.6 - dt, eta) for dt in (0.04, 0.02, 0.01)]
    for (m1, v1), (m2, v2) in zip(errs, errs[1:]):
        assert m2 < 1e-6, f"{kernel}: the mean of the marginal must be preserved, error {m2}"
        assert 3.2 < v1 / v2 < 4.8, f"{kernel}: variance error not O(dt²): {v1} → {v2}"
    assert errs[-1][1] < 1e-4


@pytest.mark.parametrize("i", [0, 3, 8])
def test_cps_exact_for_point_mass_data(i):
    """For point-mass data (x̂0 and x̂1 exact) CPS keeps x_σnext ~ N((1−σn)m, σn²) for any step size."""
    sig = schedule(10)
    s, sn = float(sig[i]), float(sig[i + 1])
    em, ev = _pushed_marginal_error("cps", s, sn, 0.8, c=0.0)
    assert em < 2e-6 and ev < 2e-6, (em, ev)


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------
def test_kl_exact_and_flow_grpo_form():
    B = 4
    ma, mb = _rand((B, 2, 3, 3), 110), _rand((B, 2, 3, 3), 111)
    std = torch.tensor([0.2, 0.0, 0.9, 1.5])
    dt = torch.tensor([-0.05, -0.1, -0.02, -0.3])
    d2 = ((_np(ma) - _np(mb)) ** 2).mean(axis=(1, 2, 3))
    s = _np(std)
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(s > 0, d2 / (2 * s**2), 0.0)
    k = sde.kl(ma, mb, std)
    assert k.shape == (B,) and torch.isfinite(k).all()
    np.testing.assert_allclose(_np(k), exact, rtol=1e-5, atol=1e-7)
    # the exact Gaussian KL of N(μa, s²I) ‖ N(μb, s²I), averaged over elements
    for b in (0, 2, 3):
        kd = torch.distributions.kl_divergence(
            torch.distributions.Normal(ma[b].double(), float(std[b])),
            torch.distributions.Normal(mb[b].double(), float(std[b])),
        ).mean()
        assert float(k[b]) == pytest.approx(float(kd), rel=1e-5)
    kf = sde.kl(ma, mb, std, form="flow_grpo", dt=dt)
    np.testing.assert_allclose(_np(kf), exact * np.abs(_np(dt)), rtol=1e-5, atol=1e-8)
    kf2 = sde.kl(ma, mb, std, form="flow_grpo", dt=-0.05)
    np.testing.assert_allclose(_np(kf2), exact * 0.05, rtol=1e-5, atol=1e-8)


def test_kl_flow_grpo_form_divides_by_two_a_squared():
    """With the flow_grpo kernel's own std s = a·sqrt(−dt), the flow_grpo form is mean‖Δμ‖²/(2a²)."""
    sig = schedule(10)
    s_, sn = float(sig[5]), float(sig[6])
    eta = 0.7
    x, va, vb = _rand((3, 16), 120), _rand((3, 16), 121), _rand((3, 16), 122)
    _, mu_a, std = sde.step("flow_grpo", x, va, s_, sn, eta)
    _, mu_b, _ = sde.step("flow_grpo", x, vb, s_, sn, eta)
    a2 = eta**2 * s_ / (1 - s_)
    expected = ((_np(mu_a) - _np(mu_b)) ** 2).mean(axis=1) / (2 * a2)
    k = sde.kl(mu_a, mu_b, std, form="flow_grpo", dt=sn - s_)
    np.testing.assert_allclose(_np(k), expected, rtol=1e-4)


def test_kl_bad_form_and_missing_dt():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_form"):
        sde.kl(z, z, torch.ones(1), form="reverse")
    with pytest.raises(ValueError):
        sde.kl(z, z, torch.ones(1), form="flow_grpo")


# ---------------------------------------------------------------------------------------------
# DPM-Solver++(2M) (MixGRPO-Flash post-window solver)
# ---------------------------------------------------------------------------------------------
def _lam(s):
    return np.log(1 - s) - np.log(s)


def ref_dpm2(x, v, s, sn, prev_x0=None, prev_s=None):
    """DPM-Solver++(2M) (Lu et al. 2022, Alg. 2) for α = 1−σ, float64; first order without history."""
    x0 = x - s * v
    if sn == 0:
        return x0, x0
    h = _lam(sn) - _lam(s)
    D = x0
    if prev_x0 is not None:
        r = (_lam(s) - _lam(prev_s)) / h
        D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * prev_x0
    return (sn / s) * x - (1 - sn) * (np.exp(-h) - 1) * D, x0


def test_dpm2_exact_on_linear_flow_and_final_step_returns_x0():
    """x_σ = (1−σ)x0 + σε with v = ε − x0: every step (first- and second-order) lands on the exact
    state, and the last step (σ_next = 0) returns x̂0 = x0."""
    sig = schedule(8)
    x0, eps = _rand((2, 3, 4, 4), 130), _rand((2, 3, 4, 4), 131)
    v = eps - x0
    start = 2  # a post-window solver starts mid-schedule
    x = (1 - float(sig[start])) * x0 + float(sig[start]) * eps
    prev_x0 = prev_s = None
    for i in range(start, len(sig) - 1):
        s, sn = float(sig[i]), float(sig[i + 1])
        x, x0_hat = sde.dpm2_step(x, v, s, sn, prev_x0, prev_s)
        np.testing.assert_allclose(_np(x0_hat), _np(x0), atol=2e-5, err_msg=f"x̂0 at step {i}")
        np.testing.assert_allclose(_np(x), _np((1 - sn) * x0 + sn * eps), atol=3e-5, err_msg=f"state after step {i}")
        prev_x0, prev_s = x0_hat, s
    np.testing.assert_allclose(_np(x), _np(x0), atol=3e-5)
    # final step alone returns x̂0 = x − σ·v for an arbitrary v
    x, vv = _rand((2, 5), 132), _rand((2, 5), 133)
    out, x0_hat = sde.dpm2_step(x, vv, 0.1, 0.0)
    np.testing.assert_allclose(_np(out), _np(x) - 0.1 * _np(vv), atol=1e-6)
    np.testing.assert_allclose(_np(x0_hat), _np(x) - 0.1 * _np(vv), atol=1e-6)


def test_dpm2_from_sigma_one():
    sig = schedule(6)
    x0, eps = _rand((2, 8), 134), _rand((2, 8), 135)
    x, x0_hat = sde.dpm2_step(eps, eps - x0, 1.0, float(sig[1]))
    assert torch.isfinite(x).all()
    np.testing.assert_allclose(_np(x), _np((1 - sig[1]) * x0 + sig[1] * eps), atol=2e-5)


def test_dpm2_matches_reference_on_nonlinear_field():
    sig = schedule(10)
    x = _rand((3, 6), 140)
    prev_x0 = prev_s = None
    xr = _np(x)
    prev_r = None
    for i in range(3, 10):
        s, sn = float(sig[i]), float(sig[i + 1])
        v = torch.tanh(x) * 0.8 + 0.3 * x  # arbitrary state-dependent field
        vr = np.tanh(xr) * 0.8 + 0.3 * xr
        x, x0_hat = sde.dpm2_step(x, v, s, sn, prev_x0, prev_s)
        xr, x0r = ref_dpm2(xr, vr, s, sn, prev_r, float(sig[i - 1]) if prev_r is not None else None)
        np.testing.assert_allclose(_np(x), xr, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
        np.testing.assert_allclose(_np(x0_hat), x0r, rtol=1e-4, atol=1e-4)
        prev_x0, prev_s, prev_r = x0_hat, s, x0r


def test_dpm2_second_order_convergence_on_gaussian_pf_ode():
    """Exact probability-flow ODE of Gaussian data keeps the standardised coordinate u fixed:
    x_σ = (1−σ)m + sqrt((1−σ)²c² + σ²)·u. 2M (with history) converges at second order and is far more
    accurate than the first-order update at the same step count."""

    def solve(N, second):
        L = np.linspace(_lam(0.9), _lam(0.1), N + 1)
        sig = 1 / (1 + np.exp(L))  # uniform in λ
        u = torch.linspace(-2, 2, 5, dtype=torch.float64)[:, None]
        mu, var = _marginal(sig[0])
        x = (mu + math.sqrt(var) * u).float()
        prev_x0 = prev_s = None
        for i in range(N):
            v = _velocity(x.double(), float(sig[i])).float()
            x, x0 = sde.dpm2_step(
                x, v, float(sig[i]), float(sig[i + 1]), prev_x0 if second else None, prev_s if second else None
            )
            prev_x0, prev_s = x0, float(sig[i])
        mu, var = _marginal(sig[-1])
        return float((x.double() - (mu + math.sqrt(var) * u)).abs().max())

    e32, e64 = solve(32, True), solve(64, True)
    f32 = solve(32, False)
    assert e32 / e64 > 3.0, f"2M not second order: {e32} → {e64}"
    assert e32 < f32 / 10, f"2M ({e32}) should beat first order ({f32}) by far"
