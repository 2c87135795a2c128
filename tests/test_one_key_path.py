"""One key path (issue 62, item 2): every kind of key a config may misspell — a config key, a plan field, an objective
field, a reward setting, a setting nested in gdro_corrected's terms, a model keyword, an unread key — is refused by
one function, :func:`flowrl.core.choices.refuse_key`, with one suggestion rule and one message form:
``KEY[=VALUE] PROBLEM WHERE (did you mean 'X'?); accepted: [...]``."""

from __future__ import annotations

import re

import pytest

from flowrl.config.schema import TrainConfig
from flowrl.core.choices import SUGGESTION_CUTOFF, nearest
from flowrl.errors import ConfigError

FORM = re.compile(
    r"^(?P<key>\S+?)(=\S.*?)? (is|is set but) .*?(?P<hint> \(did you mean '(?P<near>[^']+)'\?\))?; accepted: \["
)


def refusal(overrides: list[str]) -> pytest.ExceptionInfo:
    with pytest.raises(ConfigError) as e:
        path = None if "loss.objective=clipped" in overrides else "configs/shapes/nft.yaml"
        TrainConfig.from_yaml(path, overrides)
    return e


GDRO = (
    "eval.rewards=[{name: gdro_corrected, kwargs: {reward: {name: shapes, kwargs: {mdoe: strict}}, "
    "quality: brightness}}]"
)


@pytest.mark.parametrize(
    "kind, overrides, key, near",
    [
        ("config key", ["optim.lrr=1"], "optim.lrr", "optim.lr"),
        ("plan field", ["rollout.grup_size=3"], "rollout.grup_size", "rollout.group_size"),
        ("objective field", ["loss.kl_reff=0.1"], "loss.kl_reff", "loss.kl_ref"),
        ("reward setting", ["rewards=[{name: shapes, kwargs: {mdoe: strict}}]"], "rewards[0].kwargs.mdoe", "mode"),
        ("nested gdro_corrected setting", [GDRO], "eval.rewards[0].kwargs.reward.kwargs.mdoe", "mode"),
        ("model kwarg", ["model.kwargs={negative_promt: x}"], "model.kwargs.negative_promt", "negative_prompt"),
        ("unread key", ["loss.objective=clipped", "loss.kl_ref=0", "loss.kl_form=flow_grpo"], "loss.kl_form", None),
    ],
)
def test_every_kind_of_key_is_refused_by_one_function_in_one_form(kind, overrides, key, near):
    e = refusal(overrides)
    assert e.traceback[-1].name == "refuse_key", (kind, [t.name for t in e.traceback])
    message = str(e.value)
    m = FORM.match(message)
    assert m and m.group("key") == key, (kind, message)
    assert m.group("near") == near, (kind, message)


def test_one_suggestion_rule():
    assert nearest("rollout.pol", ["rollout.pool", "train.max_steps"]) == "rollout.pool"
    assert nearest("rollout.prob", ["rollout.probe", "rollout.plan"]) == "rollout.probe"
    assert nearest("zzz", ["rollout.pool"]) is None
    assert SUGGESTION_CUTOFF == 0.6


def test_the_nested_gdro_setting_is_refused_at_load_without_building_anything():
    message = str(refusal([GDRO]).value)
    assert "reward 'shapes'" in message and "accepted: ['mode'" in message


def test_a_nested_secret_looking_setting_never_shows_its_value():
    gdro = (
        "eval.rewards=[{name: gdro_corrected, kwargs: {reward: {name: remote, kwargs: {url: 'http://x', "
        "api_kye: sk-SECRET}}, quality: brightness}}]"
    )
    message = str(refusal([gdro]).value)
    assert "api_kye=<not shown" in message and "sk-SECRET" not in message
