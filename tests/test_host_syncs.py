"""Host synchronisations in the hot path of one iteration (issue 52): counted on the CPU, held to a bound that does
not grow with the steps, the prompt groups or the micro-batches.

On CUDA every read of a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool(t)``,
``float(t)``, ``int(t)``) waits for the GPU to finish all the work queued before it; ``torch.cuda.set_sync_debug_mode
("warn")`` names them on a GPU (docs/benchmarks.md). Here :class:`HostReads` counts those calls made from the loop's
hot path (rollout, credit, objectives, updater, scoring, trainer). What it counts: reads of floating-point tensors
(everything a model call or a kernel returns: latents, velocities, log-probs, losses, rewards, diagnostics) and of
boolean tensors outside the forest's structure walks; integer tensors and the masks of the forest's own structure
helpers (forest.py, forest_paths.py, forest_scores.py) are the forest's host-side bookkeeping (node, group and batch
indices live on the host by design) and are not counted.
"""

from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch

from flowrl.config.schema import TrainConfig
from tests.conftest import make_model

HOT_PATH = (
    "flowrl/rollout/",
    "flowrl/credit/",
    "flowrl/objectives/",
    "flowrl/training/updater.py",
    "flowrl/training/step_sums.py",
    "flowrl/training/scoring.py",
    "flowrl/training/trainer.py",
    "flowrl/models/prompt_cache.py",
)
STRUCTURE = (  # walks over host index columns
    "flowrl/rollout/forest.py",
    "flowrl/rollout/forest_paths.py",
    "flowrl/rollout/forest_scores.py",
)
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class HostReads:
    """Counts host reads of tensors made from :data:`HOT_PATH` (see the module docstring) while open:
    ``sites`` maps (file, line, method) to calls; ``total`` sums them."""

    def __init__(self):
        self.sites: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _counted(self, tensor: torch.Tensor, file: str) -> bool:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return True
        return tensor.dtype == torch.bool and not file.endswith(STRUCTURE)

    def _wrap(self, method: str, original):
        def counting(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            file = frame.f_code.co_filename.replace("\\", "/")
            here = next((file[file.rindex(p) :] for p in HOT_PATH if p in file), None)
            if here is not None and self._counted(tensor, here):
                self.sites[(here, frame.f_lineno, method)] += 1
            return original(tensor, *args, **kwargs)

        return counting

    @contextlib.contextmanager
    def counting(self):
        saved = {m: getattr(torch.Tensor, m) for m in READS}
        for m, original in saved.items():
            setattr(torch.Tensor, m, self._wrap(m, original))
        try:
            yield self
        finally:
            for m, original in saved.items():
                setattr(torch.Tensor, m, original)


OBJECTIVES = {
    "flow_grpo": ["rollout.plan=chains", "rollout.window.mode=all", "loss.kl_ref=0.04"],
    "nft": ["rollout.plan=ode", "loss.objective=nft"],
}
SIZES = {  # (steps, prompt groups): the large one has twice the steps, groups and micro-batches
    "small": (3, 2),
    "large": (6, 4),
}


def second_iteration_reads(tmp_path, objective: str, steps: int, groups: int) -> HostReads:
    """The host reads of the second iteration (the first warms up) of a tiny SD3 run (4 images per group, 4 states
    per forward: as many micro-batches as forwards)."""
    from flowrl.training.trainer import Trainer

    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=2",
            f"rollout.steps={steps}",
            "rollout.group_size=4",
            "rollout.max_batch=4",
            "prompts.train=a red circle|two blue squares|a green cat|one tree",
            f"prompts.per_step={groups}",
            "prompts.eval=null",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.async_reward=false",
            "rewards=[{name: redness}]",
            "train.max_steps=2",
            "train.updates_per_epoch=2",
            f"train.output_dir={tmp_path}",
            f"train.name={objective}-{steps}",
            *OBJECTIVES[objective],
        ],
    )
    trainer = Trainer(cfg, model=make_model("sd3"))
    trainer.train_step(0)
    reads = HostReads()
    with reads.counting():
        record = trainer.train_step(1)
    assert record["skipped_steps"] == 0
    return reads


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_host_reads_per_iteration_do_not_grow_with_steps_groups_or_micro_batches(tmp_path, objective):
    small, large = (second_iteration_reads(tmp_path, objective, *SIZES[s]) for s in ("small", "large"))
    grown = {
        k: (small.sites[k], large.sites[k])
        for k in small.sites.keys() | large.sites.keys()
        if small.sites[k] != large.sites[k]
    }
    assert not grown, f"host reads that grow with the iteration's size (file, line, method): (small, large) {grown}"
    assert large.total <= 20, f"{large.total} host reads in one iteration: {dict(large.sites)}"


