"""torch's cuDNN attention kernel is off on CUDA unless model.cudnn_attention (its backward failed for FLUX.1-dev
on an H200: flowrl/models/attention.py, docs/gpu.md), and a run that stops on non-finite gradients with it on
says so."""

from __future__ import annotations

import pytest
import torch

from flowrl.config.schema import TrainConfig
from flowrl.models import attention
from tests.conftest import make_model
from tests.test_nonfinite import config


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_cuda_device_gets_the_kernel_the_key_asks_for_and_a_cpu_leaves_it_alone(cudnn_flag):
    torch.backends.cuda.enable_cudnn_sdp(True)
    attention.configure_attention("cuda", cudnn=False)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not attention.cudnn_attention_on("cuda:0")
    attention.configure_attention(torch.device("cuda", 1), cudnn=True)
    assert torch.backends.cuda.cudnn_sdp_enabled() and attention.cudnn_attention_on("cuda")
    attention.configure_attention("cpu", cudnn=False)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU run changes nothing
    assert not attention.cudnn_attention_on("cpu")


@pytest.mark.parametrize("given, expected", [([], False), (["model.cudnn_attention=true"], True)])
def test_building_a_model_sets_the_kernel_from_the_config(monkeypatch, given, expected):
    from flowrl.config.build import build_model

    calls = []
    monkeypatch.setattr(attention, "configure_attention", lambda device, cudnn: calls.append((str(device), cudnn)))
    cfg = TrainConfig.from_yaml(None, ["model.family=shapes", "model.device=cpu", *given])
    build_model(cfg.model)
    assert calls == [("cpu", expected)]


def test_the_key_is_checked_as_a_bool():
    with pytest.raises(Exception, match="cudnn_attention"):
        TrainConfig.from_yaml(None, ["model.cudnn_attention=sometimes"])


@pytest.mark.parametrize("kernel_on", [False, True])
def test_a_run_stopped_by_nonfinite_gradients_names_the_kernel_only_when_it_was_on(tmp_path, monkeypatch, kernel_on):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(config(tmp_path, "nan", "train.max_steps=3", "loss.kl_ref=0"), model=make_model("sd3"))
    monkeypatch.setattr(attention, "cudnn_attention_on", lambda device: kernel_on)
    real = trainer.objective.loss
    monkeypatch.setattr(trainer.objective, "loss", lambda *a: (real(*a)[0] * float("nan"), real(*a)[1]))
    with pytest.raises(FloatingPointError) as raised, pytest.warns(RuntimeWarning):
        for i in range(3):
            trainer.train_step(i)
    assert ("model.cudnn_attention=false" in str(raised.value)) == kernel_on
