"""Help on every key (issue 62, item 6): it lives on the schema's fields (``metadata={"help": ...}``), for the
component sections on the components' fields, comments and docstrings (flowrl/config/help.py), and for each reward's
settings (the keys of ``rewards[i].kwargs``, gdro_corrected's nested terms included) on the reward's constructor
(flowrl/config/reward_help.py); ``flowrl train --help`` prints it beside each key's value and lists every reward's
settings, and docs/keys.md is generated from it and never drifts."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flowrl.config import help as key_help
from flowrl.config import key_table, reward_help, schema
from flowrl.config.help import NO_HELP, annotated_yaml, field_help
from flowrl.config.key_table import base_rows, keys_markdown
from flowrl.config.reward_help import CATALOGUE
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.core.choices import choice
from flowrl.errors import ConfigError
from flowrl.paths import CONFIG_DIR
from flowrl.rollout.chains import Chains

ROOT = Path(__file__).resolve().parents[1]
KEYS_MD = ROOT / "docs" / "keys.md"
PRESETS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if "accelerate" not in p.parts)
SCHEMA_SECTIONS = ("model", "rewards", "reward_normalize", "optim", "prompts", "eval", "train")


# ---- docs/keys.md -------------------------------------------------------------------------------------------------
def test_docs_keys_md_is_what_the_generator_writes(tmp_path):
    assert KEYS_MD.read_text() == keys_markdown(), (
        "docs/keys.md differs from the keys' help: regenerate it with "
        "`python -m flowrl.config.key_table --write docs/keys.md`"
    )
    key_table.main(["--write", str(tmp_path / "keys.md")])
    assert (tmp_path / "keys.md").read_text() == KEYS_MD.read_text()


def test_docs_keys_md_lists_every_key_of_every_component():
    text = keys_markdown()
    for row in base_rows():
        top = "." not in row.key and "[" not in row.key
        assert (f"\n## {row.key}\n" if top else f"| `{row.key}` |") in text, row.key
    for section, heading, key in [
        ("rollout", "### `rollout.plan: tree` (flowrl.rollout.tree.Tree)", "`rollout.split_steps`"),
        ("credit", "### `credit.rule: turning_point`", "`credit.tie_eps`"),
        ("loss", "### `loss.objective: gdro` (flowrl.objectives.gdro.GDROLoss)", "`loss.tau`"),
    ]:
        assert heading in text and key in text.split(heading)[1].split("###")[0], (section, heading, key)
    assert "| `train.max_staleness` | `1` | async: forest k is sampled" in text
    assert "| `rewards[i].name` | (required) |" in text


def test_docs_keys_md_lists_every_rewards_settings_gdro_correcteds_nested_terms_too():
    text = keys_markdown()
    rewards = text.split("\n## rewards[i].kwargs by reward name\n")[1].split("\n## ")[0]

    def table(heading: str) -> str:
        return rewards.split(heading)[1].split("###")[0]

    shapes = table("### `rewards[i].name: shapes` (flowrl_rewards.compositional.shapes.ShapesReward)")
    assert "| `rewards[i].kwargs.mode` | `strict` | strict (all of the prompt's requirements met" in shapes
    gdro = table("### `rewards[i].name: gdro_corrected` (flowrl_rewards.heuristics.gdro_corrected.CorrectedScore)")
    for row in (
        "| `rewards[i].kwargs.reward` | (required) | the evaluation reward r (a term) |",
        "| `rewards[i].kwargs.reward.name` | (required) | registry name,",
        "| `rewards[i].kwargs.reward.kwargs` | `{}` | the settings of the reward it names",
        "| `rewards[i].kwargs.quality[j].name` | (required) |",
        "| `rewards[i].kwargs.quality[j].kwargs` | `{}` |",
        "| `rewards[i].kwargs.quality_range` | `[0.0, 1.0]` | [lo, hi]: the range the quality terms score in",
        "| `rewards[i].kwargs.center` | `3.0` | the c of",
    ):
        assert row in gdro, row
    assert "| `rewards[i].kwargs.frame_stride` | `1` | the combiner's" in table("### Every reward")
    assert "| `rewards[i].kwargs.url` | (required) | endpoint" in table("### `rewards[i].name: remote`")
    assert "`brightness`" in table("### Rewards without settings of their own")
    for name in reward_help.reward_names(builtin=True):  # each built-in reward: a table, or named as having none
        assert f"### `rewards[i].name: {name}` (" in rewards or f"`{name}`" in table("### Rewards without"), name


# ---- the schema's keys all carry help ------------------------------------------------------------------------------
def _schema_fields(cls: type, prefix: str):
    """(dotted key, field) of every field of the schema's own section ``cls``, and of the sections below it."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        yield key, f
        hints = key_help._hints(cls)
        below, is_list = key_help.below_of(hints.get(f.name))
        if below is not None and not isinstance(below, key_help.Component):
            yield from _schema_fields(below, f"{key}[i]" if is_list else key)


