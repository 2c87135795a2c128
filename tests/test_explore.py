"""Sol-RL's explore plan (flowrl/rollout/explore.py): selection, seed-exact regeneration, what reaches the
loss, the explorer following the weights inside the loop, diagnostics, config, and a learning run."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config.schema import TrainConfig
from flowrl.core.seeding import derive_seed
from flowrl.errors import ConfigError
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.chains import Chains, SDEWindow
from flowrl.rollout.explore import Explore, kendall, select_seeds, spearman
from flowrl.rollout.explorer import make_explorer
from flowrl.training.trainer import Trainer
from tests.conftest import make_model

PROMPTS = ["a red circle", "two blue squares", "a green cat", "a small dog"]
INNER = {"plan": "chains", "group_size": 4, "steps": 4, "window": {"mode": "fixed", "start": 0, "size": 2}}
INNER_YAML = "{plan: chains, group_size: 4, steps: 4, window: {mode: fixed, start: 0, size: 2}}"


def plan(**kw) -> Explore:
    kw.setdefault("inner", dict(INNER))
    kw.setdefault("pool", 8)
    kw.setdefault("preview_steps", 2)
    return Explore(**kw)


def tiny_config(tmp_path, name="explore", *extra: str) -> TrainConfig:
    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=4",
            "model.lora.init=default",
            "rollout.plan=explore",
            f"rollout.inner={INNER_YAML}",
            "rollout.pool=8",
            "rollout.preview_steps=2",
            "rollout.backend=int8",
            "rollout.min_params=0",
            "rollout.max_batch=16",
            f"prompts.train={'|'.join(PROMPTS)}",
            "prompts.per_step=2",
            "prompts.eval=null",
            "optim.lr=3e-3",
            "loss.clip_low=0.2",
            "loss.clip_high=0.2",
            "loss.kl_ref=0",
            "train.max_steps=2",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            "train.progress=false",
            *extra,
        ],
    )
    cfg.rewards[0].name = "brightness"
    return cfg


# ---- selection ------------------------------------------------------------------------------
def test_selection_returns_exactly_the_extremes_on_hand_made_rewards():
    r = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3, 0.95, 0.0, 0.6])
    assert select_seeds(r, 4, "extremes").tolist() == [5, 1, 6, 2]  # two best (best first), two worst (worst first)
    assert select_seeds(r, 3, "extremes").tolist() == [5, 1, 6]  # odd K: one more best
    assert select_seeds(r, 3, "top_k").tolist() == [5, 1, 3]
    assert select_seeds(r, 3, "spread").tolist() == [5, 0, 6]  # ranks 0, 3.5 → 4 (round half even), 7
    assert select_seeds(r, 8, "extremes").sort().values.tolist() == list(range(8))
    ties = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert select_seeds(ties, 2, "extremes").tolist() == [0, 3]  # ties keep pool order
    failed = torch.tensor([float("nan"), 0.2, 0.8, float("nan"), 0.5])
    assert select_seeds(failed, 2, "extremes").tolist() == [2, 1]  # NaN never counts as the worst
    assert select_seeds(failed, 4, "extremes").tolist()[:3] == [2, 4, 1]
    with pytest.raises(ValueError, match="keep 5 of a pool of 4"):
        select_seeds(ties, 5)
    with pytest.raises(ValueError, match="rollout.select='best'"):
        select_seeds(ties, 2, "best")


def test_rank_correlations_on_known_cases():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spearman(a, a * 10) == pytest.approx(1.0) and kendall(a, a**3) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0) and kendall(a, -a) == pytest.approx(-1.0)
    b = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])  # two adjacent swaps: 8 concordant, 2 discordant pairs
    assert kendall(a, b) == pytest.approx(0.6)
    assert spearman(a, b) == pytest.approx(1 - 6 * 4 / (5 * 24))
    t = torch.tensor([1.0, 1.0, 2.0, 3.0])  # tau-b with a tie: (5 − 0) / sqrt(5 · 6)
    assert kendall(t, torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(5 / math.sqrt(30))
    assert math.isnan(spearman(a[:1], a[:1])) and math.isnan(kendall(torch.ones(3), a[:3]))


# ---- regeneration from the selected seeds ---------------------------------------------------
def test_kept_seeds_are_the_previews_extremes_and_roots_rebuild_bit_identically(sd3_model, monkeypatch):
    """Hand-made preview rewards pick the kept seeds; the inner plan's roots are exactly their x_T: the
    same tensors the explorer previewed from and that model.noise rebuilds from the seeds."""
    p = plan(backend="int8", min_params=0)
    p.setup(sd3_model, "brightness")
    hand = torch.tensor(
        [
            0.3,
            0.8,
            0.1,
            0.9,
            0.5,
            0.0,
            0.7,
            0.2,  # group 0: best 3, 1; worst 5, 2
            0.0,
            0.1,
            0.2,
            0.3,
            0.4,
            0.5,
            0.6,
            0.7,
        ]
    )  # group 1: best 7, 6; worst 0, 1
    monkeypatch.setattr(p, "_score_pool", lambda images, prompts, groups: hand)
    seen = {}
    explorer_noise = p.explorer.model.noise

    def spy(seeds):
        out = explorer_noise(seeds)
        seen.update({int(s): out[i] for i, s in enumerate(seeds)})
        return out

    monkeypatch.setattr(p.explorer.model, "noise", spy)
    ctx = RolloutContext(seed=3, iteration=5, group_offset=2, max_batch=16)
    forest = p.rollout(sd3_model, PROMPTS[:2], ctx)
    pool = [[derive_seed(3, 5, "explore", 2 + g, n) for n in range(8)] for g in range(2)]
    kept = [[pool[0][i] for i in (3, 1, 5, 2)], [pool[1][i] for i in (7, 6, 0, 1)]]
    roots = forest.roots()
    assert forest.seed[roots].tolist() == kept[0] + kept[1]
    assert forest.group[roots].tolist() == [0] * 4 + [1] * 4
    x_T = forest.all_latents()[roots]
    assert torch.equal(x_T, sd3_model.noise(kept[0] + kept[1]))
    assert torch.equal(x_T, torch.stack([seen[s] for s in kept[0] + kept[1]]))
    assert set(seen) == set(pool[0] + pool[1])  # the whole pool was previewed
    assert set(forest.seed.tolist()) == set(kept[0] + kept[1])  # and only the kept seeds are in the forest


def test_inner_chains_take_given_roots_and_are_unchanged_without_them(sd3_model):
    chains = Chains(group_size=3, steps=4, window=SDEWindow(mode="fixed", start=0, size=2))
    ctx = RolloutContext(seed=1, iteration=2)
    plain = chains.rollout(sd3_model, PROMPTS[:2], ctx)
    own = [[derive_seed(1, 2, "root", g, j) for j in range(3)] for g in range(2)]
    given = chains.rollout(sd3_model, PROMPTS[:2], RolloutContext(seed=1, iteration=2, root_seeds=own))
    assert torch.equal(plain.all_latents(), given.all_latents()) and torch.equal(plain.logp_old, given.logp_old)
    other = chains.rollout(
        sd3_model, PROMPTS[:2], RolloutContext(seed=1, iteration=2, root_seeds=[[7, 8, 9], [10, 11, 12]])
    )
    assert other.seed[other.roots()].tolist() == [7, 8, 9, 10, 11, 12]
    with pytest.raises(ValueError, match="3 seed"):
        chains.rollout(sd3_model, PROMPTS[:2], RolloutContext(root_seeds=[[1, 2], [3, 4]]))
    assert chains.root_count() == 3 and Chains(shared_noise=True).root_count() == 1


def test_metrics_cover_only_the_rollouts_of_the_current_iteration(sd3_model):
    """A rollout whose metrics nobody asked for (``flowrl snr`` draws several) must not leak into the next
    iteration's explore statistics; the chunks of one iteration add up."""
    p = plan()
    p.setup(sd3_model, "brightness")
    p.rollout(sd3_model, PROMPTS[:2], RolloutContext(seed=0, iteration=0))  # metrics never read
    first = p.rollout(sd3_model, PROMPTS[:1], RolloutContext(seed=0, iteration=1))
    second = p.rollout(sd3_model, PROMPTS[1:2], RolloutContext(seed=0, iteration=1, group_offset=1))
    assert [[r["iteration"] for r in f.meta["explore"]] for f in (first, second)] == [[1], [1]]  # on the forests
    first.reward[first.leaves()] = second.reward[second.leaves()] = 0.5
    from flowrl.rollout.forest import Forest

    stats = p.metrics(Forest.merge([first, second]))
    assert stats["time/explore_preview"] > 0 and "_pending" not in vars(p)  # nothing kept on the plan


