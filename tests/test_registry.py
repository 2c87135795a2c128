"""One Registry class behind every kind of named thing, and one mechanism for a key's accepted values: choices
declared in a dataclass field's metadata, checked at config load and on direct construction alike."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import flowrl_rewards
from flowrl import models
from flowrl.config.schema import TrainConfig
from flowrl.core import components
from flowrl.core.choices import Checked, check_choices, choice, choices_of
from flowrl.core.registry import NotRegistered, Registry
from flowrl.credit.group import BASELINES, GroupAdvantage
from flowrl.errors import ConfigError
from flowrl.rollout import sde
from flowrl.rollout.chains import Chains, SDEWindow

ROOT = Path(__file__).resolve().parents[1]

# kind → (its registry, a registered name, what it resolves to, a typo and its nearest name, a plugin file's source)
KINDS = {
    "rollout.plan": (
        components.PLAN.registry,
        "chains",
        Chains,
        "chanis",
        "chains",
        "from dataclasses import dataclass\nfrom flowrl.rollout.chains import Chains\n\n"
        "@dataclass\nclass Plugged(Chains):\n    extra: int = 1\n",
    ),
    "credit.rule": (
        components.CREDIT.registry,
        "group",
        GroupAdvantage,
        "grop",
        "group",
        "from dataclasses import dataclass\nfrom flowrl.credit.group import GroupAdvantage\n\n"
        "@dataclass\nclass Plugged(GroupAdvantage):\n    extra: int = 1\n",
    ),
    "loss.objective": (
        components.LOSS.registry,
        "clipped",
        None,
        "clipd",
        "clipped",
        "from dataclasses import dataclass\nfrom flowrl.objectives.policy import PolicyLoss\n\n"
        "@dataclass\nclass Plugged(PolicyLoss):\n    extra: int = 1\n",
    ),
    "reward": (
        flowrl_rewards.REGISTRY,
        "brightness",
        None,
        "brightnes",
        "brightness",
        "from flowrl_rewards import Reward\n\nclass Plugged(Reward):\n"
        "    def score(self, images, prompts, meta):\n        return images.mean(dim=(1, 2, 3))\n",
    ),
    "rollout.kernel": (
        sde.KERNEL_FUNCTIONS,
        "dance",
        None,
        "dnce",
        "dance",
        "def Plugged(x, v, s, s_next, e):\n    return x + v * (s_next - s), 0 * s\n",
    ),
    "model.family": (
        models.MODEL_FAMILIES,
        "sd3",
        None,
        "sd4",
        "sd3",
        "from flowrl.models.sd3 import SD3FlowModel\n\nclass Plugged(SD3FlowModel):\n    pass\n",
    ),
}


def test_every_kind_is_one_registry_class():
    registries = {kind: entry[0] for kind, entry in KINDS.items()}
    assert all(type(r) is Registry for r in registries.values())
    assert {r.kind for r in registries.values()} == set(KINDS)
    assert [k.registry for k in components.KINDS] == [registries[k.key] for k in components.KINDS]
    for kind in components.KINDS:
        assert issubclass(kind.base_class(), Checked)  # every component checks its declared choices when built


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_registered_name_a_module_attr_and_a_file_attr_resolve(kind, tmp_path, monkeypatch):
    registry, name, expected, _, _, source = KINDS[kind]
    module = "flowrl_test_registry_" + kind.replace(".", "_")
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert name in registry and name in registry.names()
    if expected is not None:
        assert registry.resolve(name) is expected
    by_module = registry.resolve(f"{module}:Plugged")
    by_file = registry.resolve(f"{tmp_path / module}.py:Plugged")
    assert by_module.__name__ == by_file.__name__ == "Plugged"
    assert registry.resolve(f"{tmp_path / module}.py:Plugged") is by_file  # a file is imported once per process


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_typo_names_the_kind_the_nearest_name_and_the_accepted_ones(kind):
    registry, name, _, typo, nearest, _ = KINDS[kind]
    with pytest.raises(NotRegistered) as info:
        registry.resolve(typo)
    message = str(info.value)
    assert message.startswith(f"{kind}={typo!r} is not registered (did you mean {nearest!r}?); accepted: [")
    assert repr(name) in message and isinstance(info.value, ConfigError) and isinstance(info.value, KeyError)


def test_the_public_wrappers_keep_their_errors():
    with pytest.raises(KeyError, match="did you mean 'brightness'"):
        flowrl_rewards.build_reward("brightnes")
    with pytest.raises(ConfigError, match=r"rollout.plan='chanis' is not registered \(did you mean 'chains'\?\)"):
        components.resolve(components.PLAN, "chanis")
    with pytest.raises(ValueError, match=r"rollout.kernel='dnce' .*did you mean 'dance'"):
        sde.check_kernel("dnce", "rollout.kernel")
    with pytest.raises(ValueError, match=r"model.family='sd4' .*did you mean 'sd3'"):
        models.model_family("sd4")
    assert isinstance(models.model_family("flowrl.models.sd3:SD3FlowModel"), models.ModelFamily)
    assert sde.KERNELS == tuple(sde.KERNEL_FUNCTIONS)


def test_register_checks_the_name_and_the_target():
    from flowrl_rewards import Reward

    registry = Registry("thing", base=Reward)
    with pytest.raises(ValueError, match="thing name 'a:b' must be a non-empty string without ':'"):
        registry.register("a:b", "m:C")
    with pytest.raises(ValueError, match="'package.module:Class'"):
        registry.register("bad", "no_colon")
    with pytest.raises(TypeError, match="not a subclass of flowrl_rewards.Reward"):
        registry.register("bad", object)
    registry.register("lazy", "flowrl_rewards.heuristics.image_stats:Brightness")
    assert (
        registry["lazy"] == "flowrl_rewards.heuristics.image_stats:Brightness"
        and registry.resolve("lazy").__name__ == "Brightness"
    )
    assert registry.names() == ["lazy"] and dict(registry) == {
        "lazy": "flowrl_rewards.heuristics.image_stats:Brightness"
    }
    assert registry.pop("lazy") and "lazy" not in registry and len(registry) == 0


# ---- choices ------------------------------------------------------------------------------------------------
MESSAGE = "credit.baseline='meen' is not supported (did you mean 'mean'?); accepted: ['mean', 'median']"


def test_a_declared_choice_is_checked_at_config_load_and_on_direct_construction():
    assert choices_of(next(f for f in dataclasses.fields(GroupAdvantage) if f.name == "baseline")) == BASELINES
    with pytest.raises(ConfigError, match=re.escape(MESSAGE)):
        TrainConfig.from_yaml(None, ["credit.baseline=meen"])
    with pytest.raises(ConfigError, match=re.escape(MESSAGE)):
        GroupAdvantage(baseline="meen")
    with pytest.raises(ConfigError, match=r"rollout.window.mode='sliding' is not supported; accepted: \['all'"):
        TrainConfig.from_yaml(None, ["rollout.plan=chains", "loss.objective=clipped", "rollout.window.mode=sliding"])
    with pytest.raises(ConfigError, match=r"rollout.solver='dmp2' is not supported \(did you mean 'dpm2'\?\)"):
        components.build_nested(components.PLAN, {"plan": "ode", "solver": "dmp2"}, key="rollout.inner")
    with pytest.raises(ConfigError, match=r"rollout.window.mode='x'"):
        Chains(window=SDEWindow(mode="x"))


def test_a_subclass_is_checked_whatever_its_own_post_init():
    @dataclass
    class Mine(GroupAdvantage):
        colour: str = choice("red", ("red", "blue"))

        def __post_init__(self) -> None:  # no super() call: the choices are checked all the same
            self.seen = True

    assert Mine().seen
    with pytest.raises(ConfigError, match=r"credit.colour='green' is not supported; accepted: \['red', 'blue'\]"):
        Mine(colour="green")
    with pytest.raises(ConfigError, match=re.escape(MESSAGE)):
        Mine(baseline="meen")

    @dataclass
    class Plain:
        mode: str = choice("a", ("a", "b"))

    check_choices(Plain(), "section")
    with pytest.raises(ConfigError, match=r"section.mode='c' is not supported"):
        check_choices(Plain(mode="c"), "section")


# Hand-written raises of that form left, each with why: model.device is a pattern (cuda:N), not a list of choices.
LEFT = {"flowrl/config/checks.py"}


def test_no_hand_written_choice_raise_is_left():
    found = sorted(
        str(p.relative_to(ROOT))
        for package in ("flowrl", "rewards")
        for p in (ROOT / package).rglob("*.py")
        if "is not supported; accepted" in p.read_text()
    )
    assert sorted(set(found) - LEFT) == [], textwrap.fill(f"use flowrl.config.choices.choice()/choose() in {found}")
