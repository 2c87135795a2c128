"""Shared fixtures: tiny offline pipelines wrapped by the adapters (fresh per test: LoRA mutates them)."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see docs/benchmarks.md)

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves


def make_model(family: str, **kw):
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_flux_pipeline, tiny_sd3_pipeline

    if family == "sd3":
        return wrap(tiny_sd3_pipeline(), **kw)
    if family == "flux":
        kw.setdefault("height", 16)
        kw.setdefault("width", 16)
        return wrap(tiny_flux_pipeline(), **kw)
    raise ValueError(family)


@pytest.fixture
def sd3_model():
    return make_model("sd3")


@pytest.fixture
def flux_model():
    return make_model("flux")
