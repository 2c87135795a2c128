"""The prompt-embedding cache is bounded (``model.prompt_cache_mb``), least recently used first, and a bound
changes no number a run produces."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.models.prompt_cache import PromptCache, entry_bytes
from tests.conftest import make_model


def _entry(n: int) -> dict:
    return {"prompt_embeds": torch.zeros(1, n)}  # 4n bytes


def test_least_recently_used_entries_leave_first_and_only_after_the_batch():
    cache = PromptCache(max_bytes=2 * 40)
    for key in ("a", "b"):
        cache.get(key, lambda: _entry(10))
    cache.get("a", lambda: pytest.fail("a is cached"))  # a is now the most recent
    cache.get("c", lambda: _entry(10))
    assert len(cache) == 3 and cache.bytes == 120  # over budget until the batch is assembled
    assert cache.trim() == 1
    assert "b" not in cache and "a" in cache and "c" in cache and cache.bytes == 80
    assert (cache.hits, cache.misses) == (1, 3)
    unbounded = PromptCache()
    for i in range(100):
        unbounded.get(i, lambda: _entry(10))
    assert unbounded.trim() == 0 and len(unbounded) == 100


def test_a_bounded_adapter_returns_the_same_embeddings_and_stays_in_budget():
    model = make_model("sd3", guidance=4.5)
    prompts = [f"cat {i}" for i in range(6)]
    reference = {p: model.encode([p]).cond for p in prompts}
    per_prompt = entry_bytes(model.prompt_cache.get(prompts[0], lambda: pytest.fail("cached")))
    model.clear_cache()
    model.prompt_cache.max_bytes = 3 * per_prompt
    misses = model.prompt_cache.misses
    for start in range(0, 6, 2):
        batch = prompts[start : start + 2] * 2
        cond = model.encode(batch).cond
        for i, p in enumerate(batch):
            for k, v in reference[p].items():
                assert torch.equal(cond[k][i : i + 1], v), (p, k)
        assert model.prompt_cache.bytes <= 3 * per_prompt
    assert model.prompt_cache.misses - misses == 6 + 1  # every prompt once, and the negative prompt (CFG)
    model.encode(prompts[:1])  # evicted long ago: encoded again
    assert model.prompt_cache.misses - misses == 8


def test_the_config_key_sets_the_budget_and_is_checked():
    from flowrl.config.build import build_model

    cfg = TrainConfig.from_yaml(None, ["model.prompt_cache_mb=2"])
    assert build_model(cfg.model).prompt_cache.max_bytes == 2 * 2**20
    assert build_model(TrainConfig.from_yaml(None, ["model.prompt_cache_mb=null"]).model).prompt_cache.max_bytes is None
    with pytest.raises(ConfigError, match=r"model.prompt_cache_mb=0.* must be > 0"):
        TrainConfig.from_yaml(None, ["model.prompt_cache_mb=0"])


def test_a_tiny_budget_changes_no_metric(tmp_path):
    """Two iterations on the shapes model with room for one prompt's embeddings against the default budget:
    every non-timing metric is identical (a prompt encoded again gives the same embeddings)."""
    from flowrl.training.trainer import Trainer

    def run(name: str, *extra: str) -> list[dict]:
        cfg = TrainConfig.from_yaml(
            None,
            [
                "prompts.per_step=2",
                "rollout.group_size=2",
                "rollout.steps=4",
                "train.max_steps=2",
                "eval.every=0",
                "prompts.eval=null",
                "train.progress=false",
                "train.checkpoint_every=0",
                "train.async_reward=false",
                f"train.output_dir={tmp_path}",
                f"train.name={name}",
                *extra,
            ],
        )
        Trainer(cfg).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")} for r in rows]

    assert run("bounded", "model.prompt_cache_mb=0.0001") == run("default")
