"""The transformer's blocks one by one (flowrl/models/blocks.py): gradient checkpointing of the first N blocks and
regional torch.compile, on tiny pipelines of every family."""

from __future__ import annotations

import copy

import pytest
import torch

import flowrl.models.blocks as blocks
from flowrl.models.blocks import (
    block_kind,
    block_lists,
    checkpoint_blocks,
    checkpointed_count,
    compile_blocks,
    is_checkpointed,
)
from tests.conftest import make_model
from tests.test_trainer import tiny_config


def _sd3_inputs(transformer, batch: int = 3):
    g = torch.Generator().manual_seed(0)
    c = transformer.config
    return dict(
        hidden_states=torch.randn(batch, c.in_channels, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(batch, 7, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, c.pooled_projection_dim, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000,
    )


def _gradients(transformer) -> list[torch.Tensor]:
    transformer.zero_grad()
    transformer(**_sd3_inputs(transformer)).sample.pow(2).mean().backward()
    return [p.grad.clone() for p in transformer.parameters() if p.grad is not None]


def _saved_bytes(transformer) -> int:
    """Bytes autograd saves for backward over one forward with gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        transformer(**_sd3_inputs(transformer)).sample.pow(2).mean()
    return sum(saved)


def test_checkpointing_the_first_blocks_keeps_gradients_and_saves_memory():
    from flowrl.models.testing import tiny_sd3_pipeline

    transformer = tiny_sd3_pipeline().transformer
    n = len(block_lists(transformer))
    assert n >= 2
    keys = list(transformer.state_dict())
    plain, saved_plain = _gradients(transformer), _saved_bytes(transformer)
    assert checkpoint_blocks(transformer, 1) == 1 and checkpointed_count(transformer) == 1
    assert [is_checkpointed(b) for b in block_lists(transformer)] == [True] + [False] * (n - 1)
    saved_one = _saved_bytes(transformer)
    for a, b in zip(plain, _gradients(transformer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert checkpoint_blocks(transformer, None) == n and checkpointed_count(transformer) == n
    saved_all = _saved_bytes(transformer)
    assert saved_plain > saved_one > saved_all  # each checkpointed block keeps only its inputs
    for a, b in zip(plain, _gradients(transformer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert list(transformer.state_dict()) == keys  # names unchanged: LoRA files and checkpoints load as before
    assert type(block_lists(transformer)[0]).__name__ == "JointTransformerBlock"
    clone = copy.deepcopy(transformer)  # the objectives' frozen copies: checkpointed blocks of their own
    assert checkpointed_count(clone) == n and block_lists(clone)[0] is not block_lists(transformer)[0]
    checkpoint_blocks(transformer, 0)
    assert checkpointed_count(transformer) == 0 and not any(is_checkpointed(b) for b in block_lists(transformer))


def test_the_transformers_own_checkpointing_is_replaced_by_the_blocks_count():
    from flowrl.models.testing import tiny_sd3_pipeline

    transformer = tiny_sd3_pipeline().transformer
    transformer.enable_gradient_checkpointing()
    assert checkpointed_count(transformer) == len(block_lists(transformer))
    checkpoint_blocks(transformer, 1)
    assert not transformer.gradient_checkpointing and checkpointed_count(transformer) == 1


@pytest.mark.parametrize(
    "family,kinds",
    [("sd3", {"JointTransformerBlock"}), ("flux", {"FluxTransformerBlock", "FluxSingleTransformerBlock"})],
)
def test_block_kinds_cover_every_block_of_the_family(family, kinds):
    transformer = make_model(family).trainable
    found = block_lists(transformer)
    assert {block_kind(b).split("(")[0] for b in found} == kinds
    assert len(found) == sum(len(c) for name, c in transformer.named_children() if name.endswith("blocks"))


def test_compiled_blocks_compute_what_eager_blocks_do_with_one_graph_set_per_kind():
    """compile_blocks on the tiny SD3 transformer (its two block kinds, one block checkpointed): a forward without
    gradients and one with them, each at two batch sizes, equal the eager transformer's outputs and gradients; each
    kind compiles the same variants at the first size and nothing at the second (shapes are dynamic). The cheaper
    twin of the slow test below, which runs the same through the trainer."""
    import torch._dynamo

    from flowrl.models.testing import tiny_sd3_pipeline

    torch._dynamo.reset()
    eager = tiny_sd3_pipeline().transformer
    compiled = copy.deepcopy(eager)
    checkpoint_blocks(compiled, 1)
    stats = compile_blocks(compiled, backend="eager")  # dynamo traces as with inductor, no C++ build
    kinds = {block_kind(b) for b in block_lists(compiled)}
    assert len(kinds) == 2 and stats.total == 0  # nothing compiles before the first call

    def both(batch: int) -> None:
        with torch.no_grad():
            assert torch.allclose(
                compiled(**_sd3_inputs(compiled, batch)).sample, eager(**_sd3_inputs(eager, batch)).sample, atol=1e-6
            )
        grads = []
        for model in (compiled, eager):
            model.zero_grad()
            model(**_sd3_inputs(model, batch)).sample.pow(2).mean().backward()
            grads.append([p.grad for p in model.parameters()])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))

    both(3)
    first = dict(stats.graphs)
    assert set(first) == kinds and len(set(first.values())) == 1 and 1 <= next(iter(first.values())) <= 2
    both(5)
    assert stats.graphs == first  # another batch size: no variant
    torch._dynamo.reset()


def test_the_trainer_compiles_the_blocks_model_compile_names(tmp_path):
    """``model.compile=regional`` from the config reaches the transformer the trainer trains (its stats kept for the
    metrics); ``off`` compiles nothing. Nothing runs here: the compilation itself is the test above's."""
    from flowrl.training.trainer import Trainer

    cfg = tiny_config(tmp_path, "wired", "model.compile=regional", "prompts.eval=null")
    trainer = Trainer(cfg, model=make_model("sd3"))
    compiled = [b._compiled_call_impl is not None for b in block_lists(trainer.model.trainable)]
    assert trainer.compiled is not None and all(compiled)  # the stats are the trainer's: none on the model
    assert trainer.compiled.blocks == len(block_lists(trainer.model.trainable)) and trainer.compiled.total == 0
    plain = Trainer(tiny_config(tmp_path, "plain", "prompts.eval=null"), model=make_model("sd3"))
    assert plain.compiled is None and not any(
        b._compiled_call_impl is not None for b in block_lists(plain.model.trainable)
    )


@pytest.mark.slow  # 10–14 s of dynamo tracing; the two tests above hold the compilation and its wiring
def test_regional_compile_trains_with_one_graph_set_per_block_kind_and_no_recompiles(tmp_path, monkeypatch):
    """model.compile=regional on a tiny SD3 with LoRA and one checkpointed block: two iterations train; every
    block kind (SD3's blocks with and without the context branch) compiles the same variants (the rollout without
    gradients, the update with them, the KL reference with the adapter off; a smaller last chunk of 2 rows after
    chunks of 6 is no variant: shapes are dynamic) in the first iteration and nothing after it."""
    import torch._dynamo

    from flowrl.training.trainer import Trainer

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")  # dynamo traces as with inductor, no C++ build
    torch._dynamo.reset()
    cfg = tiny_config(
        tmp_path,
        "compiled",
        "model.compile=regional",
        "model.gradient_checkpointing=true",
        "model.checkpoint_blocks=1",
        "prompts.eval=null",
        "rollout.max_batch=6",
        "train.max_steps=2",
    )
    trainer = Trainer(cfg, model=make_model("sd3"))
    stats = trainer.compiled
    kinds = {block_kind(b) for b in block_lists(trainer.model.trainable)}
    assert stats is not None and set(stats.graphs) == set() and len(kinds) == 2
    before = {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}
    records = trainer.train()
    assert [r["compile/graphs"] for r in records] == [stats.total] * 2  # nothing compiled after iteration 1
    assert set(stats.graphs) == kinds and len(set(stats.graphs.values())) == 1  # the same variants per kind
    assert 1 <= next(iter(stats.graphs.values())) <= 3
    assert records[0]["compile/seconds"] > 0
    after = dict(trainer.model.trainable.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the LoRA trained through compiled blocks
    torch._dynamo.reset()


def test_compile_refuses_a_transformer_without_blocks():
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_every_stored_architecture_has_its_block_kinds_found_and_checkpointable():
    """On the meta device, every family's published transformer: its blocks found in execution order, the kinds
    regional compilation compiles once each (SD3.5-Medium's blocks with and without the second attention and its
    last, context-free block; FLUX's double and single blocks), and any count of them checkpointed."""
    from flowrl.estimate import build_transformer, list_archs, load_arch

    kinds_of = {}
    for key in list_archs():
        transformer = build_transformer(load_arch(key), torch.bfloat16)
        found = block_lists(transformer)
        assert found, key
        kinds_of[key] = {block_kind(b) for b in found}
        half = len(found) // 2
        assert checkpoint_blocks(transformer, half) == half and checkpointed_count(transformer) == half
    sd35 = kinds_of["sd35_medium"]
    assert len(sd35) == 3 and sum("attn2" in k for k in sd35) == 1
    assert {k.split("(")[0] for k in kinds_of["flux1_dev"]} == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
