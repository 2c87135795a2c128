"""Every key checked at load by one path (issue 53, items 2 and 5): reward settings, ``model.kwargs`` and the keys of
wrapped plans are refused when the config loads, naming the key, the value and the accepted keys, with no model loaded
and no reward built."""

from __future__ import annotations

import textwrap
import time

import pytest

from flowrl.commands.main import main
from flowrl.config.build import build_model
from flowrl.config.schema import ConfigError, ModelSection, TrainConfig
from flowrl.models import ModelFamily, adapter_keywords
from flowrl_rewards.core.registry import REGISTRY, settings_of


def _refuse(*args, **kwargs):
    raise AssertionError("a model or a reward was built while the config loaded")


@pytest.fixture
def nothing_built(monkeypatch):
    """Any model load, and the shapes/OCR rewards' constructors, raise: a check that reaches them fails the test."""
    from flowrl import models
    from flowrl_rewards.compositional.shapes import ShapesReward
    from flowrl_rewards.text.ocr import OcrReward

    monkeypatch.setattr(ModelFamily, "load", _refuse)
    monkeypatch.setattr(models, "load_model", _refuse)
    for cls in (ShapesReward, OcrReward):
        settings_of(cls)  # derived from the real constructor (cached once per class) before it is replaced
        monkeypatch.setattr(cls, "__init__", _refuse)


def load(*overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, list(overrides))


# ---- reward settings ----------------------------------------------------------------------------------------------
def test_a_misspelt_reward_setting_is_refused_at_load_naming_key_value_and_settings(nothing_built):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load("rewards=[{name: shapes, kwargs: {mdoe: strict}}]")
    assert time.perf_counter() - start < 1.0
    assert str(e.value) == (
        "rewards[0].kwargs.mdoe='strict' is not a key of reward 'shapes' (ShapesReward) (did "
        "you mean 'mode'?); accepted: ['mode', 'frame_stride']"
    )
    with pytest.raises(
        ConfigError,
        match=r"eval.rewards\[1\].kwargs.thread=2 is not a key of reward 'ocr' "
        r"\(OcrReward\) \(did you mean 'threads'\?\); accepted: \['engine', "
        r"'threads', 'min_confidence', 'frame_stride'\]",
    ):
        load("eval.rewards=[{name: shapes}, {name: ocr, kwargs: {thread: 2}}]")


def test_the_combiners_frame_stride_and_the_rewards_own_settings_pass(nothing_built):
    cfg = load(
        "rewards=[{name: shapes, kwargs: {mode: precise, frame_stride: 2}}]",
        "eval.rewards=[{name: ocr, kwargs: {engine: paddleocr, min_confidence: 0.2}}]",
    )
    assert cfg.rewards[0].kwargs == {"mode": "precise", "frame_stride": 2}


def test_a_required_setting_left_out_is_refused_at_load():
    with pytest.raises(
        ConfigError,
        match=r"rewards\[0\].kwargs.url must be set: reward 'remote' \(RemoteReward\) has "
        r"no default for it; its settings: \['url', 'timeout'",
    ):
        load("rewards=[{name: remote}]")


def test_an_unknown_reward_name_is_refused_at_load_naming_its_key():
    with pytest.raises(ConfigError, match=r"rewards\[0\].name='shapez' is not registered \(did you mean 'shapes'\?\)"):
        load("rewards=[{name: shapez}]")


PLUGIN = """
import dataclasses

from flowrl_rewards import Reward

BUILT = []


class Tinted(Reward):
    def __init__(self, channel: int = 0, factor: float = 1.0):
        BUILT.append(self)
        self.channel, self.factor = channel, factor

    def score(self, images, prompts, meta):
        return images[:, self.channel].mean(dim=(1, 2)) * self.factor


class Open(Reward):
    def __init__(self, size: int = 1, **options):
        BUILT.append(self)

    def score(self, images, prompts, meta):
        return images.mean(dim=(1, 2, 3))


@dataclasses.dataclass
class DeclaredSettings:
    threshold: float = 0.5
    labels: list = dataclasses.field(default_factory=list)


class Declared(Reward):
    Settings = DeclaredSettings

    def __init__(self, **settings):
        BUILT.append(self)
        self.settings = DeclaredSettings(**settings)

    def score(self, images, prompts, meta):
        return images.mean(dim=(1, 2, 3))
"""


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "tinted_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return path


def test_a_plugin_rewards_settings_are_checked_at_load_with_its_class_imported_not_built(plugin, nothing_built):
    from flowrl.core.plugins import import_file

    with pytest.raises(
        ConfigError,
        match=rf"rewards\[0\].kwargs.colour=1 is not a key of reward "
        rf"'{plugin}:Tinted' \(Tinted\); accepted: \['channel', 'factor', "
        rf"'frame_stride'\]",
    ):
        load(f"rewards=[{{name: '{plugin}:Tinted', kwargs: {{colour: 1}}}}]")
    load(f"rewards=[{{name: '{plugin}:Tinted', kwargs: {{channel: 2}}}}]")
    load(f"rewards=[{{name: '{plugin}:Open', kwargs: {{anything: 1}}}}]")  # **options: any key
    with pytest.raises(
        ConfigError,
        match=r"rewards\[0\].kwargs.threshhold=0.1 is not a key of reward .*Declared"
        r"\) \(did you mean 'threshold'\?\); accepted: \['threshold', 'labels', "
        r"'frame_stride'\]",
    ):
        load(f"rewards=[{{name: '{plugin}:Declared', kwargs: {{threshhold: 0.1}}}}]")
    assert import_file(str(plugin), "reward plugin file").BUILT == []  # imported, never built