def test_explore_wraps_a_tree_whose_root_is_the_kept_seed(sd3_model):
    from flowrl.rollout.tree import Tree

    tree = Tree(steps=4, split_steps=[0, 1], kernel="dance", eta=0.7)
    assert tree.root_count() == 1
    explore = Explore(inner={"plan": "tree", "steps": 4, "split_steps": [0, 1], "eta": 0.7}, pool=3, preview_steps=2)
    explore.setup(sd3_model, "brightness")
    forest = explore.rollout(sd3_model, PROMPTS[:2], RolloutContext(seed=3, iteration=1))
    roots = forest.roots()
    assert roots.numel() == 2 and forest.leaves().numel() == 2 * 4
    pool = [[derive_seed(3, 1, "explore", g, j) for j in range(3)] for g in range(2)]
    kept = forest.seed[roots].tolist()
    assert all(seed in candidates for seed, candidates in zip(kept, pool)), (kept, pool)
    assert torch.equal(forest.all_latents()[roots].cpu(), sd3_model.noise(kept).cpu())
    # the same tree from the kept seeds, without explore, is the same forest
    again = tree.rollout(sd3_model, PROMPTS[:2], RolloutContext(seed=3, iteration=1, root_seeds=[[s] for s in kept]))
    assert torch.equal(again.all_latents(), forest.all_latents()) and torch.equal(again.logp_old, forest.logp_old)