def test_every_key_of_the_base_schema_has_help():
    sections = {
        "model": schema.ModelSection,
        "rewards[i]": schema.RewardTerm,
        "optim": schema.OptimSection,
        "prompts": schema.PromptsSection,
        "eval": schema.EvalSection,
        "train": schema.TrainSection,
    }
    missing = [
        key for name, cls in sections.items() for key, f in _schema_fields(cls, name) if not f.metadata.get("help")
    ]
    assert not missing, f"schema fields without metadata={{'help': ...}}: {missing}"
    top = [f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("help")]
    assert not top, f"TrainConfig fields without help: {top}"
    rows = [r for r in base_rows() if r.key.split(".")[0].split("[")[0] in SCHEMA_SECTIONS]
    assert len(rows) > 80
    assert not [r.key for r in rows if not r.help.strip() or r.help == NO_HELP]
    loop = [r for r in base_rows() if r.key in ("rollout.plan", "rollout.max_batch", "rollout.chunks", "credit.rule")]
    assert len(loop) == 4 and all(r.help and r.help != NO_HELP for r in loop)


def test_the_pipeline_and_hub_keys_say_what_they_do():
    rows = {r.key: r for r in base_rows()}
    assert rows["train.pipeline"].default == "sync" and "async" in rows["train.pipeline"].help
    assert "docs/pipeline.md" in rows["train.pipeline"].help
    assert "max(0, k - max_staleness)" in rows["train.max_staleness"].help
    assert "rollout process" in rows["train.rollout_processes"].help
    assert "half of train.num_threads" in rows["train.rollout_threads"].help
    assert "docs/sharing.md" in rows["train.push_to_hub"].help and rows["train.push_to_hub"].default is None


def test_every_key_of_every_builtin_component_has_help():
    """No key of a built-in rollout plan, credit rule or objective (the keys below it included: ``rollout.window.*``,
    ``loss.teacher.*``) prints NO_HELP, and docs/keys.md has no such row."""
    from flowrl.core import components

    missing, seen = [], 0
    for kind in components.KINDS:
        names = key_table.builtin_names(kind)
        assert names, kind.section
        for name in names:
            cls = components.resolve(kind, name)
            for row in key_table.key_rows(key_help.Component(kind, name, cls), kind.section):
                seen += 1
                if not row.help.strip() or row.help == NO_HELP:
                    missing.append(f"{kind.key}: {name}: {row.key}")
    assert seen > 150
    assert not missing, (
        f"component keys without help (a comment beside the field, or metadata={{'help': ...}}): {missing}"
    )
    assert NO_HELP not in keys_markdown()