def test_the_settings_are_derived_once_per_class_with_defaults_and_annotations():
    cls = REGISTRY.resolve("ocr")
    settings = settings_of(cls)
    assert settings_of(cls) is settings
    engine = next(s for s in settings.own if s.name == "engine")
    assert (engine.default, engine.annotation, engine.required) == ("rapidocr", "str", False)


def test_build_reward_refuses_with_the_same_message():
    from flowrl_rewards import build_reward

    with pytest.raises(
        ConfigError,
        match=r"^mdoe='x' is not a key of reward 'shapes' \(ShapesReward\) \(did you "
        r"mean 'mode'\?\); accepted: \['mode'\]$",
    ):
        build_reward("shapes", mdoe="x")


# ---- model.kwargs -------------------------------------------------------------------------------------------------
def test_a_misspelt_model_kwarg_is_refused_at_load_from_the_adapters_signature(nothing_built):
    with pytest.raises(
        ConfigError,
        match=r"^model.kwargs.negative_promt='blurry' is not a key of the "
        r"model.family='shapes' adapter \(did you mean 'negative_prompt'\?\); "
        r"accepted: \['negative_prompt'\]",
    ):
        load("model.kwargs={negative_promt: blurry}")
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs.complex_human_instructions=.* model.family='sana' adapter "
        r"\(did you mean 'complex_human_instruction'\?\); accepted: "
        r"\['pipeline_kwargs', 'complex_human_instruction', 'negative_prompt'\]",
    ):
        load("model.family=sana", "model.path=some/folder", "model.kwargs={complex_human_instructions: [a]}")
    with pytest.raises(ConfigError, match="model.kwargs.height has its own key: set model.height instead"):
        load("model.kwargs={height: 64}")
    cfg = load("model.family=sana", "model.path=some/folder", "model.kwargs={complex_human_instruction: [a]}")
    assert cfg.model.kwargs == {"complex_human_instruction": ["a"]}


def test_build_model_checks_model_kwargs_before_any_weight_loads(nothing_built):
    with pytest.raises(ConfigError, match="model.kwargs.negative_promt='x' is not a key of the model.family"):
        build_model(ModelSection(kwargs={"negative_promt": "x"}), device=None)


def test_adapter_keywords_read_the_loader_and_the_adapters_options():
    shapes = adapter_keywords("shapes")  # the loader passes the rest to SD3FlowModel(**options: AdapterOptions)
    assert {"device", "guidance", "negative_prompt", "height", "gradient_checkpointing"} <= set(shapes)
    assert "pipeline_kwargs" not in shapes  # the shapes loader takes none
    assert {"pipeline_kwargs", "num_frames"} <= set(adapter_keywords("wan"))
    assert "text_encoder_out_layers" in adapter_keywords("flux2")


# ---- wrapped plans ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.plan=explore", "rollout.pol=8"],
            "rollout.pol is not a key of the config (did you mean 'rollout.pool'?)",
        ),
        (
            ["rollout.plan=probed", "rollout.prob=x0_projection"],
            "rollout.prob is not a key of the config (did you mean 'rollout.probe'?)",
        ),
        (
            ["rollout.plan=explore", "rollout.min_params=8"],
            (
                "rollout.min_params is set but nothing reads it: it chooses the layers a low-precision backend "
                "converts, and "
                "rollout.backend: same converts none"
            ),
        ),
        (
            ["rollout.plan=probed", "rollout.inner={plan: chains, stpes: 5}"],
            (
                "rollout.inner.stpes is not a key of rollout.plan='chains' (did you mean 'steps'?); accepted: "
                "['group_size', 'steps'"
            ),
        ),
        (
            ["rollout.plan=explore", "rollout.inner={plan: chains, post_steps_ratio: 0.5}"],
            "rollout.inner.post_steps_ratio is set but nothing reads it",
        ),
        (
            ["rollout.plan=probed", "rollout.inner={plan: chains, post_steps_ratio: 0.5}"],
            "rollout.inner.post_steps_ratio is set but nothing reads it",
        ),
    ],
)
def test_a_wrapped_plans_own_keys_and_its_inner_plans_are_checked_at_load(overrides, message, nothing_built):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert message in str(e.value)


def test_probed_refuses_a_normalised_reward_at_load(nothing_built):
    message = r"reward_normalize='batch' with a probed plan .*accepted: reward_normalize: none"
    with pytest.raises(ConfigError, match=message):
        load("rollout.plan=probed", "reward_normalize=batch")
    with pytest.raises(ConfigError, match=message):  # a probed plan inside an explore plan too
        load("rollout.plan=explore", "rollout.inner={plan: probed, inner: {plan: chains}}", "reward_normalize=batch")
    load("rollout.plan=probed", "reward_normalize=none")
    load("rollout.plan=explore", "reward_normalize=batch")  # the explorer takes any combination


# ---- help ---------------------------------------------------------------------------------------------------------
def test_train_help_lists_the_running_configs_reward_settings_with_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "rewards=[{name: ocr, kwargs: {threads: 2}}]", "--help"])
    out = capsys.readouterr().out
    settings = out[out.index("reward settings (the keys of rewards[i].kwargs") :]
    assert "rewards[0] ocr (flowrl_rewards.text.ocr.OcrReward):" in settings
    assert (
        "    min_confidence: 0.5  # float; boxes recognised with a lower confidence are dropped" in settings
    )  # its help
    assert "    threads: 1  # int; CPU threads of the engine" in settings
    assert "; set in this config\n" in settings[settings.index("    threads: 1") :].splitlines(keepends=True)[0]
    assert "    frame_stride: 1  # int; the combiner's" in settings
    assert "weight (1.0: its weight in the sum)" in settings