# ---- the loop -------------------------------------------------------------------------------
def test_only_regenerated_samples_reach_credit_and_loss(tmp_path):
    trainer = Trainer(tiny_config(tmp_path), model=make_model("sd3"))
    p = trainer.plan
    assert (p.keep, p.pool_size) == (4, 8)
    forest, _ = trainer.rollout(0)
    kept = [s for record in forest.meta["explore"] for group in record["kept"] for s in group]
    leaves = forest.leaves()
    assert leaves.numel() == 2 * 4 == len(kept)
    assert forest.seed[leaves].tolist() == kept  # one chain per kept seed, in selection order
    assert forest.counters["scored"] == 8  # the trainer scored the regenerated leaves only
    counts = p.expected_counts(2, RolloutContext(seed=0, iteration=0))
    assert forest.counters["forwards"] == counts["forwards"] == 2 * 4 * 4
    assert forest.counters["explore_forwards"] == counts["explore_forwards"] == 2 * 8 * 2
    stats = p.metrics(forest)
    for key in (
        "explore/spearman",
        "explore/kendall",
        "explore/separation",
        "explore/top_half_hit_rate",
        "explore/explorer_speedup",
        "time/explore_preview",
        "time/explore_score",
        "time/explore_regenerate",
        "time/explore_sync",
    ):
        assert key in stats and math.isfinite(stats[key]), key
    trainer.credit.assign(forest)
    trained = forest.edges()
    assert set(forest.seed[trained].tolist()) <= set(kept)
    out = trainer.update(forest, 0)
    assert out["trained_edges"] == counts["trained_edges"] == 2 * 4 * 2
    assert out["first_step_abs_delta_logp"] == 0.0


