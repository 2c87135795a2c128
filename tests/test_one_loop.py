"""One loop for every objective (issue 35): the credit → objective contract, one spread statistic, the
config's help and keys."""

from __future__ import annotations

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.credit.group import GroupAdvantage
from flowrl.credit.tree import TreeAdvantage
from flowrl.objectives.nft import NFTLoss
from flowrl.objectives.policy import PolicyLoss
from flowrl.rollout.forest import Forest
from tests.conftest import make_model

TINY = [
    "model.family=sd3",
    "model.lora.rank=2",
    "rollout.plan=ode",
    "rollout.group_size=4",
    "rollout.steps=3",
    "prompts.train=a red circle|two blue squares",
    "prompts.per_step=2",
    "prompts.eval=null",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_reward=false",
    "rewards=[{name: redness}]",
    "loss.objective=nft",
    "train.max_steps=1",
]

HALF_RULE = '''from dataclasses import dataclass
import torch
from flowrl.credit.group import GroupAdvantage


@dataclass
class EveryOtherLeaf(GroupAdvantage):
    """The group rule, then weight 0 on every other leaf (by node order)."""

    def assign(self, forest, gather=None):
        stats = super().assign(forest, gather)
        forest.weight[forest.leaves()[1::2]] = 0.0
        return stats
'''


def chains(rewards: list[list[float]]) -> Forest:
    """A forest of one-edge chains: group g holds len(rewards[g]) leaves with those rewards (σ 0)."""
    f = Forest(prompts=[f"p{g}" for g in range(len(rewards))])
    sizes = [len(r) for r in rewards]
    groups = torch.arange(len(rewards)).repeat_interleave(torch.tensor(sizes))
    roots = f.add_roots(torch.zeros(sum(sizes), 1, 2, 2), groups, torch.arange(sum(sizes)))
    leaves = f.add_children(
        roots,
        torch.randn(sum(sizes), 1, 2, 2),
        0.0,
        1,
        torch.zeros(sum(sizes)),
        torch.ones(sum(sizes)),
        "flow_grpo",
        1.0,
        0,
    )
    f.reward[leaves] = torch.tensor([r for g in rewards for r in g])
    return f


def _train_record(tmp_path, name, *extra) -> dict:
    from flowrl.training.trainer import Trainer

    cfg = TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])
    records = Trainer(cfg, model=make_model("sd3")).train()
    return next(r for r in records if "trained_leaves" in r)


# ---- the credit rule's weight means the same for every objective --------------------------------
def test_a_credit_rule_that_zeroes_half_the_leaves_halves_trained_leaves_under_nft(tmp_path):
    rule = tmp_path / "half.py"
    rule.write_text(HALF_RULE)
    plain = _train_record(tmp_path, "plain")
    half = _train_record(tmp_path, "half", f"credit.rule={rule}:EveryOtherLeaf")
    assert plain["trained_leaves"] == 8
    assert half["trained_leaves"] == plain["trained_leaves"] / 2


def test_flat_groups_are_kept_by_leaf_objectives_and_skipped_by_policy_objectives():
    f = chains([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])  # group 1 has no spread
    GroupAdvantage(scale="group").assign(f)
    leaves = f.leaves()
    assert NFTLoss().units(f).tolist() == leaves.tolist()  # NFT trains a flat group (pulled to its old copy)
    assert PolicyLoss().units(f).tolist() == leaves[:3].tolist()  # nothing to learn for a policy gradient
    batches = NFTLoss(draws=1, micro_batch=64).batches(f)
    assert sum(b.size for b in batches) == 6


def test_mc_grpo_median_and_failed_rewards_are_not_trained_by_nft():
    f = chains([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, float("nan"), 10.0]])
    GroupAdvantage(baseline="median", scale="group").assign(f)
    leaves = f.leaves()
    kept = NFTLoss().units(f).tolist()
    assert kept == leaves[[0, 2, 3, 4, 7]].tolist()  # not the (lower) medians 2.0 and 1.0, not the failed reward


def test_width_pruned_chains_are_not_trained_by_a_leaf_objective():
    from tests.test_tree import chain_tree

    forest = Forest(prompts=["p"])
    t = chain_tree(forest, 0, [2, 2], 2, [1.0, 3.0, 2.5, 2.0])
    TreeAdvantage(width_prune="parent_top1").assign(forest)
    kept = set(NFTLoss().units(forest).tolist())
    leaves = forest.leaves().tolist()
    pruned = [leaf for j, leaf in enumerate(leaves) if float(forest.weight[t["chains"][j][-1]]) == 0]
    assert len(pruned) == 2 and kept == set(leaves) - set(pruned)


