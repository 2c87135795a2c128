"""One stepping engine (issue 35): every chunked model forward goes through ``velocity_in_chunks``, every step
over forest nodes through ``advance`` (Euler, SDE kernels, DPM-Solver++(2M)), states outside a forest through
``euler_ode`` (ODE completions, plain samples). The numbers are those of the hand-written steps."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.rollout import sde
from flowrl.rollout.base import DPM2, RolloutContext, advance, euler_ode, velocity_in_chunks
from flowrl.rollout.chains import Chains, ODEChains, SDEWindow
from flowrl.rollout.forest import Forest
from flowrl.rollout.probes import ode_complete
from flowrl.rollout.sampling import ode_sample

PROMPTS = ["a red circle", "two blue squares"]


def roots(model, n: int, steps: int, guidance: float = 1.0) -> tuple[Forest, torch.Tensor, object, torch.Tensor]:
    """A forest of ``n`` roots (groups alternate between the prompts), its nodes, cond and schedule."""
    forest = Forest(prompts=list(PROMPTS), guidance=guidance)
    sigmas = model.schedule(steps).float().cpu()
    nodes = forest.add_roots(model.noise(list(range(n))), torch.arange(n) % 2, list(range(n)), sigma=float(sigmas[0]))
    return forest, nodes, model.encode(PROMPTS, guidance), sigmas


@pytest.mark.parametrize("n, max_batch", [(5, 2), (4, 4), (3, 64), (7, 1)])
def test_one_forward_per_max_batch_rows(sd3_model, n, max_batch):
    forest, nodes, cond, sigmas = roots(sd3_model, n, 3)
    x = forest.latents_of(nodes)
    chunks = list(
        velocity_in_chunks(
            sd3_model, x, float(sigmas[0]), cond, 1.0, max_batch, cond_rows=forest.group[nodes], count_on=forest
        )
    )
    assert len(chunks) == forest.counters["model_calls"] == math.ceil(n / max_batch)
    assert forest.counters["forwards"] == n and [r.start for r, _, _ in chunks] == list(range(0, n, max_batch))
    assert torch.equal(torch.cat([xb for _, xb, _ in chunks]), x)
    children = advance(
        forest,
        sd3_model,
        nodes,
        cond,
        float(sigmas[1]),
        1,
        "dance",
        0.5,
        lambda p, b: torch.randn(p.shape[0], *sd3_model.latent_shape),
        1.0,
        max_batch,
        fanout=2,
    )
    per_forward = max(1, max_batch // 2)  # a forward carries at most max_batch new edges
    assert forest.counters["model_calls"] == math.ceil(n / max_batch) + math.ceil(n / per_forward)
    assert children.numel() == 2 * n and torch.unique(forest.batch[children]).numel() == math.ceil(n / per_forward)


def test_euler_is_the_ode_kernel_bit_for_bit():
    """sde.step("ode") is x + v·(σ' − σ) with the difference rounded once to fp32, as the samplers wrote it."""
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 2, 3, 3, generator=gen), torch.randn(4, 2, 3, 3, generator=gen)
    for s, s_next in [(1.0, 0.75), (0.3141592653, 0.0271828), (0.2, 0.0)]:
        s, s_next = float(torch.tensor(s)), float(torch.tensor(s_next))  # fp32 sigmas, as schedules give them
        assert torch.equal(sde.step("ode", x, v, s, s_next)[0], x + v.float() * (s_next - s))


@pytest.mark.parametrize("max_batch", [2, 64])
def test_advance_with_dpm2_is_the_multistep_solver_by_hand(sd3_model, max_batch):
    forest, nodes, cond, sigmas = roots(sd3_model, 3, 4)
    solver, x, prev = DPM2(), forest.latents_of(nodes), (None, None)
    for i in range(4):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        nodes = advance(forest, sd3_model, nodes, cond, s_next, i + 1, solver, 0.0, None, 1.0, max_batch)
        outs, x0s = [], []
        for c in range(0, x.shape[0], max_batch):  # the same chunks as the engine
            rows = slice(c, c + max_batch)
            v = sd3_model.velocity(
                x[rows], torch.full((x[rows].shape[0],), s), cond.select(forest.group[nodes][rows]), 1.0
            )
            x_next, x0 = sde.dpm2_step(x[rows], v, s, s_next, None if prev[0] is None else prev[0][rows], prev[1])
            outs.append(x_next)
            x0s.append(x0)
        x, prev = torch.cat(outs), (torch.cat(x0s), s)
        assert torch.equal(forest.latents_of(nodes), x) and torch.equal(solver.prev_x0, prev[0])
        assert forest.kernels[int(forest.kernel[nodes[0]])] == "dpm2" and bool((forest.batch[nodes] == -1).all())
        assert not bool(forest.stochastic[nodes].any()) and bool((forest.logp_old[nodes] == 0).all())
    assert bool((forest.sigma[nodes] == 0).all())
    with pytest.raises(ValueError, match="fanout"):
        advance(forest, sd3_model, nodes, cond, 0.0, 5, DPM2(), 0.0, None, 1.0, max_batch, fanout=2)