def test_explorer_follows_the_weights_after_each_optimizer_step(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "follow", "train.updates_per_epoch=2"), model=make_model("sd3"))
    p = trainer.plan
    x = trainer.model.noise([1, 2, 3])
    cond = trainer.model.encode(PROMPTS[:3])

    def explorer_v():
        with torch.no_grad():
            return p.explorer.model.velocity(x, torch.full((3,), 0.6), cond)

    before = explorer_v()
    syncs = p._explorer.syncs
    forest, _ = trainer.rollout(0)
    trainer.credit.assign(forest)
    trainer.update(forest, 0)  # two optimizer steps, two after_update calls
    assert p._stale and p._explorer.syncs == syncs
    after = explorer_v()  # synced once, lazily
    assert p._explorer.syncs == syncs + 1
    assert not torch.allclose(before, after)
    fresh = make_explorer(trainer.model, "int8", min_params=0)
    with torch.no_grad():
        assert torch.equal(after, fresh.model.velocity(x, torch.full((3,), 0.6), cond))


def test_preview_equal_to_regeneration_ranks_perfectly(sd3_model):
    """`same` backend, preview with all inner steps, near-zero SDE noise: regenerated rewards reproduce the
    preview ranking, so the diagnostics read ρ = τ = 1, a positive separation and a full hit rate."""
    from flowrl_rewards import MultiReward

    reward = MultiReward(["brightness"])
    p = plan(
        inner={
            "plan": "chains",
            "group_size": 4,
            "steps": 4,
            "eta": 1e-4,
            "window": {"mode": "fixed", "start": 0, "size": 1},
        },
        preview_steps=4,
        backend="same",
    )
    p.setup(sd3_model, reward)
    forest = p.rollout(sd3_model, PROMPTS[:2], RolloutContext(seed=0, max_batch=16))
    nodes, x0 = forest.score_requests()
    from flowrl.rollout.decoding import decode
    from flowrl.rollout.scoring import components_of

    forest.record_scores(
        nodes,
        components_of(reward, decode(sd3_model, x0, 16), [forest.prompts[int(g)] for g in forest.group[nodes]], {}),
    )
    forest.combine_scores(reward.combine)
    stats = p.metrics(forest)
    assert stats["explore/spearman_in_group"] == pytest.approx(1.0)
    assert stats["explore/kendall_in_group"] == pytest.approx(1.0)
    assert stats["explore/spearman"] == pytest.approx(1.0)
    assert stats["explore/separation"] > 0 and stats["explore/top_half_hit_rate"] == 1.0
    assert p.metrics(forest).keys() == stats.keys()  # read from the forest: nothing consumed on the plan


# ---- configuration --------------------------------------------------------------------------
def test_inner_plan_keys_are_checked_against_its_own_fields():
    with pytest.raises(
        ConfigError, match=r"\.grup_size is not a key of rollout.plan='chains' \(did you mean 'group_size'\?\)"
    ):
        TrainConfig.from_yaml(None, ["rollout.plan=explore", "rollout.inner={plan: chains, grup_size: 4}"])
    with pytest.raises(ConfigError, match="rollout.kernel"):
        plan(inner={"plan": "chains", "kernel": "euler"})
    with pytest.raises(ConfigError, match="rollout.inner"):
        plan(inner={"plan": "chains", "window": {"mod": "fixed"}})
    with pytest.raises(ConfigError, match="rollout.inner needs 'plan'"):
        plan(inner={"group_size": 4})
    with pytest.raises(ConfigError, match="is a Explore too: a Explore cannot wrap another one"):
        plan(inner="explore")
    with pytest.raises(ConfigError, match=r"rollout.inner.plan='chanis' is not registered \(did you mean 'chains'\?\)"):
        plan(inner="chanis")
    with pytest.raises(ConfigError, match="rollout.inner_args.*is gone; use rollout.inner: {plan: NAME"):
        TrainConfig.from_yaml(None, ["rollout.plan=explore", "rollout.inner_args=[group_size=4]"])
    with pytest.raises(ConfigError, match="rollout.pool=3 must be >= the kept seeds per prompt"):
        plan(pool=3)
    with pytest.raises(ConfigError, match="rollout.select='best'"):
        plan(select="best")
    with pytest.raises(ConfigError, match="rollout.preview_steps=0"):
        plan(preview_steps=0)
    with pytest.raises(ConfigError, match="does not take given root seeds"):
        Explore(inner_plan=type("NoRoots", (Chains,), {"root_count": lambda self: None})())
    p = plan(inner={"plan": "chains", "group_size": 6, "steps": 5, "window": {"mode": "all"}}, pool=None)
    assert (p.keep, p.pool_size, p.inner_plan.steps, p.inner_plan.window.mode) == (6, 24, 5, "all")
    assert Explore(inner_plan=Chains(group_size=2, shared_noise=True, eta=0.5)).keep == 1


