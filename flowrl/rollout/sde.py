"""Transition kernels of flow-matching samplers, their Gaussian log-densities and KL (docs/algorithms.md,
"Transition kernels").

Pure tensor functions, all arithmetic in fp32. Conventions (rectified flow, diffusers'
``FlowMatchEulerDiscreteScheduler``): x_σ = (1−σ)·x0 + σ·ε, the model predicts v ≈ ε − x0,
one step maps σ → σ_next < σ and dt = σ_next − σ < 0.

Shapes: ``x``, ``v``, ``noise``, means: [B, ...]; ``sigma``, ``sigma_next``, ``eta``: python floats or
tensors [B] (broadcast over the non-batch dimensions); stds returned as [B].
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from flowrl.core.choices import choose
from flowrl.core.registry import LOAD_ERRORS, Registry
from flowrl.errors import ConfigError

KL_FORMS: tuple[str, ...] = ("exact", "flow_grpo")
REDUCTIONS: tuple[str, ...] = ("mean", "sum")

Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
"""``kernel(x, v, sigma, sigma_next, eta) -> (mean, std)``: x, v fp32 [B, ...]; sigma, sigma_next, eta fp32
[B, 1, …] (broadcast over x); mean [B, ...], std broadcastable to [B, 1, …]. The transition is
N(mean, std²); std 0 is deterministic."""


def _ode(x, v, s, s_next, e):
    return x + v * (s_next - s), torch.zeros_like(s)


def _flow_grpo(x, v, s, s_next, e):
    # a = η·sqrt(σ/(1−σ')) with σ' = σ, except σ' = σ_next at σ = 1 (the first step)
    dt = s_next - s
    s_prime = torch.where(s >= 1.0, s_next, s)
    a = e * torch.sqrt(s / (1.0 - s_prime))
    a2 = a * a
    mean = x * (1.0 + a2 * dt / (2.0 * s)) + v * (1.0 + a2 * (1.0 - s) / (2.0 * s)) * dt
    return mean, a * torch.sqrt(-dt)


def _dance(x, v, s, s_next, e):
    dt = s_next - s
    x0_hat = x - s * v
    score = -(x - (1.0 - s) * x0_hat) / (s * s)
    return x + dt * (v - 0.5 * e * e * score), e * torch.sqrt(-dt)


def _cps(x, v, s, s_next, e):
    x0_hat = x - s * v
    x1_hat = x + (1.0 - s) * v
    std = s_next * torch.sin(e * math.pi / 2.0)
    return (1.0 - s_next) * x0_hat + torch.sqrt(torch.clamp(s_next * s_next - std * std, min=0.0)) * x1_hat, std


def _check_kernel_function(fn, label: str) -> None:
    if not callable(fn) or isinstance(fn, type):
        raise TypeError(f"{label} resolves to {fn!r}, which is not a kernel function (flowrl.rollout.sde.Kernel)")


KERNEL_FUNCTIONS = Registry(
    "rollout.kernel", {"ode": _ode, "flow_grpo": _flow_grpo, "dance": _dance, "cps": _cps}, check=_check_kernel_function
)
"""Transition kernels by name (a :class:`~flowrl.config.registry.Registry`; :func:`register_kernel` adds one;
docs/algorithms.md, "Transition kernels", has the math). A ``package.module:function`` or
``path/file.py:function`` name resolves too (out-of-tree kernels from YAML alone)."""


def __getattr__(name: str):
    if name == "KERNELS":  # the registered names, as a tuple (kept for code that read the former constant)
        return tuple(KERNEL_FUNCTIONS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_kernel(name: str, fn: Kernel | str) -> None:
    """Make ``fn`` (see :data:`Kernel`, or its ``"module:function"``) available as ``rollout.kernel: name``."""
    KERNEL_FUNCTIONS.register(name, fn)


def check_kernel(kernel: str, key: str = "kernel") -> str:
    """``kernel`` if it names a kernel (registered, ``package.module:function`` or ``path/file.py:function``,
    imported now); else a :class:`ConfigError` naming ``key``."""
    try:
        KERNEL_FUNCTIONS.resolve(kernel, key)
    except ConfigError:
        raise
    except LOAD_ERRORS as e:
        raise ConfigError(str(e)) from None
    return kernel


def _per_sample(value, x: torch.Tensor) -> torch.Tensor:
    """A float or [B] tensor as fp32 [B, 1, 1, ...] broadcastable against ``x``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(x.shape[0], *([1] * (x.ndim - 1)))