def test_every_setting_of_every_builtin_reward_has_help():
    """No setting of a built-in reward (nor a key of a term it nests, nor the combiner's) prints NO_HELP: a comment
    beside the keyword in the constructor, or its entry in the class docstring's ``kwargs:``."""
    missing, seen = [], 0
    for name in reward_help.reward_names(builtin=True):
        cls = reward_help.reward_class(name)
        assert cls is not None, name
        for row in reward_help.reward_keys(cls):
            seen += 1
            if not row.help.strip() or row.help == NO_HELP:
                missing.append(f"{name}: {row.key}")
    assert seen > 100
    assert not missing, f"reward settings without help (a comment beside the keyword in the constructor): {missing}"
    assert all(k.help != NO_HELP for k in reward_help.combiner_keys())


def test_the_component_keys_help_says_what_they_do():
    from flowrl.objectives.dgpo import DGPOLoss
    from flowrl.rollout.tree import Tree

    assert "guided_rollouts" in field_help(DGPOLoss, "cfg")  # the group objectives' third CFG mode
    assert "progressive" in field_help(Tree, "window")  # a tree's window default differs from the chains'
    assert field_help(Tree, "split_scale") != "s" and "1/(1 + s²)" in field_help(Tree, "split_scale")
    assert "0 = off" in field_help(Tree, "depth_prune_size") and len(field_help(Tree, "depth_prune_size")) > 20


# ---- where a component field's help comes from ---------------------------------------------------------------------
def test_a_component_fields_help_from_metadata_comment_docstring_or_none():
    @dataclass
    class Base:
        """A base. ``inherited``: from the base's docstring [3]."""

        inherited: int = 3

    @dataclass
    class Thing(Base):
        """A thing (``from_doc``: said in the docstring; ``other``: its own). ``mode``: ``fast`` or ``slow``.

        Modes: ``fast``: quick; ``slow``: careful. Replay ``mentioned`` (a remark): not its entry."""

        from_meta: int = field(default=1, metadata={"help": "said in the metadata"})
        from_comment: float = 0.5  # said beside the field,
        # and on the line below

        # a comment of its own
        from_doc: str = "x"
        mode: str = choice("fast", ("fast", "slow"))
        mentioned: int = 0
        bare: int = 2
        inherited: int = 4

    assert field_help(Thing, "from_meta") == "said in the metadata"
    assert field_help(Thing, "from_comment") == "said beside the field, and on the line below"
    assert field_help(Thing, "from_doc") == "said in the docstring"
    assert field_help(Thing, "mode") == "`fast` or `slow`"  # the choices' own entries are not keys
    assert field_help(Thing, "mentioned") == NO_HELP  # named inside a sentence: no entry
    assert field_help(Thing, "bare") == NO_HELP
    assert field_help(Thing, "inherited") == "from the base's docstring"  # its default differs here: [3] dropped
    assert field_help(Base, "inherited") == "from the base's docstring [3]"


def test_a_reward_settings_help_from_its_note_comment_kwargs_section_docstring_or_none():
    from flowrl_rewards.core.base import Reward
    from flowrl_rewards.core.registry import RewardSetting, settings_of

    class Base(Reward):
        """A base.

        kwargs:
          inherited: documented by the base (default 1).
        """

        def __init__(self, inherited: int = 1):
            pass

    class Thing(Base):
        """A thing. ``from_entry``: said in an entry.

        kwargs:
          from_section: said in the kwargs section,
            going on below.
          a / b: said of both.
        """

        def __init__(
            self,
            from_comment: float = 0.5,  # said beside the keyword,
            # and on the line below
            from_section: str = "x",
            a: int = 0,
            b: int = 0,
            from_entry: int = 0,
            inherited: int = 1,
            bare: int = 2,
        ):
            pass

    settings = {s.name: s for s in settings_of(Thing).own}
    helps = {name: reward_help.setting_help(Thing, s) for name, s in settings.items()}
    assert helps == {
        "from_comment": "said beside the keyword, and on the line below",
        "from_section": "said in the kwargs section, going on below",
        "a": "said of both",
        "b": "said of both",
        "from_entry": "said in an entry",
        "inherited": "documented by the base (default 1)",
        "bare": NO_HELP,
    }
    noted = RewardSetting("from_comment", 0.5, "float", "a Settings field's metadata help")
    assert reward_help.setting_help(Thing, noted) == "a Settings field's metadata help"  # the note wins


