"""Declared state only, for the blocks (issue 62: no ``__dict__`` stash on a model from outside it;
flowrl/models/blocks.py): gradient checkpointing of the first N blocks and regional compile leave every module of
the model with the attributes it had — the checkpointed blocks' classes and checkpoint functions are held in
blocks.py's own registries, the compile stats by the caller (the trainer's ``compiled``) — and still checkpoint
(same gradients, fewer saved activations, the same state-dict keys); a two-expert Wan module's blocks are its declared
members' (:meth:`~flowrl.models.module_group.ModuleGroup.members`), not whatever its children hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flowrl.models.blocks import block_lists, checkpoint_blocks, checkpointed_count, compile_blocks, is_checkpointed
from tests.conftest import make_model
from tests.test_blocks import _gradients, _saved_bytes
from tests.test_declared_state import declared
from tests.test_trainer import tiny_config


def attributes(module: nn.Module) -> dict[str, set[str]]:
    """Each submodule's instance attributes by its name, less those its class declares (torch's own
    ``_compiled_call_impl``, set by ``Module.compile``)."""
    return {name: set(vars(m)) - declared(type(m)) for name, m in module.named_modules()}


def flowrl_names(module: nn.Module) -> list[str]:
    """``_flowrl_*`` names in any submodule's ``__dict__`` or in any class of its MRO."""
    found = [f"{name}.{key}" for name, m in module.named_modules() for key in vars(m) if key.startswith("_flowrl")]
    classes = {klass for m in module.modules() for klass in type(m).__mro__}
    return found + [f"{k.__qualname__}.{key}" for k in classes for key in vars(k) if key.startswith("_flowrl")]


def test_checkpointing_and_compile_set_nothing_on_the_transformer_or_its_blocks():
    from flowrl.models.testing import tiny_sd3_pipeline

    transformer = tiny_sd3_pipeline().transformer
    before, keys = attributes(transformer), list(transformer.state_dict())
    calls = []

    def function(run, *args):  # another checkpoint function (as the estimate's autocast): torch's, counted
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)

    n = len(block_lists(transformer))
    assert checkpoint_blocks(transformer, n, function) == n
    stats = compile_blocks(transformer, backend="eager")
    assert attributes(transformer) == before and flowrl_names(transformer) == []
    assert list(transformer.state_dict()) == keys and stats.blocks == n
    assert all(type(b).__name__ == "JointTransformerBlock" for b in block_lists(transformer))
    checkpoint_blocks(transformer, 1)  # torch's own function again, one block
    assert attributes(transformer) == before and flowrl_names(transformer) == []
    assert [is_checkpointed(b) for b in block_lists(transformer)] == [True] + [False] * (n - 1)


def test_a_registered_checkpoint_function_runs_for_its_blocks_only_and_not_for_a_copy():
    from flowrl.models.testing import tiny_sd3_pipeline

    transformer = tiny_sd3_pipeline().transformer
    plain, saved_plain = _gradients(transformer), _saved_bytes(transformer)
    calls = []

    def function(run, *args):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)

    n = len(block_lists(transformer))
    checkpoint_blocks(transformer, n, function)
    for a, b in zip(plain, _gradients(transformer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(calls) == n  # once per checkpointed block's forward (the backward recomputes inside torch's)
    clone = copy.deepcopy(transformer)  # a frozen copy: checkpointed blocks of its own, with torch's function
    calls.clear()
    assert checkpointed_count(clone) == n and _saved_bytes(clone) < saved_plain and calls == []
    for a, b in zip(plain, _gradients(clone)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert calls == []
    checkpoint_blocks(transformer, 0)  # no block checkpointed: nothing left registered, nothing called
    _gradients(transformer)
    assert calls == [] and checkpointed_count(transformer) == 0


@pytest.mark.parametrize(
    "settings",
    [
        ["model.gradient_checkpointing=true", "model.checkpoint_blocks=1"],
        ["model.gradient_checkpointing=true", "model.checkpoint_blocks=1", "model.compile=regional"],
    ],
    ids=["checkpointing", "checkpointing_and_compile"],
)
def test_the_trainers_block_settings_leave_the_model_its_own_attributes(tmp_path, settings):
    """A run with the block settings and one without: every module of the trained transformer has the same
    attributes (its LoRA layers' alike), no ``_flowrl_*`` name anywhere, and the same state-dict keys."""
    from flowrl.training.trainer import Trainer

    plain = Trainer(tiny_config(tmp_path, "plain", "prompts.eval=null"), model=make_model("sd3")).model.trainable
    trainer = Trainer(tiny_config(tmp_path, "run", "prompts.eval=null", *settings), model=make_model("sd3"))
    model = trainer.model.trainable
    assert attributes(model) == attributes(plain) and flowrl_names(model) == []
    assert list(model.state_dict()) == list(plain.state_dict())
    assert checkpointed_count(model) == 1 and checkpointed_count(plain) == 0
    assert (trainer.compiled is not None) == ("model.compile=regional" in settings)


def test_a_module_groups_blocks_are_its_declared_members():
    from flowrl.models.module_group import ModuleGroup
    from flowrl.models.testing.wan import tiny_wan_pipeline
    from flowrl.models.wan_experts import WanExperts

    pipe = tiny_wan_pipeline(two_experts=True)
    experts = WanExperts(pipe.transformer, pipe.transformer_2, 875.0, ("transformer_2",))
    assert experts.members() == [pipe.transformer, pipe.transformer_2]
    assert block_lists(experts) == block_lists(pipe.transformer) + block_lists(pipe.transformer_2)
    high = len(block_lists(pipe.transformer))
    assert checkpoint_blocks(experts, high) == high  # the first member's blocks, then the second's
    assert [is_checkpointed(b) for b in block_lists(experts)] == [True] * high + [False] * high

    class OneMember(ModuleGroup):  # another child with blocks that is no member: not the group's
        def __init__(self):
            super().__init__()
            self.main, self.extra = copy.deepcopy(pipe.transformer), copy.deepcopy(pipe.transformer_2)

        def members(self) -> list[nn.Module]:
            return [self.main]

    group = OneMember()
    assert block_lists(group) == block_lists(group.main)

    class Undeclared(ModuleGroup):
        pass

    with pytest.raises(NotImplementedError):
        block_lists(Undeclared())
