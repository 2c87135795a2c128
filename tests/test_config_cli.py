"""Configuration schema and the command line: clear errors that name the key, help that lists keys."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.paths import CONFIG_DIR

PRESETS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_preset_loads_and_builds_its_plan(path):
    from flowrl.config import build

    try:
        cfg = TrainConfig.from_yaml(path)
    except ConfigError as err:  # a GPU precision preset on a machine without that GPU
        assert "cannot run on" in str(err) and "backends this machine can run" in str(err), err
        cfg = TrainConfig.from_yaml(path, ["rollout.backend=same"])
    plan = build.build_plan(cfg.rollout)
    counts = plan.expected_counts(2)
    objective = build.build_loss(cfg)
    facts = objective.describe()
    facts.check_plan(plan)
    # what the objective trains on is there: stochastic edges for a policy, clean leaves for a forward process
    assert counts["trained_edges" if facts.trains_on == "edges" else "leaves"] > 0


def test_overrides_may_follow_options_and_unknown_options_still_fail():
    from flowrl.commands.main import parse_args

    args = parse_args(["snr", "configs/shapes/vgpo.yaml", "--batches", "4", "train.seed=3", "optim.lr=1e-4"])
    assert args.batches == 4 and args.config == "configs/shapes/vgpo.yaml"
    assert args.overrides == ["train.seed=3", "optim.lr=1e-4"]
    with pytest.raises(SystemExit):
        parse_args(["snr", "configs/shapes/vgpo.yaml", "--batches", "4", "--bogus"])


def test_overrides_apply_with_types():
    cfg = TrainConfig.from_yaml(
        None, ["rollout.group_size=4", "optim.lr=1e-5", "rollout.window.range=[0,4]", "model.lora.targets=[to_q,to_k]"]
    )
    assert cfg.rollout.group_size == 4 and cfg.optim.lr == 1e-5
    assert cfg.rollout.window.range == [0, 4] and cfg.model.lora.targets == ["to_q", "to_k"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.grup_size=3", "did you mean 'rollout.group_size'"),
        ("optim.lrr=1", "did you mean 'optim.lr'"),
        ("trian.max_steps=3", "did you mean 'train.max_steps'"),
        ("rollout.group_size=abc", "rollout.group_size"),
        ("model.family=sd4", "model.family='sd4' is not supported (did you mean 'sd3'?)"),
        ("credit.scale=std", "accepted"),
        ("train.ema=1.5", "train.ema=1.5"),
        ("rollout.group_size", "not of the form key=value"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        TrainConfig.from_yaml(None, [override])


def test_bad_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  kernal: dance\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.kernel'"):
        TrainConfig.from_yaml(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.kernel=euler", "rollout.kernel='euler'"),
        ("rollout.window.mode=sliding", "rollout.window.mode='sliding'"),
        ("loss.kl_form=reverse", "loss.kl_form='reverse'"),
        ("credit.baseline=mode", "credit.baseline='mode'"),
    ],
)
def test_component_value_errors_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_yaml(None, [override])


def test_cli_typo_exits_2_with_the_nearest_key(capsys):
    assert main(["train", "rollout.grup_size=3"]) == 2
    assert "did you mean 'rollout.group_size'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sample", "eval", "bench"])
def test_help_explains_options(command, capsys):
    if command == "train":  # the module entry point, in a fresh interpreter (about 2 s of imports)
        out = subprocess.run(
            [sys.executable, "-m", "flowrl", command, "--help"], capture_output=True, text=True, check=True
        ).stdout
    else:  # the same parser in this process
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
    assert "usage: flowrl " + command in out
    if command != "sample":
        for key in ("group_size", "max_steps", "resume", "keep_last"):
            assert key in out
    else:
        assert "--checkpoint" in out and "--prompt" in out


def test_resolved_config_round_trips(tmp_path):
    cfg = TrainConfig.from_yaml(None, ["rollout.window.mode=progressive", "train.name=x"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert TrainConfig.from_yaml(path) == cfg


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_preset_trains_one_iteration_with_replay_ratio_one(path, tmp_path, monkeypatch):
    """Each preset's plan, credit rule and objective, on the tiny SD3 pipeline (its model swapped in): one
    iteration trains, and a policy objective's first inner step replays every edge with ratio exactly 1."""
    import math

    from flowrl.config import build
    from flowrl.training.trainer import Trainer
    from tests.conftest import make_model

    overrides = [
        "model.lora.targets=null",
        "model.lora.rank=2",
        "model.full_finetune=false",
        "model.dtype=float32",
        "model.device=cpu",
        "model.gradient_checkpointing=false",
        "model.compile=off",  # a preset's regional compile traces for seconds here: tests/test_blocks.py tests it
        "model.shard=ddp",  # one process: an 8-GPU preset's sharding and context parallelism off
        "model.context_parallel={ulysses: 1, ring: 1}",
        "prompts.per_step=2",
        "prompts.train=a red circle|two blue squares",
        "prompts.eval=null",
        "rewards=[{name: brightness}]",
        "eval.rewards=null",
        "reward_normalize=none",
        "train.num_threads=1",
        "train.progress=false",
        "train.async_reward=false",
        "train.pipeline=sync",  # the tiny model is given in code, and a first step's ratio is 1 at staleness 0
        f"train.output_dir={tmp_path}",
    ]
    try:
        cfg = TrainConfig.from_yaml(path, overrides)
    except ConfigError as err:  # a GPU precision preset on a machine without that GPU
        assert "cannot run on" in str(err), err
        cfg = TrainConfig.from_yaml(path, overrides + ["rollout.backend=same"])
    model = make_model("sd3")
    if cfg.rollout.plan == "offline":  # a stored set of rollouts to train on, written by the `flowrl rollouts` code
        from flowrl.commands.rollouts import write_rollouts

        store = write_rollouts(
            cfg, tmp_path / "store", images_per_prompt=cfg.rollout.group_size, steps=2, model=model, verbose=False
        )
        cfg = TrainConfig.from_yaml(path, overrides + [f"rollout.source={store}"])
    monkeypatch.setattr(build, "build_model", lambda *a, **k: model)
    trainer = Trainer(cfg, model=model)
    record = trainer.train_step(0)
    assert math.isfinite(record["grad_norm"]) and record["skipped_steps"] == 0
    if trainer.objective.trains_on == "edges":
        assert record["first_step_abs_delta_logp"] == 0.0, record