def test_a_rewards_declared_nested_terms_are_checked_at_load_and_listed_by_the_help():
    """``nested_terms`` is the one declaration: the key check refuses a misspelt setting inside a nested term with the
    key that reaches it, and the help lists the term's keys; gdro_corrected's ``reward`` and ``quality`` alike."""
    from flowrl_rewards import Reward
    from flowrl_rewards.core.registry import REGISTRY, check_reward_kwargs

    class Wrapping(Reward):
        nested_terms = {"inner": False}

        def __init__(
            self,
            inner=None,  # the reward it wraps
        ):
            self.inner = inner

    REGISTRY.register("flowrl_test_wrapping", Wrapping)
    try:
        _nested_key_checks_and_help(Wrapping, check_reward_kwargs)
    finally:
        REGISTRY.pop("flowrl_test_wrapping")


def _nested_key_checks_and_help(Wrapping, check_reward_kwargs):
    from flowrl_rewards.heuristics.gdro_corrected import CorrectedScore

    with pytest.raises(ConfigError, match=r"rewards\[0\]\.kwargs\.inner\.kwargs\.scroe"):
        check_reward_kwargs(
            "flowrl_test_wrapping", {"inner": {"name": "brightness", "kwargs": {"scroe": 1}}}, "rewards[0].kwargs"
        )
    with pytest.raises(ConfigError, match=r"eval\.rewards\[0\]\.kwargs\.reward=None must be a reward name"):
        check_reward_kwargs("gdro_corrected", {"reward": None, "quality": "brightness"}, "eval.rewards[0].kwargs")
    with pytest.raises(ConfigError, match=r"quality\[1\]\.kwargs\.scroe"):
        check_reward_kwargs(
            "gdro_corrected",
            {"reward": "brightness", "quality": ["brightness", {"name": "brightness", "kwargs": {"scroe": 1}}]},
            "eval.rewards[0].kwargs",
        )
    assert [k.key for k in reward_help.reward_keys(Wrapping)] == ["inner", "inner.name", "inner.kwargs"]
    keys = [k.key for k in reward_help.reward_keys(CorrectedScore)]
    assert keys[:6] == ["reward", "reward.name", "reward.kwargs", "quality", "quality[j].name", "quality[j].kwargs"]


def test_shipped_components_take_their_comments_and_docstrings():
    from flowrl.objectives.policy import PolicyLoss
    from flowrl.rollout.tree import Tree

    assert field_help(Tree, "branch") == "K children per node at a split"
    assert field_help(PolicyLoss, "clip_high") == field_help(PolicyLoss, "clip_low") != NO_HELP


# ---- flowrl train --help -------------------------------------------------------------------------------------------
def _help(*args: str) -> str:
    from flowrl.commands.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["train", *args, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def _bare(text: str) -> str:
    """An annotated YAML without its help: the comment lines dropped, each ``  # help`` cut."""
    lines = [line for line in text.split("\n") if not line.lstrip().startswith("# ")]
    return "\n".join(re.sub(r"  # .*$", "", line) for line in lines)


def _kwargs_count(kwargs) -> int:
    """Keys of a reward term's ``kwargs``, with the keys of the terms nested in them (a mapping with ``name``, or a
    list of them: gdro_corrected's ``reward`` and ``quality``) and of those terms' kwargs."""
    count = 0
    for value in (kwargs or {}).values():
        count += 1
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "name" in item:
                count += len(item) + _kwargs_count(item.get("kwargs"))
    return count


def _key_count(value) -> int:
    """Keys of a loaded config below its top-level sections (a reward term's ``kwargs``: its keys too)."""
    if isinstance(value, list):
        return sum(_key_count(v) for v in value)
    if not dataclasses.is_dataclass(value):
        return 0
    own = sum(1 + _key_count(getattr(value, f.name)) for f in dataclasses.fields(value))
    return own + (_kwargs_count(value.kwargs) if isinstance(value, schema.RewardTerm) else 0)


def _check_annotated(cfg) -> str:
    text = annotated_yaml(cfg)
    assert _bare(text) == cfg.to_yaml()  # every value exactly as before
    assert yaml.safe_load(text) == yaml.safe_load(cfg.to_yaml())  # still YAML, the same
    keys, catalogue = text.split(CATALOGUE)
    helped = sum(1 for line in keys.split("\n") if line.lstrip().startswith("# ") or "  # " in line)
    sections = sum(1 for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name)))
    assert helped == _key_count(cfg) - sections  # one help per key, the top-level sections' lines bare
    assert all(line.startswith("# ") for line in (CATALOGUE + catalogue).rstrip("\n").split("\n"))
    return text


