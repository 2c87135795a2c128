"""Secrets never stored (issue 54): a reward setting holding a key is redacted in config.yaml, every checkpoint, the
trackers' hparams and --help; a run's saved config used again asks for it instead of sending the placeholder; run
names given on the command line are strings as written."""

from __future__ import annotations

import pytest

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.config.secrets import REDACTED, redact_kwargs
from tests.conftest import make_model
from tests.test_trainer import tiny_config

KEY = "sk-test-0123456789abcdef"
PLUGIN = '''
import torch
from flowrl_rewards import Reward


class Keyed(Reward):
    """Brightness, behind a key it never sends anywhere."""
    name = "keyed"

    def __init__(self, api_key: str = "", headers: dict | None = None):
        self.api_key, self.headers = api_key, headers or {}

    def score(self, images, prompts, meta):
        return images.float().mean(dim=(1, 2, 3))
'''


def keyed_config(tmp_path, name: str, *extra: str) -> TrainConfig:
    plugin = tmp_path / "keyed.py"
    plugin.write_text(PLUGIN)
    term = (
        f"[{{name: '{plugin}:Keyed', kwargs: {{api_key: {KEY}, headers: {{Authorization: 'Bearer {KEY}', "
        "X-Team: vision}}}]"
    )
    cfg = tiny_config(tmp_path, name, "train.max_steps=1", "prompts.eval=null", *extra)
    return TrainConfig.from_yaml(None, [f"{k}={v}" for k, v in _flat_overrides(cfg).items()] + [f"rewards={term}"])


def _flat_overrides(cfg: TrainConfig) -> dict:
    """The tiny config's own overrides, re-applied (rewards replaced by the keyed plugin)."""
    return {
        "model.family": "sd3",
        "model.lora.rank": 4,
        "rollout.group_size": 4,
        "rollout.steps": 4,
        "rollout.max_batch": 8,
        "prompts.train": cfg.prompts.train,
        "prompts.per_step": 2,
        "prompts.eval": "null",
        "train.max_steps": 1,
        "train.output_dir": cfg.train.output_dir,
        "train.name": cfg.train.name,
        "train.progress": "false",
        "train.checkpoint_every": 1,
    }


def test_a_run_stores_no_secret_and_its_saved_config_asks_for_it_again(tmp_path):
    from flowrl.run.model import run_config
    from flowrl.training.trainer import Trainer

    cfg = keyed_config(tmp_path, "keyed")
    trainer = Trainer(cfg, model=make_model("sd3"))
    assert trainer.reward.terms[0].api_key == KEY  # the run itself holds the key it was given
    trainer.train()
    run = tmp_path / "keyed"
    written = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "trainer_state.pt" for p in written) and (run / "config.yaml").is_file()
    for path in written:
        assert KEY.encode() not in path.read_bytes(), path
    text = (run / "config.yaml").read_text()
    assert f"api_key: {REDACTED}" in text and "X-Team: <redacted>" in text
    assert KEY not in str(cfg.to_flat_dict())  # the trackers' hparams
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.kwargs\.api_key is <redacted>.*give it again"):
        run_config(str(run), None, [])


def test_headers_keep_their_names_and_only_secret_named_settings_are_hidden():
    out = redact_kwargs(
        {
            "api_key": KEY,
            "api_key_env": "JUDGE_KEY",
            "url": "http://judge:8000",
            "timeout": 3,
            "headers": {"Authorization": f"Bearer {KEY}"},
            "token": None,
        }
    )
    assert out == {
        "api_key": REDACTED,
        "api_key_env": "JUDGE_KEY",
        "url": "http://judge:8000",
        "timeout": 3,
        "headers": {"Authorization": REDACTED},
        "token": None,
    }


@pytest.mark.parametrize("name", ["off", "no", "0x10", "1e3", "'007'"])
def test_a_run_name_is_the_string_written(name):
    cfg = TrainConfig.from_yaml(None, [f"train.name={name}"])
    assert cfg.train.name == name.strip("'")