@pytest.mark.parametrize(
    "overrides, key, why",
    [
        (
            ["loss.objective=nft", "rollout.plan=ode", "loss.optimality_form=linear", "loss.adv_scale=7"],
            "loss.adv_scale",
            "optimality_form='linear'",
        ),
        (
            ["loss.objective=raft", "rollout.plan=ode", "loss.old_decay=0.5"],
            "loss.old_decay",
            "RAFTLoss keeps no old copy",
        ),
        (["loss.objective=clipped", "loss.kl_ref=0", "loss.kl_form=flow_grpo"], "loss.kl_form", "kl_ref is 0"),
        (["rollout.plan=tree", "credit.rule=tree", "credit.fusion_beta=2"], "credit.fusion_beta", "fusion='mean'"),
        (["rollout.plan=tree", "credit.rule=tree", "credit.width_b=2"], "credit.width_b", "width_prune='none'"),
    ],
)
def test_a_key_nothing_reads_is_refused_for_objectives_and_credit_rules_alike(overrides, key, why):
    """One mechanism for every component kind (Checked.unread_fields → unread_keys, refused by the config check): a key
    set away from its default that the component's other settings leave unread fails at load, naming it and why."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} is set but nothing reads it: .*{re.escape(why)}"):
        TrainConfig.from_yaml(None, overrides)
    TrainConfig.from_yaml(None, [o for o in overrides if not o.startswith(key + "=")])  # without it: accepted


def test_an_out_of_tree_objective_declares_the_inherited_keys_it_never_reads(tmp_path):
    """A subclass reuses its base's keys by inheritance; those it does not read it declares, and they are refused."""
    plugin = tmp_path / "fixed_t.py"
    plugin.write_text(
        "from dataclasses import dataclass\n\nfrom flowrl.objectives.nft import NFTLoss\n\n\n"
        "@dataclass\nclass FixedT(NFTLoss):\n    def unread_fields(self):\n"
        "        return {**super().unread_fields(), 'draws': 'FixedT trains one point per leaf'}\n"
    )
    with pytest.raises(ConfigError, match=r"loss.draws is set but nothing reads it: FixedT trains one point per leaf"):
        TrainConfig.from_yaml(None, [f"loss.objective={plugin}:FixedT", "rollout.plan=ode", "loss.draws=4"])
    assert TrainConfig.from_yaml(None, [f"loss.objective={plugin}:FixedT", "rollout.plan=ode"]).loss.draws == 2


def test_the_checks_change_nothing_and_the_config_carries_no_components(monkeypatch):
    """Checking a config changes none of its values (YAML's true/false stay as given; their readers parse them) and
    leaves nothing on it: the plan, credit rule and objective are built and checked at load and let go; each run
    builds its own from the sections as they are then, so a config changed after loading is checked again."""
    import copy

    from flowrl.config import chosen
    from flowrl.core import components

    cfg = TrainConfig.from_yaml(None, ["train.async_reward=True", "optim.loss_scaling=False"])
    before = copy.deepcopy(cfg)
    cfg.validate()
    assert cfg == before and cfg.train.async_reward == "True" and cfg.optim.loss_scaling == "False"
    assert vars(cfg) == vars(before)  # no built component kept beside the values
    built = []
    real = components.instantiate
    monkeypatch.setattr(
        components, "instantiate", lambda kind, section: built.append(kind.section) or real(kind, section)
    )
    cfg = TrainConfig.from_yaml(None, ["loss.objective=nft", "rollout.plan=ode"])
    assert sorted(built) == ["credit", "loss", "rollout"]  # checked at load
    plan, credit, objective = chosen.build_components(cfg)
    assert len(built) == 6 and type(objective).__name__ == "NFTLoss"
    again = chosen.build_components(cfg)  # a second run of the same config: its own components
    assert again.objective is not objective and again.plan is not plan and len(built) == 9
    cfg.loss.optimality_form = "linear"
    cfg.loss.adv_scale = 3.0  # changed after loading into an unread key: refused when the run builds its components
    with pytest.raises(ConfigError, match="loss.adv_scale is set but nothing reads it"):
        chosen.build_components(cfg)