@pytest.mark.parametrize("rule", ["turning_point", "value_anchor"])
@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_step_level_credit_with_a_leaf_objective_is_refused_at_load(tmp_path, rule, objective):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml(
            None,
            [
                *TINY,
                f"train.output_dir={tmp_path}",
                "rollout.plan=chains",
                f"credit.rule={rule}",
                f"loss.objective={objective}",
            ],
        )
    msg = str(err.value)
    assert f"credit.rule={rule!r}" in msg and "edges" in msg and f"loss.objective={objective!r}" in msg


# ---- one spread statistic -------------------------------------------------------------------------
def test_one_spread_test_for_the_credit_rule_and_the_trainer():
    f = chains([[1.0, 1.0 + 5e-7, 1.0], [0.0, 1.0, float("nan")], [2.0, float("nan"), float("nan")]])
    stats = GroupAdvantage(scale="group").assign(f)
    flat = f.flat_groups(1e-6)
    assert flat.tolist() == [True, False, True]  # spread under the tolerance; a spread; one finite reward
    assert stats["zero_std_ratio"] == pytest.approx(float(flat.float().mean()))
    group = f.group[f.leaves()]
    assert (f.flat[f.leaves()] > 0).tolist() == flat[group].tolist()


# ---- the forest: built in layers, one device, its own kernel names --------------------------------
@pytest.mark.parametrize("steps", [4, 8])
def test_the_forest_copies_latents_linearly_in_the_steps(steps):
    """Building a chains rollout reads parents from their layers; the layers are concatenated once: the latent
    rows copied are at most the number of nodes (re-concatenating at every step would copy ~N·T/2)."""
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import Chains

    model = make_model("sd3")
    forest = Chains(group_size=2, steps=steps).rollout(model, ["a red circle", "a dog"], RolloutContext(seed=0))
    assert forest.copied_latent_rows == 0  # nothing concatenated while rolling out
    forest.score_requests()
    forest.all_latents()
    forest.all_latents()
    assert forest.num_nodes == 4 * (steps + 1)
    assert forest.copied_latent_rows == forest.num_nodes  # one freeze


def test_column_buffers_grow_by_doubling_and_keep_whole_column_writes():
    f = Forest(prompts=["p"])
    nodes = f.add_roots(torch.zeros(1, 1, 2, 2), [0], [0])
    for k in range(200):
        nodes = f.add_children(
            nodes, torch.full((1, 1, 2, 2), float(k)), 0.5, k + 1, torch.zeros(1), torch.ones(1), "flow_grpo", 0.7, k
        )
    assert f.num_nodes == 201 and f.step.tolist() == list(range(201)) and f.parent.tolist() == [-1] + list(range(200))
    assert f._buffers["step"].shape[0] < 4 * 201  # amortised: capacity within a factor of the size
    f.advantage = torch.arange(201.0)  # a credit rule replaces a column wholesale, then the forest grows
    f.add_children(nodes, torch.zeros(1, 1, 2, 2), 0.0, 201, torch.zeros(1), torch.ones(1), "ode", 0.0, 200)
    assert f.advantage[:201].tolist() == list(range(201)) and float(f.advantage[201]) == 0.0
    assert torch.equal(f.latents_of(torch.tensor([5, 0, 200])).flatten(1)[:, 0], torch.tensor([4.0, 0.0, 199.0]))


def test_probe_and_leaf_latents_share_the_forests_device():
    """The device is declared (a rollout's forest: its model's); latents and probes computed elsewhere move to it."""
    f = Forest(prompts=["p"], device="meta")
    roots = f.add_roots(torch.zeros(2, 1, 2, 2, device="meta"), [0, 0], [0, 1])
    mids = f.add_children(
        roots, torch.zeros(2, 1, 2, 2, device="meta"), 0.5, 1, torch.zeros(2), torch.ones(2), "dance", 0.5, 0
    )
    f.add_children(mids, torch.zeros(2, 1, 2, 2, device="meta"), 0.0, 2, torch.zeros(2), torch.zeros(2), "ode", 0.0, 1)
    f.add_probe(mids, torch.zeros(2, 1, 2, 2))  # a clean estimate computed on the CPU
    assert f.device == torch.device("meta") and f.probe_latents().device == torch.device("meta")
    nodes, x0 = f.score_requests()  # leaves and probes in one tensor: they must share a device
    assert x0.device == torch.device("meta") and x0.shape[0] == 4
    assert Forest(prompts=["p"]).device == torch.device("cpu")  # declared: cpu unless the rollout says its model's