def test_train_help_prints_each_keys_value_and_help():
    out = _help("configs/shapes/grpo.yaml")
    assert "every config key, with its value in configs/shapes/grpo.yaml, each followed by its help" in out
    cfg = TrainConfig.from_yaml("configs/shapes/grpo.yaml")
    text = _check_annotated(cfg)
    assert text in out
    lines = out.split("\n")
    assert "loss:" in lines and "rollout:" in lines  # the sections' own lines as before
    assert "  max_staleness: 1  # async: forest k is sampled from the weights after update" in out
    assert "  push_to_hub: null  # a Hub repo id: when the run ends" in out
    assert f"  lr: {cfg.optim.lr}  # AdamW's learning rate" in out
    assert "  clip_low: " in out and "# ε_low, ε_high (symmetric when equal)" in out  # a component's docstring
    assert "  plan: chains  # the rollout plan: a registered name (chains | tree |" in out
    assert "- name: " in out and "  # registry name," in out  # the reward terms' keys, in the list


def test_train_help_lists_every_rewards_settings_with_their_help():
    out = _help()
    listed = out[out.index(CATALOGUE) :]
    assert "#   shapes (flowrl_rewards.compositional.shapes.ShapesReward):\n#     mode: strict  # strict (all" in listed
    assert "#     frame_stride" not in listed and "frame_stride: 1 (the combiner's:" in listed  # said once
    gdro = re.split(r"\n#   (?=\S)", listed[listed.index("#   gdro_corrected (") :])[0]
    for line in (
        "#     reward: (required)  # the evaluation reward r (a term)",
        '#     reward.name: (required)  # registry name, "package.module:Class"',
        "#     reward.kwargs: {}  # the settings of the reward it names",
        "#     quality: (required)  # one term or a list whose mean",
        "#     quality[j].name: (required)  # registry name",
        "#     quality[j].kwargs: {}  # the settings of the reward it names",
        "#     quality_range: [0.0, 1.0]  # [lo, hi]",
        "#     center: 3.0  # the c of",
        "#     offset: 0.2  # added to",
    ):
        assert line in gdro, line
    assert "#     url: (required)  # endpoint" in listed and NO_HELP not in listed


def test_train_help_helps_each_reward_setting_the_config_gives_nested_terms_too():
    nested = (
        "eval.rewards=[{name: gdro_corrected, kwargs: {reward: {name: shapes, kwargs: {mode: partial}}, "
        "quality: [{name: jpeg_compressibility, kwargs: {quality: 90}}], center: 2.5}}]"
    )
    overrides = ["rewards=[{name: ocr, kwargs: {threads: 2, frame_stride: 2}}]", nested]
    out = _help("configs/shapes/grpo.yaml", *overrides)
    cfg = TrainConfig.from_yaml("configs/shapes/grpo.yaml", overrides)
    assert _check_annotated(cfg) in out
    assert "    threads: 2  # CPU threads of the engine" in out
    assert "    frame_stride: 2  # the combiner's: on videos, score every k-th frame" in out
    for line in (
        "      reward:  # the evaluation reward r (a term)",
        '        name: shapes  # registry name, "package.module:Class"',
        "        kwargs:  # the settings of the reward it names",
        "          mode: partial  # strict (all of the prompt's requirements met",
        "      quality:  # one term or a list whose mean",
        "      - name: jpeg_compressibility  # registry name",
        "          quality: 90  # the JPEG encoder's quality, an integer in 1..100",
        "      center: 2.5  # the c of",
    ):
        assert line in out, line