def test_the_ode_plan_with_dpm2_is_the_solver_over_the_whole_schedule(sd3_model):
    forest = ODEChains(group_size=2, steps=4, solver="dpm2").rollout(sd3_model, PROMPTS, RolloutContext(seed=3))
    leaves, sigmas = forest.leaves(), sd3_model.schedule(4).float()
    x = sd3_model.noise(forest.seed[leaves].tolist())
    cond = sd3_model.encode(PROMPTS, forest.guidance).select(forest.group[leaves])
    prev = (None, None)
    for i in range(4):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x, x0 = sde.dpm2_step(x, sd3_model.velocity(x, torch.full((x.shape[0],), s), cond), s, s_next, *prev)
        prev = (x0, s)
    assert torch.equal(forest.latents_of(leaves), x)


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_an_ode_step_of_advance_is_an_euler_step_of_euler_ode(sd3_model, guidance):
    forest, nodes, cond, sigmas = roots(sd3_model, 3, 1, guidance)  # one step: σ_0 → 0
    x = euler_ode(sd3_model, forest.latents_of(nodes), sigmas, cond, guidance, 64, cond_rows=forest.group[nodes])
    children = advance(forest, sd3_model, nodes, cond, float(sigmas[1]), 1, "ode", 0.0, None, guidance, 64)
    assert torch.equal(forest.latents_of(children), x)


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_a_roots_completion_is_its_ode_sample(sd3_model, guidance):
    forest = Chains(group_size=2, steps=4, window=SDEWindow(mode="fixed", start=0, size=2)).rollout(
        sd3_model, PROMPTS, RolloutContext(seed=5, guidance=guidance)
    )
    root = forest.roots()
    x0 = ode_complete(sd3_model, forest, root, 4, max_batch=64)
    expected = ode_sample(
        sd3_model,
        [PROMPTS[int(g)] for g in forest.group[root]],
        forest.seed[root].tolist(),
        4,
        guidance,
        max_batch=64,
        decode=False,
    )
    assert torch.equal(x0, expected)  # one batch of the same rows, the same conditioning rows: bit-exact


def test_euler_ode_is_schedule_aligned(sd3_model):
    """Rows starting at later steps join the forwards of the rows already moving: at step i the rows with
    start ≤ i share forwards of at most max_batch rows; the input is not changed."""
    forest, nodes, cond, sigmas = roots(sd3_model, 5, 4)
    start = torch.tensor([0, 2, 0, 3, 1])
    x = forest.latents_of(nodes).clone()
    out = euler_ode(sd3_model, x, sigmas, cond, 1.0, 2, start=start, cond_rows=forest.group[nodes], count_on=forest)
    assert torch.equal(x, forest.latents_of(nodes)) and out.dtype == torch.float32 and out.shape == x.shape
    active = [int((start <= i).sum()) for i in range(4)]
    assert forest.counters["forwards"] == sum(4 - int(s) for s in start) == sum(active)
    assert forest.counters["model_calls"] == sum(math.ceil(a / 2) for a in active)
    alone = euler_ode(sd3_model, x[3:4], sigmas, cond, 1.0, 2, start=start[3:4], cond_rows=forest.group[nodes][3:4])
    torch.testing.assert_close(out[3:4], alone, rtol=0, atol=1e-5)  # another batch layout: float rounding only
    assert euler_ode(sd3_model, x[:0], sigmas, cond, 1.0, 2).shape == (0, *x.shape[1:])