def test_kernel_names_belong_to_the_forest_and_survive_a_merge():
    def one(kernel: str) -> Forest:
        f = Forest(prompts=["p"])
        roots = f.add_roots(torch.zeros(1, 1, 2, 2), [0], [0])
        f.add_children(roots, torch.zeros(1, 1, 2, 2), 0.5, 1, torch.zeros(1), torch.ones(1), kernel, 0.5, 0)
        return f

    a, b = one("dance"), one("my_plugin_kernel")
    assert a.kernels == ["ode", "dance"] and b.kernels == ["ode", "my_plugin_kernel"]
    merged = Forest.merge([a, b])
    names = [merged.kernels[int(k)] for k in merged.kernel[merged.parent >= 0]]
    assert names == ["dance", "my_plugin_kernel"]
    assert Forest(prompts=["q"]).kernels == ["ode"]  # no process-global list grows behind a new forest


# ---- the help lists the config that runs; every accepted key does something ------------------------
def _help(*args: str) -> str:
    """``flowrl train ARGS --help``'s text, from the parser in this process (the module entry point in a fresh
    interpreter: tests/test_config_cli.py::test_help_explains_options)."""
    import contextlib
    import io

    from flowrl.commands.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["train", *args, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def _section(text: str, name: str) -> str:
    """The lines of top-level YAML section ``name`` in a help text."""
    lines = text.split("\n")
    start = lines.index(f"{name}:")
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" "))
    return "\n".join(lines[start:end])


def test_train_help_lists_the_main_jobs_keys_with_the_objectives_own():
    out = _help()
    assert "every config key, with its value in configs/shapes/nft.yaml" in out
    loss = _section(out, "loss")
    for key in ("objective: nft", "beta: 1.0", "adv_scale: 2.0", "draws: 2", "old_decay: 0.9", "teacher:"):
        assert key in loss, key
    assert "clip_low" not in loss  # the clipped objective's keys are not the job's
    rollout = _section(out, "rollout")
    assert "plan: ode" in rollout and "window" not in rollout and "eta" not in rollout
    grpo = _section(_help("configs/shapes/grpo.yaml"), "loss")
    assert "clip_low" in grpo and "draws" not in grpo


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.eta=0.5", ["rollout.eta"]),
        ("rollout.window.mode=random", ["rollout.window"]),
        ("rollout.post_solver=dpm2", ["rollout.post_solver"]),
        ("rollout.kernel=flow_grpo", ["rollout.kernel"]),
    ],
)
def test_the_ode_plan_refuses_the_keys_it_does_not_read(tmp_path, override, words):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", override])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_chains_with_the_ode_kernel_is_refused_for_the_ode_plan(tmp_path):
    with pytest.raises(ConfigError, match="rollout.plan: ode"):
        TrainConfig.from_yaml(
            None, [f"train.output_dir={tmp_path}", "rollout.plan=chains", "rollout.kernel=ode", "loss.objective=nft"]
        )


# ---- one owner per setting ----------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["clipped", "nft", "awm"])
def test_the_reference_kl_is_kl_ref_for_every_objective(tmp_path, objective):
    from flowrl.config import build

    plan = "rollout.plan=chains" if objective == "clipped" else "rollout.plan=ode"
    cfg = TrainConfig.from_yaml(
        None, [f"train.output_dir={tmp_path}", plan, f"loss.objective={objective}", "loss.kl_ref=0.25"]
    )
    assert build.build_loss(cfg).kl_ref == 0.25


def test_the_old_keys_say_where_they_went(tmp_path):
    with pytest.raises(ConfigError, match="loss.kl_ref"):
        TrainConfig.from_yaml(None, [f"train.output_dir={tmp_path}", "loss.objective=clipped", "loss.beta=0.04"])
    with pytest.raises(ConfigError, match="rollout.max_batch"):
        TrainConfig.from_yaml(
            None, [f"train.output_dir={tmp_path}", "rollout.plan=ode", "loss.objective=nft", "loss.batch_size=8"]
        )
    for key in ("eval.batch_size=8", "loss.layer_batch=8"):  # folded into the one micro-batch key as well
        with pytest.raises(ConfigError, match=r"is gone; use rollout.max_batch"):
            TrainConfig.from_yaml(None, [f"train.output_dir={tmp_path}", "loss.objective=layer_tuning", key])


