"""Shared fixtures: tiny offline pipelines wrapped by the adapters (fresh per test: LoRA mutates them)."""

from __future__ import annotations

import os

if "OMP_WAIT_POLICY" not in os.environ:  # before torch loads OpenMP (see docs/benchmarks.md, flowrl/commands/main.py)
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# model.compile=regional (a preset ships it): dynamo traces every block as on a GPU, without inductor's C++ build of
# each graph on these 2 cores (minutes); flowrl/models/blocks.py reads it when first imported, after this line
os.environ.setdefault("FLOWRL_COMPILE_BACKEND", "eager")
torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves


def pytest_collection_finish(session):
    """Move what collection left alive (torch, diffusers, transformers, every test module: ~0.5 M objects) out of
    the cyclic collector's reach: each automatic full collection then scans only what the tests made since. (The
    estimate's tracer collects only its own young objects after each traced phase: flowrl/estimate/trace.py.)
    Nothing collection made is garbage after it (collected first), and what the tests make is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def random_source_images(folder, count: int = 3, size: int = 32, seed: int = 0) -> list[str]:
    """``count`` ``size``×``size`` PNGs of seeded uniform noise, each different, written to ``folder``
    (``source{i}.png``): the source images of the edit families' tests. Returns their paths."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        paths.append(str(folder / f"source{i}.png"))
        Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()).save(paths[-1])
    return paths


def make_model(family: str, **kw):
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_flux_pipeline, tiny_sd3_pipeline

    if family == "sd3":
        return wrap(tiny_sd3_pipeline(), **kw)
    if family == "flux":
        kw.setdefault("height", 16)
        kw.setdefault("width", 16)
        return wrap(tiny_flux_pipeline(), **kw)
    raise ValueError(family)


@pytest.fixture
def sd3_model():
    return make_model("sd3")


@pytest.fixture
def flux_model():
    return make_model("flux")


def with_lora(model, rank: int = 2):
    """``model`` with a LoRA whose B matrices are random (seeded), so the policy differs from the base."""
    from flowrl.models.base import LoraSpec

    model.add_lora(LoraSpec(rank=rank, init="default"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.trainable.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def perturb_lora(module, seed: int = 0, scale: float = 0.2, part: str = "lora_") -> None:
    """Set every LoRA tensor of ``module`` whose name holds ``part`` (``lora_``: A and B; ``lora_B``: B only)
    to seeded normal values × ``scale``, so the adapter changes the model's output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if part in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def update_gradient(objective, model, forest, cond, micro_batch: int):
    """One update's gradient as the loop accumulates it, the objective cutting ``micro_batch`` rows per forward:
    (micro-batches, gradients of the trainable parameters, the last micro-batch's diagnostics); each micro-batch's
    loss weighted by its size over all the units."""
    objective.micro_batch = micro_batch
    batches = objective.batches(forest, iteration=0, seed=0)
    model.trainable.zero_grad()
    n = sum(b.size for b in batches)
    diag = {}
    for b in batches:
        loss, diag = objective.loss(model, forest, b, cond)
        (loss * b.size / n).backward()
    return len(batches), [p.grad.clone() for p in model.trainable.parameters() if p.grad is not None], diag


WALL_CLOCK = ("time/", "perf/", "compile/seconds")
"""Metric keys the wall clock decides (timings, model FLOP/s, compile time): not reproduced by a resumed run."""


def without_wall_clock(record: dict) -> dict:
    """``record`` without the :data:`WALL_CLOCK` keys: what a resumed run must reproduce exactly."""
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def straight_and_resumed(config, *common: str) -> tuple[dict, dict]:
    """The last records (timings dropped) of a straight 3-iteration run and of a 2-iteration run resumed to 3, each
    on a fresh tiny SD3 model; ``config(name, *overrides)`` builds a run's TrainConfig."""
    from flowrl.training.trainer import Trainer

    straight = Trainer(config("a", *common, "train.max_steps=3"), model=make_model("sd3")).train()
    Trainer(config("b", *common, "train.max_steps=2"), model=make_model("sd3")).train()
    resumed = Trainer(config("b", *common, "train.max_steps=3", "train.resume=latest"), model=make_model("sd3")).train()
    return without_wall_clock(straight[-1]), without_wall_clock(resumed[-1])


def spy_velocity(model) -> list[tuple]:
    """Wrap ``model.velocity`` to record, per call, (guidance, whether the conditioning has no unconditional rows,
    whether gradients are on); returns the list the calls append to."""
    seen, velocity = [], model.velocity

    def spy(x, sigma, cond, guidance=None):
        seen.append((guidance, cond.uncond is None, torch.is_grad_enabled()))
        return velocity(x, sigma, cond, guidance)

    model.velocity = spy
    return seen


def assert_lora_reloads(make, folder, x, s, prompts, v) -> torch.Tensor:
    """The LoRA saved in ``folder`` by a model whose velocity at ``x``, ``s`` [B], ``prompts`` is ``v``
    [B, *latent]: ``pipe.load_lora_weights`` into a fresh pipeline from ``make()`` (→ ``(pipe, model)``) gives
    ``v`` again, and the fresh base differs from it. Returns the base velocity."""
    fresh_pipe, fresh = make()
    with torch.no_grad():
        v_base = fresh.velocity(x, s, fresh.encode(prompts))
        fresh_pipe.load_lora_weights(str(folder))
        torch.testing.assert_close(fresh.velocity(x, s, fresh.encode(prompts)), v, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(v, v_base)
    return v_base


LEARN_PROMPTS = ["a red circle", "two blue squares", "a green cat", "a small dog"]


def train_redness(tmp_path, name: str, overrides: list[str], steps: int = 6):
    """Seeded training of the tiny SD3 pipeline on ``redness`` with ``overrides`` (the method's plan, credit
    and sizes). Returns (before, after, train records): the mean reward of fixed-seed ODE samples of
    LEARN_PROMPTS for two eval seed sets, before and after training."""
    from flowrl.config.schema import TrainConfig
    from flowrl.rollout.sampling import ode_sample
    from flowrl.training.evaluation import eval_seeds
    from flowrl.training.trainer import Trainer

    wrapped = "rollout.plan=probed" in overrides  # a wrapping plan's steps are its inner plan's (in the overrides)
    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=4",
            "model.lora.init=default",
            *([] if wrapped else [f"rollout.steps={steps}"]),
            f"prompts.train={'|'.join(LEARN_PROMPTS)}",
            "prompts.per_step=4",
            "prompts.eval=null",
            "optim.lr=1e-2",
            "loss.clip_low=0.2",
            "loss.clip_high=0.2",
            "loss.kl_ref=0",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.async_reward=false",
            *overrides,
        ],
    )
    cfg.rewards[0].name = "redness"
    trainer = Trainer(cfg, model=make_model("sd3"))
    reward = trainer.reward.rewards[0]
    prompts = [p for p in LEARN_PROMPTS for _ in range(16)]

    def mean_reward(seed: int) -> float:
        images = ode_sample(trainer.model, prompts, eval_seeds(seed, len(prompts)), steps=steps, guidance=1.0)
        return float(reward(images, prompts).mean())

    before = [mean_reward(s) for s in (101, 202)]
    records = trainer.train()
    after = [mean_reward(s) for s in (101, 202)]
    return before, after, [r for r in records if "reward_mean" in r]