def test_the_counter_sees_a_read_per_micro_batch(tmp_path):
    """The counter itself: a float() of a loss per call from the hot path is counted; an index read is not."""
    from flowrl.objectives import policy

    reads = HostReads()
    with reads.counting():
        for _ in range(3):
            code = compile("float(torch.ones(()) * 2); int(torch.arange(3)[1])", policy.__file__, "exec")
            exec(code, {"torch": torch})
    assert reads.total == 3


# ---- the pieces that replaced per-row and per-micro-batch work ----------------------------------------------------
def test_seeded_normals_equal_the_rows_drawn_one_by_one():
    from flowrl.core.seeding import seeded_normal, seeded_normals

    seeds = [3, 2**62 + 5, 0]
    assert torch.equal(seeded_normals(seeds, (2, 3, 3)), torch.stack([seeded_normal(s, (2, 3, 3)) for s in seeds]))
    assert seeded_normals([], (2,)).shape == (0, 2)


def test_rank_within_matches_counting_each_group_in_order():
    from flowrl.objectives.forward import rank_within

    group = torch.tensor([2, 0, 2, 1, 0, 2, 5])
    expected = torch.tensor([0, 0, 1, 0, 1, 2, 0])
    assert torch.equal(rank_within(group), expected)


def test_device_sums_fold_like_the_host_and_read_back_once():
    from flowrl.training.updater import DeviceSums, host_values

    sums = DeviceSums({"ratio_min": min, "ratio_max": max})
    sums.add({"loss": torch.tensor(0.5), "ratio_min": torch.tensor(0.9), "ratio_max": torch.tensor(1.1)}, 4)
    sums.add({"loss": torch.tensor(1.5), "ratio_min": torch.tensor(0.8), "ratio_max": 1.0}, 2)
    other = DeviceSums({})
    other.add({"aux": torch.tensor(2.0)}, 1)
    reads = HostReads()
    with reads.counting():
        code = compile("out = host_values(parts)", "flowrl/training/step_sums.py", "exec")
        scope = {"host_values": host_values, "parts": [sums, other]}
        exec(code, scope)
    assert scope["out"] == [
        {"loss": 5.0, "ratio_min": pytest.approx(0.8), "ratio_max": pytest.approx(1.1)},
        {"aux": 2.0},
    ]
    assert reads.total == 1  # one tolist for every value of every part


def test_the_forest_settles_edge_values_on_first_read(sd3_model):
    """Log-probs and stds reach the host columns when first read, equal to what the kernel computed."""
    from flowrl.rollout.forest import Forest

    f = Forest(prompts=["a"])
    roots = f.add_roots(torch.zeros(3, 1, 2, 2), [0, 0, 0], [1, 2, 3])
    kids = f.add_children(
        roots,
        torch.ones(3, 1, 2, 2),
        0.5,
        1,
        torch.tensor([-1.0, -2.0, -3.0]),
        torch.tensor([0.1, 0.0, 0.2]),
        "flow_grpo",
        0.7,
        0,
    )
    assert f._pending and f._logp_old[kids].eq(0).all()
    assert torch.equal(f.logp_old[kids], torch.tensor([-1.0, -2.0, -3.0])) and not f._pending
    assert torch.equal(f.std[kids], torch.tensor([0.1, 0.0, 0.2]))
    assert f.stochastic.tolist() == [False, False, False, True, False, True]


def test_replay_batches_are_the_rollout_forwards_in_order():
    from flowrl.objectives.replay import replay_batches
    from flowrl.rollout.forest import Forest

    f = Forest(prompts=["a"])
    roots = f.add_roots(torch.zeros(6, 1, 2, 2), [0] * 6, list(range(6)))
    for rows, batch in ((slice(0, 2), 1), (slice(2, 6), 0)):
        f.add_children(
            roots[rows],
            torch.ones(rows.stop - rows.start, 1, 2, 2),
            0.5,
            1,
            torch.zeros(rows.stop - rows.start),
            torch.ones(rows.stop - rows.start),
            "flow_grpo",
            0.7,
            batch,
        )
    edges = torch.tensor([11, 6, 9, 7, 8])
    assert [b.tolist() for b in replay_batches(f, edges)] == [[11, 9, 8], [6, 7]]