def test_one_micro_batch_key_sizes_the_forward_process_micro_batches(tmp_path):
    from flowrl.config import build

    cfg = TrainConfig.from_yaml(
        None,
        [
            f"train.output_dir={tmp_path}",
            "rollout.plan=ode",
            "loss.objective=nft",
            "rollout.max_batch=6",
            "loss.draws=2",
        ],
    )
    objective = build.build_loss(cfg)
    f = chains([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 5.0]])
    GroupAdvantage(scale="group").assign(f)
    assert [b.size for b in objective.batches(f)] == [3, 3, 2]  # 6 rows = 3 leaves × 2 draws per forward


# ---- the model section's pass-through ---------------------------------------------------------------
def test_model_kwargs_reach_the_adapter_from_yaml_alone(tmp_path):
    """SANA's complex_human_instruction has no key of its own: ``model.kwargs`` carries it to the adapter."""
    from flowrl.config import build
    from flowrl.models.testing import tiny_sana_pipeline

    tiny_sana_pipeline().save_pretrained(tmp_path / "sana")
    yaml = tmp_path / "sana.yaml"
    yaml.write_text(
        f"model: {{family: sana, path: {tmp_path / 'sana'}, max_sequence_length: 8, device: cpu,\n"
        "        kwargs: {complex_human_instruction: ['Rewrite the prompt:'], negative_prompt: blurry}}\n"
    )
    cfg = TrainConfig.from_yaml(yaml, [f"train.output_dir={tmp_path}"])
    model = build.build_model(cfg.model)
    assert model.complex_human_instruction == ["Rewrite the prompt:"] and model.negative_prompt == "blurry"
    plain = build.build_model(
        TrainConfig.from_yaml(
            None,
            [f"model.path={tmp_path / 'sana'}", "model.family=sana", "model.max_sequence_length=8", "model.device=cpu"],
        ).model
    )
    assert plain.complex_human_instruction is None and plain.negative_prompt == ""
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs.instruction='x' is not a key of the model.family='sana' "
        r"adapter \(did you mean 'complex_human_instruction'\?\); accepted: \[",
    ):
        TrainConfig.from_yaml(yaml, ["model.kwargs={instruction: x}"])  # at load (tests/test_key_checks.py)
    with pytest.raises(ConfigError, match="set model.guidance"):
        build.build_model(TrainConfig.from_yaml(yaml, ["model.kwargs={guidance: 2.0}"]).model)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.plan=chains", "rollout.post_steps_ratio=0.5"], "rollout.post_steps_ratio"),
        (
            ["rollout.plan=probed", "rollout.inner={plan: chains, post_steps_ratio: 0.6}"],
            "rollout.inner.post_steps_ratio",
        ),
        (
            ["rollout.plan=explore", "rollout.inner={plan: chains, post_steps_ratio: 0.6}"],
            "rollout.inner.post_steps_ratio",
        ),
    ],
)
def test_a_key_that_nothing_reads_is_refused(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match="nothing reads it") as err:
        TrainConfig.from_yaml(None, [f"train.output_dir={tmp_path}", "loss.objective=clipped", *overrides])
    assert str(err.value).startswith(key), str(err.value)


def test_the_inner_plan_is_one_nested_mapping(tmp_path):
    from flowrl.config import build

    cfg = TrainConfig.from_yaml(
        None,
        [
            f"train.output_dir={tmp_path}",
            "loss.objective=clipped",
            "rollout.plan=explore",
            "rollout.inner={plan: chains, group_size: 4, window: {mode: fixed, size: 2}}",
        ],
    )
    plan = build.build_plan(cfg.rollout)
    assert (plan.inner_plan.group_size, plan.inner_plan.window.mode, plan.inner_plan.window.size) == (4, "fixed", 2)


def test_a_wrapping_plan_has_no_keys_of_its_inner_plan():
    """The probed plan reuses no chain keys by inheritance: a chain key beside it is not one of its keys at all, and the
    ODE plan has only the keys it reads (no kernel, eta, window or post-solver)."""
    with pytest.raises(ConfigError, match="rollout.eta is not a key of the config"):
        TrainConfig.from_yaml(None, ["rollout.plan=probed", "rollout.eta=0.3"])
    with pytest.raises(ConfigError, match="rollout.window.size is not a key of the config"):
        TrainConfig.from_yaml(None, ["rollout.plan=ode", "loss.objective=nft", "rollout.window.size=2"])
    from flowrl.rollout.chains import Chains, ODEChains

    assert not issubclass(ODEChains, Chains)
    assert {f.name for f in __import__("dataclasses").fields(ODEChains)} == {
        "group_size",
        "steps",
        "solver",
        "teacher_share",
    }
