"""The trajectory forest's structure helpers on a hand-built branched tree (trees must fit as-is)."""

from __future__ import annotations

import pytest
import torch

from flowrl.rollout.forest import Forest


def tree() -> Forest:
    """root 0 → {1, 2} (dance, stochastic); 1 → {3, 4}; 2 → 5 (ode). Leaves 3, 4, 5."""
    f = Forest(prompts=["p"])
    x = lambda n: torch.full((n, 1, 2, 2), 0.5)
    f.add_roots(x(1), [0], [11])
    f.add_children(
        torch.tensor([0, 0]), x(2), 0.5, 1, torch.tensor([-1.0, -2.0]), torch.tensor([0.3, 0.3]), "dance", 0.3, 0
    )
    f.add_children(
        torch.tensor([1, 1]), x(2), 0.0, 2, torch.tensor([-0.5, -0.25]), torch.tensor([0.2, 0.2]), "dance", 0.3, 1
    )
    f.add_children(torch.tensor([2]), x(1), 0.0, 2, torch.zeros(1), torch.zeros(1), "ode", 0.0, 2)
    return f


def test_structure_helpers():
    f = tree()
    assert f.num_nodes == 6 and f.all_latents().shape == (6, 1, 2, 2)
    assert f.leaves().tolist() == [3, 4, 5] and f.roots().tolist() == [0]
    assert f.children(0).tolist() == [1, 2] and f.children(1).tolist() == [3, 4] and f.children(3).tolist() == []
    assert f.depth().tolist() == [0, 1, 1, 2, 2, 2] and f.depth(4) == 2
    assert f.descendant_leaves(1).tolist() == [3, 4] and f.descendant_leaves(0).tolist() == [3, 4, 5]
    assert f.path_logp(0, 4) == pytest.approx(-1.0 - 0.25) and f.path_logp(1, 3) == pytest.approx(-0.5)
    with pytest.raises(ValueError):
        f.path_logp(2, 3)
    assert f.edges(trainable=False).tolist() == [1, 2, 3, 4, 5]
    assert f.edges().tolist() == [1, 2, 3, 4]  # the ODE edge is not trainable
    assert torch.equal(f.seed, torch.full((6,), 11))  # every node knows its root's seed
    assert f.leaf_of_each_node().tolist() == [-1, -1, 5, 3, 4, 5]  # several leaves below 0 and 1
    assert f.weight.tolist() == [1.0] * 6 and f.advantage.tolist() == [0.0] * 6  # outcomes come with the nodes
    assert torch.isnan(f.reward).all() and torch.isnan(f.value).all()
    f.weight[3] = 0
    assert f.edges().tolist() == [1, 2, 4]


def test_merge_offsets_indices():
    a, b = tree(), tree()
    m = Forest.merge([a, b])
    assert m.num_nodes == 12 and m.prompts == ["p", "p"]
    assert m.parent[6:].tolist() == [-1, 6, 6, 7, 7, 8]
    assert m.group.tolist() == [0] * 6 + [1] * 6
    assert m.batch[7:].tolist() == [3, 3, 4, 4, 5] and m._next_batch_id == 6
    assert m.leaves().tolist() == [3, 4, 5, 9, 10, 11]
