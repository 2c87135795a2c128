"""Explorer copies (flowrl/rollout/explorer.py, flowrl/rollout/precision.py): closeness to full precision per backend
this machine runs, the
documented error for the others, skip lists and layer sizes, and following the weights after updates."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.models.base import LoraSpec
from flowrl.rollout.explorer import make_explorer
from flowrl.rollout.precision import (
    BACKENDS,
    DEFAULT_SKIP,
    available_backends,
    check_backend,
    quantize_linear,
    unavailable_reason,
)
from tests.conftest import make_model

PROMPTS = ["a red circle", "two blue squares", "a green cat", "a small dog"]
# Relative L2 error ‖v_explorer − v‖ / ‖v‖ allowed on the tiny SD3 transformer (every Linear quantized but
# the default skip list, LoRA merged; measured here: bf16 0.006, fp16 0.0008, int8 0.008, nf4 0.058).
TOLERANCE = {"same": 0.0, "bf16": 0.03, "fp16": 0.005, "int8": 0.04, "nf4": 0.2, "fp8": 0.08, "nvfp4": 0.25}


def lora_model(seed: int = 0):
    model = make_model("sd3")
    model.add_lora(LoraSpec(rank=4, init="default"))
    perturb(model, seed)
    return model


def perturb(model, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.trainable.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def velocities(model, n: int = 8, guidance: float = 1.0) -> torch.Tensor:
    x = model.noise(range(n))
    with torch.no_grad():
        return model.velocity(x, torch.full((n,), 0.7), model.encode((PROMPTS * n)[:n], guidance), guidance)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_here_are_close_to_full_precision_and_the_others_raise(backend):
    model = lora_model()
    if unavailable_reason(backend, "cpu") is not None:
        here = available_backends("cpu")
        with pytest.raises(
            ConfigError,
            match=rf"backend='{backend}' cannot run on cpu: .*backends this machine can run: "
            + repr(here).replace("[", r"\[").replace("]", r"\]"),
        ):
            make_explorer(model, backend)
        return
    explorer = make_explorer(model, backend, min_params=0)
    ref = velocities(model)
    v = velocities(explorer.model)
    assert v.dtype == torch.float32 and v.shape == ref.shape
    if backend == "same":
        assert explorer.model is model and torch.equal(v, ref)
    else:
        assert 0 < rel_error(v, ref) <= TOLERANCE[backend], rel_error(v, ref)
        assert explorer.model.forward_module is explorer.transformer
        assert model.forward_module is model.trainable  # the live model is untouched
        assert torch.equal(velocities(model), ref)
        assert not any(p.requires_grad for p in explorer.transformer.parameters())
    if backend in ("int8", "nf4"):
        assert explorer.quantized


def test_gpu_backends_fail_at_config_load_naming_what_runs_here():
    from flowrl.config.schema import TrainConfig

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for backend in ("fp8", "nvfp4"):
        with pytest.raises(ConfigError, match=rf"rollout.backend='{backend}' cannot run on cpu.*can run: \['same'"):
            TrainConfig.from_yaml(None, ["rollout.plan=explore", f"rollout.backend={backend}"])
    with pytest.raises(
        ConfigError, match=r"rollout.backend='int4' is not supported \(did you mean 'int8'\?\); accepted"
    ):
        check_backend("int4")
    assert {"same", "bf16", "fp16", "int8"} <= set(available_backends("cpu"))
    assert "torchao" in unavailable_reason("fp8", "cpu") or "CUDA" in unavailable_reason("fp8", "cpu")


def test_skip_lists_and_minimum_size_keep_embedders_norms_and_outputs():
    model = make_model("sd3")
    assert make_explorer(model, "int8").quantized == []  # every tiny layer is below the default 16,384 weights
    int8 = make_explorer(model, "int8", min_params=0).quantized
    assert int8 and not [n for n in int8 if "embed" in n or n.startswith(("proj_out", "norm_out"))]
    assert any(".norm1.linear" in n for n in int8)  # adaLN modulation: int8 converts it, 4-bit backends keep it
    assert any("ff.net" in n for n in int8) and any("attn.to_q" in n for n in int8)
    big = make_explorer(model, "int8", min_params=16 * 64).quantized
    assert big and set(big) < set(int8)
    everything = make_explorer(model, "int8", min_params=0, skip=[]).quantized
    assert "proj_out" in everything and set(int8) < set(everything)
    assert "*norm*.linear" in DEFAULT_SKIP["nf4"] and "*norm*.linear" not in DEFAULT_SKIP["int8"]
    if unavailable_reason("nf4", "cpu") is None:
        nf4 = make_explorer(model, "nf4", min_params=0).quantized
        assert nf4 and not [n for n in nf4 if ".norm" in n]


def test_sync_follows_an_optimizer_step_requantizing_only_lora_layers():
    """After a real optimizer step on the LoRA, sync re-merges it: the explorer then equals one built from
    scratch from the updated model, and frozen quantized layers were not rebuilt (same module objects)."""
    model = lora_model()
    explorer = make_explorer(model, "int8", min_params=0)
    lora_targets = {
        n
        for n in explorer.quantized
        if n.split(".")[-1] in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
        or n.endswith("to_out.0")
    }
    frozen = {n: explorer.transformer.get_submodule(n) for n in explorer.quantized if n not in lora_targets}
    assert frozen and lora_targets
    before = velocities(explorer.model)

    params = [p for p in model.trainable.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05)
    x = model.noise([1, 2])
    loss = model.velocity(x, torch.full((2,), 0.5), model.encode(PROMPTS[:2])).pow(2).mean()
    loss.backward()
    opt.step()

    assert torch.equal(velocities(explorer.model), before)  # not synced yet
    assert explorer.sync(model) == len(lora_targets)
    after = velocities(explorer.model)
    assert not torch.allclose(after, before)
    assert torch.equal(after, velocities(make_explorer(model, "int8", min_params=0).model))
    assert rel_error(after, velocities(model)) <= TOLERANCE["int8"]
    assert all(explorer.transformer.get_submodule(n) is m for n, m in frozen.items())
    assert all(explorer.transformer.get_submodule(n) is not None for n in lora_targets)


@pytest.mark.parametrize("backend", ["int8", "bf16"])
def test_sync_under_full_finetuning_copies_every_trainable_parameter(backend):
    model = make_model("sd3")
    model.trainable.requires_grad_(True)
    explorer = make_explorer(model, backend, min_params=0)
    with torch.no_grad():
        for p in model.trainable.parameters():
            p.mul_(1.01)
    assert explorer.sync(model) > 0
    assert torch.equal(velocities(explorer.model), velocities(make_explorer(model, backend, min_params=0).model))


def test_quantize_linear_int8_paths_compute_the_layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64)
    ref = layer(x).detach()
    q = quantize_linear("int8", layer.weight, layer.bias, torch.device("cpu"), torch.float32)
    assert rel_error(q(x), ref) < 0.02
    pytest.importorskip("bitsandbytes")
    for backend, impl, tol in (("int8", "bitsandbytes", 0.02), ("nf4", "auto", 0.15)):
        q = quantize_linear(backend, layer.weight, layer.bias, torch.device("cpu"), torch.float32, impl)
        assert rel_error(q(x).float(), ref) < tol, backend