def test_a_component_field_without_help_says_so(monkeypatch):
    monkeypatch.setattr(key_help, "field_help", lambda owner, name: NO_HELP)
    text = annotated_yaml(TrainConfig.from_yaml("configs/shapes/grpo.yaml"))
    assert "  group_size: " in text and f"  # {NO_HELP}" in text
    assert "  lr: 0.0003  # AdamW" not in text  # (every field here reads as undocumented)


def test_a_value_over_several_lines_has_its_help_above_it():
    prompts = "|".join(f"a long prompt number {i} with several words" for i in range(6))
    cfg = TrainConfig.from_yaml(None, [f"prompts.train={prompts}"])
    text = _check_annotated(cfg)
    at = text.split("\n").index("  # " + field_help(schema.PromptsSection, "train"))
    assert text.split("\n")[at + 1].startswith("  train: a long prompt number 0")


def test_the_help_keeps_secrets_redacted():
    cfg = TrainConfig()
    cfg.rewards[0].kwargs = {"api_key": "sk-very-secret", "headers": {"Authorization": "Bearer sk-very-secret"}}
    text = annotated_yaml(cfg)
    assert "sk-very-secret" not in text and "api_key: " in text


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_preset_prints_its_keys_with_help(path):
    try:
        cfg = TrainConfig.from_yaml(path)
    except ConfigError as err:  # a GPU precision preset on a machine without that GPU
        assert "cannot run on" in str(err), err
        cfg = TrainConfig.from_yaml(path, ["rollout.backend=same"])
    _check_annotated(cfg)


@dataclass
class _PluginPlan(Chains):
    """A plan from outside the package. ``wobble``: how much it wobbles."""

    wobble: float = 0.5
    lean: int = 1  # which way it leans


def test_an_out_of_tree_components_keys_have_their_help_and_leave_the_table_alone():
    from flowrl.core import components

    before = keys_markdown()
    components.register(components.PLAN, "test_key_help_plan", _PluginPlan)
    try:
        text = annotated_yaml(TrainConfig.from_yaml(None, ["rollout.plan=test_key_help_plan"]))
        assert "  wobble: 0.5  # how much it wobbles" in text and "  lean: 1  # which way it leans" in text
        assert "test_key_help_plan" in text  # rollout.plan's help names what is registered now
        assert keys_markdown() == before  # docs/keys.md lists the package's own components
    finally:
        del components.PLAN.registry["test_key_help_plan"]
        components.section_schema.cache_clear()


def test_an_out_of_tree_rewards_settings_have_their_help_and_leave_the_table_alone():
    from flowrl_rewards.core.base import Reward
    from flowrl_rewards.core.registry import REGISTRY

    class Leaning(Reward):
        def __init__(
            self,
            lean: int = 1,  # which way it leans
        ):
            pass

    before = keys_markdown()
    REGISTRY.register("test_key_help_reward", Leaning)
    try:
        cfg = TrainConfig.from_yaml(None, ["rewards=[{name: test_key_help_reward, kwargs: {lean: 2}}]"])
        text = _check_annotated(cfg)
        assert "    lean: 2  # which way it leans" in text
        assert "#   test_key_help_reward (" in text and "#     lean: 1  # which way it leans" in text
        assert keys_markdown() == before  # docs/keys.md lists the package's own rewards
    finally:
        REGISTRY.pop("test_key_help_reward")
