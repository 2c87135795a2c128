"""Two CPU processes (gloo) give the same group statistics and the same LoRA as one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("distributed_worker.py")


def test_two_processes_match_one(tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    single.mkdir()
    double.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(WORKER), str(single)], check=True, env=env, timeout=600)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(double)], env=env, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    one = torch.load(single / "rank0.pt")
    ranks = [torch.load(double / f"rank{r}.pt") for r in range(2)]
    assert one["world"] == 1
    assert [r["world"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]  # two ranks really ran
    assert "MULTI_CPU" in ranks[0]["distributed_type"]
    for it in range(2):
        # rank r holds prompt group r: its leaves' advantages (global std over both ranks) equal the
        # single process's advantages of that group
        joined = torch.cat([ranks[0]["advantages"][it], ranks[1]["advantages"][it]])
        torch.testing.assert_close(joined, one["advantages"][it], rtol=1e-4, atol=1e-5)
        assert ranks[0]["records"][it]["trained_edges"] == one["records"][it]["trained_edges"]
    # adaptive prompts: every rank fed the same gathered spreads (in global group order), so all draw
    # what one process draws, the second iteration's from the first's statistics
    assert ranks[0]["drawn"] == ranks[1]["drawn"] == one["drawn"]
    assert one["prompt_stats"]["seen"].any()
    for r in ranks:
        torch.testing.assert_close(r["prompt_stats"]["spread"], one["prompt_stats"]["spread"], rtol=1e-4, atol=1e-6)
    for name, value in one["lora"].items():
        assert torch.equal(ranks[0]["lora"][name], ranks[1]["lora"][name]), name  # ranks agree exactly
        # equal up to float summation order (Adam divides by tiny second moments, so compare absolutely)
        torch.testing.assert_close(ranks[0]["lora"][name], value, rtol=0, atol=2e-5)
    change = max(float((one["lora"][k] - one["initial"][k]).abs().max()) for k in one["lora"])
    assert change > 1e-3  # training moved the LoRA far more than the tolerance above
