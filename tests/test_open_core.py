"""The core's doors: components by name from YAML, rewards on forest nodes, the plan lifecycle, one
owner per setting (the loss's reduction), one reward-combination path (MultiReward)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import make_model
from test_trainer import tiny_config

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.policy import PolicyLoss
from flowrl.rollout.forest import Forest
from flowrl.training.trainer import Trainer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


@pytest.fixture
def plugin(tmp_path) -> Path:
    """The worked example of docs/extending.md, saved as the docs say."""
    import re

    code = next(b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "class ProbedChains" in b)
    path = tmp_path / "probed_method.py"
    path.write_text(code)
    return path


def plugin_yaml(tmp_path: Path, folder: Path, events: Path, plugin: Path) -> Path:
    path = tmp_path / "method.yaml"
    path.write_text(f"""
model: {{family: sd3, path: {folder}, lora: {{rank: 4}}}}
rollout:
  plan: {plugin}:ProbedChains
  group_size: 3
  steps: 3
  events: {events}
credit: {{rule: {plugin}:GainOverProbe, scale: 2.0}}
rewards: [{{name: brightness}}]
prompts: {{train: "a red circle|a blue square", eval: null, per_step: 2}}
eval: {{rewards: null}}
train: {{max_steps: 2, output_dir: {tmp_path}, name: plug, progress: false, updates_per_epoch: 2}}
""")
    return path


@pytest.fixture
def tiny_folder(tmp_path):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


def test_a_plan_and_a_credit_rule_from_a_file_train_from_yaml_alone(tmp_path, tiny_folder, plugin):
    events = tmp_path / "events.jsonl"
    assert main(["train", str(plugin_yaml(tmp_path, tiny_folder, events, plugin))]) == 0
    log = [json.loads(l) for l in events.read_text().splitlines()]
    kinds = [e["event"] for e in log]
    # lifecycle: set up once with the run's reward, then per iteration a rollout and one call per optimizer step
    assert kinds == ["setup", "rollout", "after_update", "after_update", "rollout", "after_update", "after_update"]
    assert log[0]["reward"] == "MultiReward"
    records = [json.loads(l) for l in (tmp_path / "plug" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "probe_gain_mean" in r]
    assert len(train) == 2
    for r in train:  # the credit rule's statistics reach the log; the probed states were scored
        assert 0.0 <= r["probe_value_mean"] <= 1.0
        assert r["rollout_forwards"] == 2 * 3 * 3 + 2 * 3  # chains + one probe forward per chain
        assert r["trained_edges"] == 2 * 3 * 2  # 2 prompts x 3 chains x 2 SDE steps


def test_plugin_sections_are_checked_against_the_plugins_own_fields(tmp_path, tiny_folder, plugin):
    path = plugin_yaml(tmp_path, tiny_folder, tmp_path / "e.jsonl", plugin)
    cfg = TrainConfig.from_yaml(path)
    assert cfg.rollout.events == str(tmp_path / "e.jsonl") and cfg.credit.scale == 2.0
    assert not hasattr(cfg.rollout, "inner")  # metadata config=False: not a key
    with pytest.raises(ConfigError, match="did you mean 'rollout.events'"):
        TrainConfig.from_yaml(path, ["rollout.evnts=x"])
    with pytest.raises(ConfigError, match="did you mean 'credit.scale'"):
        TrainConfig.from_yaml(path, ["credit.scael=1"])
    with pytest.raises(ConfigError, match="rollout.kernel"):  # a chains key the plugin plan does not have
        TrainConfig.from_yaml(path, ["rollout.kernel=dance"])
    with pytest.raises(ConfigError, match="credit.scale"):
        TrainConfig.from_yaml(path, ["credit.scale=abc"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("  steps: 3", "  stesp: 3"))
    with pytest.raises(
        ConfigError, match=r"rollout.stesp is not a key of the config in .*bad.yaml \(did you mean 'rollout.steps'\?\)"
    ):
        TrainConfig.from_yaml(bad)


def test_unknown_component_names_list_the_registered_ones(plugin):
    with pytest.raises(ConfigError, match=r"rollout.plan='chanis' is not registered \(did you mean 'chains'\?\)"):
        TrainConfig.from_yaml(None, ["rollout.plan=chanis"])
    with pytest.raises(
        ConfigError, match=r"credit.rule='grop' is not registered \(did you mean 'group'\?\); accepted: \['group'"
    ):
        TrainConfig.from_yaml(None, ["credit.rule=grop"])
    with pytest.raises(ConfigError, match="loss.objective"):
        TrainConfig.from_yaml(None, ["loss.objective=nope"])
    with pytest.raises(ConfigError, match="no class 'Missing'.*ProbedChains"):
        TrainConfig.from_yaml(None, [f"rollout.plan={plugin}:Missing"])
    with pytest.raises(ConfigError, match="not a subclass of flowrl.RolloutPlan"):
        TrainConfig.from_yaml(None, [f"rollout.plan={plugin}:GainOverProbe"])
    with pytest.raises(ConfigError, match="reward_normalize: group"):
        TrainConfig.from_yaml(None, ["credit.per_reward_norm=true"])


def test_help_lists_the_keys_of_the_chosen_components(tmp_path, tiny_folder, plugin, capsys):
    path = plugin_yaml(tmp_path, tiny_folder, tmp_path / "e.jsonl", plugin)
    with pytest.raises(SystemExit):
        main(["train", str(path), "--help"])
    out = capsys.readouterr().out
    rollout = out[out.index("\nrollout:") : out.index("\nrewards:")]
    assert "events:" in rollout and "group_size: 3" in rollout and "kernel:" not in rollout
    assert "scale: 2.0" in out[out.index("\ncredit:") :]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "plan: ode" in out and "objective: nft" in out and "events:" not in out  # the main job's keys


def test_loss_reduction_sum_replays_with_ratio_one(tmp_path):
    """The loss owns log-prob reduction; rollout and replay follow it (a sum-reduced first update used
    to log |Δlogp| ≈ 970 and ratio 0 because rollouts were always mean-reduced)."""
    trainer = Trainer(tiny_config(tmp_path, "sum", "loss.reduction=sum"), model=make_model("sd3"))
    record = trainer.train_step(0)
    assert record["first_step_abs_delta_logp"] == 0.0
    assert record["ratio_min"] == record["ratio_max"] == 1.0


def test_batch_normalised_rewards_reach_credit(tmp_path):
    """MultiReward(normalize="batch") is the one combination path: the leaves' reward is the weighted
    sum of batch z-scores, not of raw scores."""
    cfg = tiny_config(tmp_path, "norm", "reward_normalize=batch")
    cfg.rewards = [
        type(cfg.rewards[0])(name="brightness", weight=1.0),
        type(cfg.rewards[0])(name="redness", weight=0.5),
    ]
    trainer = Trainer(cfg, model=make_model("sd3"))
    forest, _ = trainer.rollout(0)
    leaves = forest.leaves()
    z = lambda x: (x - x.mean()) / x.std(unbiased=False)
    b, r = forest.reward_components["brightness"][leaves], forest.reward_components["redness"][leaves]
    torch.testing.assert_close(forest.reward[leaves], z(b) + 0.5 * z(r), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(forest.reward[leaves], b + 0.5 * r)


def test_merge_keeps_outcomes_components_and_probes():
    def part(reward_value: float) -> Forest:
        f = Forest(prompts=["p"])
        root = f.add_roots(torch.randn(1, 2, 2, 2), group=[0], seed=[1])
        kid = f.add_children(
            root, torch.randn(1, 2, 2, 2), 0.5, 1, torch.zeros(1), torch.full((1,), 0.3), "dance", 0.3, 0
        )
        leaf = f.add_children(kid, torch.randn(1, 2, 2, 2), 0.0, 2, torch.zeros(1), torch.zeros(1), "ode", 0.0, 1)
        f.add_probe(kid, torch.full((1, 2, 2, 2), reward_value))
        f.value[kid] = 0.25  # written during rollout: never wiped
        f.record_scores(torch.cat([leaf, kid]), {"r": torch.tensor([reward_value, reward_value / 2])})
        return f

    m = Forest.merge([part(1.0), part(3.0)])
    assert m.probe_node.tolist() == [1, 4]
    torch.testing.assert_close(m.probe_latents()[:, 0, 0, 0], torch.tensor([1.0, 3.0]))
    assert m.reward_components["r"].tolist()[1:3] == [0.5, 1.0] and m.reward_components["r"].tolist()[4:6] == [1.5, 3.0]
    assert m.value[[1, 4]].tolist() == [0.25, 0.25]
    m.combine_scores(lambda comps, groups: comps["r"] * 10)
    assert m.reward[[2, 5]].tolist() == [10.0, 30.0] and m.value[[1, 4]].tolist() == [5.0, 15.0]
    nodes, x0 = m.score_requests()
    assert nodes.tolist() == [2, 5, 1, 4] and x0.shape == (4, 2, 2, 2)


def test_probe_x0_scores_states_reached_by_sde_steps_without_extra_forwards(sd3_model):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import Chains, SDEWindow
    from flowrl.rollout.probes import probe_x0

    plan = Chains(group_size=2, steps=4, eta=0.7, window=SDEWindow(mode="fixed", start=1, size=2))
    plain = plan.rollout(sd3_model, ["a red circle"], RolloutContext(seed=3))
    probed = plan.rollout(sd3_model, ["a red circle"], RolloutContext(seed=3, observers=(probe_x0,)))
    assert probed.counters["forwards"] == plain.counters["forwards"]
    torch.testing.assert_close(probed.all_latents(), plain.all_latents(), rtol=0, atol=0)
    reached = torch.nonzero(probed.stochastic).flatten()  # states after SDE steps 1 and 2, per chain
    assert sorted(probed.probe_node.tolist()) == sorted(reached.tolist()) and reached.numel() == 4
    n = int(probed.probe_node[0])
    x = probed.all_latents()[n : n + 1]
    sigma = float(probed.sigma[n])
    cond = sd3_model.encode(probed.prompts, probed.guidance).select(probed.group[n : n + 1])
    v = sd3_model.velocity(x, torch.full((1,), sigma), cond, probed.guidance)
    torch.testing.assert_close(probed.probe_latents()[:1], x - sigma * v, rtol=1e-5, atol=1e-5)
    nodes, _ = probed.score_requests()
    assert nodes.numel() == probed.leaves().numel() + 4


@dataclass
class WithAux(PolicyLoss):
    """The clipped objective with a constant auxiliary term that counts its calls (a class-level list)."""

    calls: ClassVar[list[int]] = []

    def auxiliary(self, model, forest, cond):
        WithAux.calls.append(forest.num_nodes)
        p = next(q for q in model.trainable.parameters() if q.requires_grad)
        return (p**2).sum() * 0.0 + 1.5, {"aux_term": torch.tensor(1.5)}


def test_objective_auxiliary_term_runs_once_per_optimizer_step(tmp_path):
    """An objective is chosen by the config (here a plugin named by module), fixed for the run."""
    WithAux.calls.clear()
    cfg = tiny_config(tmp_path, "aux", "train.updates_per_epoch=2", f"loss.objective={__name__}:WithAux")
    trainer = Trainer(cfg, model=make_model("sd3"))
    assert type(trainer.objective) is WithAux and trainer.updater.objective is trainer.objective
    record = trainer.train_step(0)
    assert len(WithAux.calls) == 2 and record["aux_term"] == 1.5


def test_every_registered_component_is_a_public_name_of_flowrl():
    import flowrl
    from flowrl.core import components

    for kind in components.KINDS:
        for name, target in kind.registry.items():
            cls_name = target.split(":")[1]
            assert getattr(flowrl, cls_name) is components.resolve(kind, name), (kind.section, name)