def test_preset_loads_with_its_inner_chains():
    from flowrl.config import build
    from flowrl.paths import CONFIG_DIR

    cfg = TrainConfig.from_yaml(CONFIG_DIR / "shapes" / "solrl.yaml")
    p = build.build_plan(cfg.rollout)
    assert isinstance(p, Explore) and isinstance(p.inner_plan, Chains)
    assert (p.keep, p.pool_size, p.backend, p.inner_plan.window.range) == (8, 32, "int8", [0, 5])
    counts = p.expected_counts(8)
    assert counts["leaves"] == 64 and counts["explore_forwards"] == 8 * 32 * 6


# ---- learning -------------------------------------------------------------------------------
@pytest.mark.slow  # 8 iterations of the shipped model with a 16-seed pool (about 10 s): `pytest -m slow`
def test_explore_raises_a_dense_reward_on_the_shapes_model(tmp_path):
    """Seeded: 8 iterations of the shapes Sol-RL preset (int8 explorer, pool 4·G) on four prompts raise the
    mean `redness` of ODE samples on fixed seeds by well over the spread between two seed sets."""
    from flowrl.paths import CONFIG_DIR
    from flowrl.rollout.sampling import ode_sample
    from flowrl.training.evaluation import eval_seeds

    prompts = ["a blue square", "a green triangle", "a cyan circle", "two yellow squares"]
    cfg = TrainConfig.from_yaml(
        CONFIG_DIR / "shapes" / "solrl.yaml",
        [
            f"prompts.train={'|'.join(prompts)}",
            "prompts.per_step=4",
            "prompts.eval=null",
            "model.guidance=1",
            "rollout.inner={plan: chains, group_size: 4, steps: 6, eta: 1.0, window: {mode: fixed, start: 0, size: 2}}",
            "rollout.pool=16",
            "rollout.preview_steps=3",
            "optim.lr=3e-3",
            "rewards=[{name: redness}]",
            "train.num_threads=1",
            "train.max_steps=8",
            f"train.output_dir={tmp_path}",
            "train.name=learn",
            "train.progress=false",
            "train.checkpoint_every=0",
        ],
    )
    trainer = Trainer(cfg)
    reward = trainer.reward.rewards[0]

    def mean_reward(seed: int) -> float:
        batch = [p for p in prompts for _ in range(8)]
        return float(
            reward(ode_sample(trainer.model, batch, eval_seeds(seed, len(batch)), steps=6, guidance=1.0), batch).mean()
        )

    before = [mean_reward(s) for s in (101, 202)]
    records = [trainer.train_step(it) for it in range(cfg.train.max_steps)]
    after = [mean_reward(s) for s in (101, 202)]
    noise = abs(before[0] - before[1])
    gain = sum(after) / 2 - sum(before) / 2
    assert gain > max(3 * noise, 0.01), f"before {before}, after {after}"
    assert all(r["leaves"] == 16 for r in records)