def step(
    kernel: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    eta=0.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transition x_σ → x_σnext. Returns ``(x_next, mean, std)``: [B, ...], [B, ...], [B].

    ``x_next = mean + std·noise``; with ``noise=None`` (or std 0) ``x_next = mean``.
    ``eta = 0`` gives the ODE (std 0) for every kernel.
    """
    x = x.float()
    v = v.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    e = _per_sample(eta, x)
    fn = KERNEL_FUNCTIONS.get(kernel)
    if fn is None or isinstance(fn, str):  # a module:function name, or a lazy entry
        fn = KERNEL_FUNCTIONS.resolve(kernel)
    mean, std = fn(x, v, s, s_next, e)
    std = torch.broadcast_to(std, s.shape)
    std = std.reshape(x.shape[0])
    if noise is None:
        return mean, mean, std
    x_next = mean + _per_sample(std, x) * noise.float()
    return x_next, mean, std


def log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Gaussian log-density of ``x_next`` [B, ...] under N(mean, std²·I), constants kept.

    Reduced over all non-batch elements by ``mean`` (Flow-GRPO convention) or ``sum``. Returns fp32
    [B]. Rows with std 0 (deterministic ODE edges) return 0: they are never trained, never NaN.
    """
    choose("loss.reduction", reduction, REDUCTIONS)
    x_next = x_next.float()
    mean = mean.float()
    std = std.float().reshape(-1)
    stochastic = std > 0
    safe = torch.where(stochastic, std, torch.ones_like(std))
    safe_b = safe.reshape(-1, *([1] * (x_next.ndim - 1)))
    lp = -((x_next - mean) ** 2) / (2.0 * safe_b**2) - torch.log(safe_b) - 0.5 * math.log(2.0 * math.pi)
    dims = tuple(range(1, x_next.ndim))
    lp = lp.mean(dim=dims) if reduction == "mean" else lp.sum(dim=dims)
    return torch.where(stochastic, lp, torch.zeros_like(lp))


def kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor, form: str = "exact", dt=None) -> torch.Tensor:
    """KL between N(mean_a, s²) and N(mean_b, s²) per row, fp32 [B].

    ``exact``: mean(‖μ_a − μ_b‖²)/(2s²) (mean over non-batch elements). ``flow_grpo``: their form,
    which equals exact × |dt| (dt [B] or float required). Rows with std 0 give 0.
    """
    choose("loss.kl_form", form, KL_FORMS)
    diff2 = ((mean_a.float() - mean_b.float()) ** 2).mean(dim=tuple(range(1, mean_a.ndim)))
    std = std.float().reshape(-1)
    stochastic = std > 0
    safe = torch.where(stochastic, std, torch.ones_like(std))
    out = diff2 / (2.0 * safe**2)
    if form == "flow_grpo":
        if dt is None:
            raise ValueError("kl form 'flow_grpo' needs dt")
        out = out * torch.as_tensor(dt, dtype=torch.float32, device=out.device).abs()
    return torch.where(stochastic, out, torch.zeros_like(out))


def _lam(sigma: float) -> float:
    """Half log-SNR λ = log((1−σ)/σ) of the rectified-flow path."""
    return math.log(max(1.0 - sigma, 1e-12)) - math.log(max(sigma, 1e-12))


def dpm2_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float,
    sigma_next: float,
    prev_x0: torch.Tensor | None = None,
    prev_sigma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One deterministic DPM-Solver++(2M) step in data prediction (MixGRPO-Flash's post-window solver).

    x̂0 = x − σ·v; with the previous step's x̂0 it uses the second-order multistep correction,
    otherwise (first step, or the final step to σ = 0) the first-order update. Returns
    ``(x_next, x0_hat)``; pass ``x0_hat`` and ``sigma`` as ``prev_x0``/``prev_sigma`` next time.
    """
    x = x.float()
    x0_hat = x - sigma * v.float()
    if sigma_next <= 0.0:
        return x0_hat, x0_hat
    h = _lam(sigma_next) - _lam(sigma)
    d = x0_hat
    if prev_x0 is not None and prev_sigma is not None:
        r = (_lam(sigma) - _lam(prev_sigma)) / h
        if math.isfinite(r) and r > 0:
            d = (1.0 + 0.5 / r) * x0_hat - (0.5 / r) * prev_x0
    x_next = (sigma_next / sigma) * x - (1.0 - sigma_next) * math.expm1(-h) * d
    return x_next, x0_hat
