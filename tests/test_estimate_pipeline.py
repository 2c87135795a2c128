"""The estimate of train.pipeline=async (flowrl/estimate/pipeline.py): the longer side plus the weight sync, memory per
process, the layout's fit and the balanced number of launched rollout processes."""

from __future__ import annotations

import pytest
from test_estimate import estimate_of

from flowrl import estimate as E
from flowrl.errors import ConfigError
from flowrl.estimate.pipeline import LINK_GBPS, GiB, best_split

PRESET = "configs/sd35/flow_grpo_pickscore.yaml"


def test_best_split_balances_the_rollout_and_update_sides():
    # rollout 3 s and update 1 s per trainer at 4 processes: 3·4/n against 1·4/(4 − n) → 3 rolling out, 1 training
    assert best_split(3.0, 1.0, 4) == 3
    assert best_split(1.0, 1.0, 4) == 2
    assert best_split(1.0, 3.0, 4) == 1
    assert best_split(1.0, 1.0, 1) == 0  # one process: nothing to split


def test_async_prices_the_longer_side_plus_the_weight_sync_and_the_rollout_process_memory():
    serial = estimate_of(PRESET, blocks=4)
    staleness = estimate_of(PRESET, overrides=("train.pipeline=async",), blocks=4)
    waiting = estimate_of(PRESET, overrides=("train.pipeline=async", "train.max_staleness=0"), blocks=4)
    assert serial.get("pipeline") is None
    p, split, mem = staleness["pipeline"], serial["time"]["split_seconds"], serial["memory_gib"]
    rollout = [split["rollout"][i] + split["explore"][i] + split["decode"][i] for i in (0, 1)]
    sync = mem["lora"] * GiB / (LINK_GBPS["cuda"] * 1e9)  # LoRA alone travels, by CUDA IPC on the trainer's card
    assert p["link"] == "cuda" and p["weight_sync_seconds"] == pytest.approx(sync)
    for i in (0, 1):  # one card: both sides share its compute, so they add up (as at staleness 0)
        assert p["seconds_per_iteration"][i] == pytest.approx(rollout[i] + split["update"][i] + sync)
        assert waiting["pipeline"]["seconds_per_iteration"][i] == pytest.approx(rollout[i] + split["update"][i] + sync)
    # the time the report prints is the pipeline's; the serial one is kept beside it
    assert staleness["time"]["seconds_per_iteration"] == p["seconds_per_iteration"]
    assert p["serial_seconds_per_iteration"] == serial["time"]["seconds_per_iteration"]
    # the rollout process: no gradients, optimizer state or EMA, and the rollout's phases only
    assert mem["transformer_weights"] < p["rollout_process_peak_gib"] < mem["peak"]
    assert p["shares_card"] and p["fits"] == (mem["peak"] + p["rollout_process_peak_gib"] <= mem["gpu_memory"])
    assert p["trainer_peak_gib"] == pytest.approx(mem["peak"])
    assert "rollout process" in E.format_estimate(staleness)


def test_launched_rollout_processes_serve_several_trainers_over_the_process_group():
    from test_estimate import preset, with_blocks

    cfg = preset(PRESET)
    cfg.train.pipeline, cfg.train.rollout_processes = "async", 1
    arch = with_blocks(E.arch_for_model(cfg.model), 4)
    est = E.estimate(cfg, processes=3, arch=arch)  # 3 GPUs: 1 rolls out for 2 trainers
    p = est["pipeline"]
    assert est["processes"] == 2 and p["processes"] == 3 and p["link"] == "launched" and not p["shares_card"]
    assert p["weight_sync_seconds"] == pytest.approx(est["memory_gib"]["lora"] * GiB / (LINK_GBPS["launched"] * 1e9))
    split = est["time"]["split_seconds"]
    rollout = split["rollout"][0] + split["explore"][0] + split["decode"][0]
    assert p["rollout_seconds"][0] == pytest.approx(2 * rollout)  # one rollout process samples for both trainers
    for i in (0, 1):  # on a card of its own the rollout overlaps the update: the longer side plus the sync
        side = 2 * (split["rollout"][i] + split["explore"][i] + split["decode"][i])
        assert p["seconds_per_iteration"][i] == pytest.approx(max(side, split["update"][i]) + p["weight_sync_seconds"])
    with pytest.raises(ConfigError, match="train.rollout_processes=1 must leave at least one"):
        E.estimate(cfg, processes=1, arch=arch)
