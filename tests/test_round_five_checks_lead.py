"""Issue 63 part B (round five): the cases whose fix is in a file the lead owns, each calling this helper's code.
They pass once the lead's diffs are in (the report of issue 63 part B): flowrl/config/schema.py merges a config
through :func:`flowrl.config.keys.merge_layers` (a key indexing into a list of components, a section or a list given
one value), flowrl/run/outputs.py names ``--out /`` as the root, and flowrl/prompts/checks.py refuses at load a prompt
with more images than ``model.kwargs.max_images``."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from flowrl.commands.main import main
from flowrl.config.schema import TrainConfig
from flowrl.errors import ConfigError

KEY = "sk-live-0123456789abcdef"
TWO_REWARDS = "rewards:\n  - {name: shapes}\n  - {name: remote, kwargs: {url: 'http://127.0.0.1:9'}}\n"


# ---- a key indexing into a list of components --------------------------------------------------------------------
def test_a_reward_setting_is_set_on_the_command_line_by_its_index(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text(TWO_REWARDS)
    cfg = TrainConfig.from_yaml(config, ["rewards.1.kwargs.api_key_env=JUDGE_KEY", "rewards[1].weight=2"])
    assert cfg.rewards[1].kwargs == {"url": "http://127.0.0.1:9", "api_key_env": "JUDGE_KEY"}
    assert (cfg.rewards[1].weight, cfg.rewards[0].name) == (2.0, "shapes")
    cfg = TrainConfig.from_yaml(None, ["rewards=[{name: shapes}, {name: shapes, label: b}]", "rewards.1.weight=3"])
    assert [t.weight for t in cfg.rewards] == [1.0, 3.0]  # the list as the earlier override left it


@pytest.mark.parametrize(
    "override, said",
    [
        (f"rewards.5.kwargs.api_key={KEY}", "rewards is a list of 2 items here, and '5' is not the index of one"),
        (f"rewards.kwargs.api_key={KEY}", "e.g. rewards.0.kwargs.api_key=…), or give the whole list: rewards=[…]"),
        (f"eval.rewards.0.kwargs.api_key={KEY}", "eval.rewards is null here, so it has no item 0; give the whole list"),
    ],
)
def test_an_index_the_list_does_not_have_names_the_key_and_the_whole_list(tmp_path, override, said):
    config = tmp_path / "two.yaml"
    config.write_text(TWO_REWARDS)
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(config, [override])
    assert said in str(e.value) and KEY not in str(e.value)  # the value may be a secret: never shown


def test_a_misspelt_secret_given_by_its_index_is_refused_without_its_value(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text(TWO_REWARDS)
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.kwargs\.api_kye=<not shown") as e:
        TrainConfig.from_yaml(config, [f"rewards.1.kwargs.api_kye={KEY}"])
    assert KEY not in str(e.value)


# ---- a section or a list given one value -------------------------------------------------------------------------
def test_a_section_given_a_value_names_its_keys(tmp_path):
    said = "'model.context_parallel' is a section of keys, not a value (got 4); set one of its keys, e.g. "
    with pytest.raises(ConfigError, match=re.escape(said + "model.context_parallel.ulysses=…")):
        TrainConfig.from_yaml(None, ["model.context_parallel=4"])
    config = tmp_path / "cp.yaml"
    config.write_text("model:\n  context_parallel: 4\n")
    with pytest.raises(ConfigError, match=f"'model.context_parallel' in {config} is a section of keys"):
        TrainConfig.from_yaml(config, [])
    assert TrainConfig.from_yaml(None, ["model.context_parallel={ulysses: 2}"]).model.context_parallel.ulysses == 2


def test_a_list_key_given_one_value_shows_the_list_form(tmp_path):
    said = r"'train.fit_keep' is a list, got one value \('rollout.max_batch'\); write it as a list: "
    with pytest.raises(ConfigError, match=said + r"train\.fit_keep=\[rollout\.max_batch\]"):
        TrainConfig.from_yaml(None, ["train.fit=auto", "train.fit_keep=rollout.max_batch"])
    config = tmp_path / "fit.yaml"
    config.write_text("train:\n  fit: auto\n  fit_keep: rollout.max_batch\n")
    with pytest.raises(ConfigError, match=f"'train.fit_keep' in {config} is a list"):
        TrainConfig.from_yaml(config, [])
    with pytest.raises(ConfigError, match=r"write it as a list: rewards=\[\{name: shapes\}\]"):
        TrainConfig.from_yaml(None, ["rewards=shapes"])


# ---- --out / ----------------------------------------------------------------------------------------------------
def test_out_naming_the_root_says_the_root_not_the_working_directory(tmp_path, capsys, monkeypatch):
    from flowrl.run.outputs import check_output

    monkeypatch.chdir(tmp_path)
    for command in ("flowrl sample", "flowrl eval", "flowrl export", "flowrl compare", "flowrl rollouts"):
        with pytest.raises(ConfigError, match=f"--out='/' names the file system's root '/', which {command} did not"):
            check_output("/", command)
    with pytest.raises(ConfigError, match="names the working directory"):
        check_output(".", "flowrl sample")
    assert main(["sample", "--prompt", "a red circle", "--out", "/"]) == 2
    assert "--out='/' names the file system's root '/'" in capsys.readouterr().err


# ---- a run refuses more images than max_images at load -----------------------------------------------------------
def test_a_run_refuses_more_images_than_max_images_before_its_model_loads(tmp_path):
    from flowrl.config.build import build_rewards
    from flowrl.prompts.checks import check_run_prompts

    for i in range(3):
        Image.new("RGB", (32, 32), (80 * i, 0, 0)).save(tmp_path / f"{i}.png")
    tags = " ".join(f"[image: {tmp_path / f'{i}.png'}]" for i in range(3))
    prompts = tmp_path / "edits.txt"
    prompts.write_text(f"{tags} join them\n")
    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=qwen_image_edit_plus",
            "model.kwargs={max_images: 2}",
            f"prompts.train={prompts}",
            "prompts.eval=null",
            "rewards=[{name: brightness}]",
        ],
    )
    reward = build_rewards(cfg.rewards)
    with pytest.raises(ConfigError, match="carries 3 images, more than model.kwargs.max_images=2"):
        check_run_prompts(cfg, reward, reward)
    cfg.model.kwargs = {"max_images": 3}
    check_run_prompts(cfg, reward, reward)
