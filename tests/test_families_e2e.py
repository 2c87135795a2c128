"""The newer families (Qwen-Image, Qwen-Image-Edit, FLUX.2, Wan text-to-video) end to end through ``flowrl train`` with
a YAML,
as a user runs them: each tiny pipeline saved to a folder and loaded by path (``model.path``), prompts from files,
a cheap reward (Wan: brightness averaged over every 2nd frame, plus temporal consistency; Qwen-Image-Edit: prompts
``[image: PATH] INSTRUCTION`` on source PNGs, brightness plus fidelity to the source).

Per family: (1) a policy objective (Flow-GRPO chains: the first replay reproduces the rollout, ratio exactly 1) and
DiffusionNFT (ODE plan) each run 2 iterations, exit 0 and write their metrics; (2) the policy run's checkpoint LoRA
loads into the plain diffusers pipeline (``<Pipeline>.from_pretrained(folder)`` + ``load_lora_weights``) and, wrapped
by :func:`flowrl.models.wrap`, gives the velocities and the ODE sample of the run's model as flowrl's own loader
builds it (``flowrl sample``'s :func:`flowrl.run.model.model_from_run`); (3) 1 iteration + ``train.resume=latest``
to 2 logs every non-``time/`` metric equal to a straight 2-iteration run. CPU only, one thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from flowrl.commands.main import main
from tests.conftest import without_wall_clock

FAMILIES = {
    # family: (pipeline class, tiny builder "module:function", model keys, training rewards)
    "qwen_image": (
        "QwenImagePipeline",
        "flowrl.models.testing.qwen_image:tiny_qwen_image_pipeline",
        dict(height=32, width=32, max_sequence_length=12),
        [{"name": "brightness"}],
    ),
    "qwen_image_edit": (
        "QwenImageEditPipeline",
        "flowrl.models.testing.qwen_image:tiny_qwen_image_edit_pipeline",
        dict(height=32, width=32, max_sequence_length=16),
        [{"name": "brightness"}, {"name": "source_fidelity", "kwargs": {"size": 8}}],
    ),
    "flux2": (
        "Flux2Pipeline",
        "flowrl.models.testing.flux2:tiny_flux2_pipeline",
        dict(height=16, width=16, max_sequence_length=40),
        [{"name": "brightness"}],
    ),
    "wan": (
        "WanPipeline",
        "flowrl.models.testing.wan:tiny_wan_pipeline",
        dict(height=32, width=48, max_sequence_length=12, kwargs={"num_frames": 5}),
        [{"name": "brightness", "kwargs": {"frame_stride": 2}}, {"name": "temporal_consistency"}],
    ),
}
TRAIN_PROMPTS = ["a red circle", "two blue square", "a green cat", "a small dog"]
EVAL_PROMPTS = ["a red circle", "a big house"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family → the folder its tiny pipeline was saved to (built once per module, on first use)."""
    import importlib

    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            module, _, name = FAMILIES[family][1].partition(":")
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            getattr(importlib.import_module(module), name)().save_pretrained(folder)
            folders[family] = folder
        return folders[family]

    return get


def family_prompts(tmp_path: Path, family: str, texts: list[str]) -> list[str]:
    """``texts`` as ``family`` takes them: an editing family's each on its own source image (a PNG written into
    ``tmp_path``, the same for the same text), others as they are."""
    from PIL import Image

    from flowrl.models import model_family
    from flowrl.models.image_prompts import image_prompt

    if not model_family(family).adapter_class().takes_source_image:
        return list(texts)
    out = []
    for text in texts:
        path = tmp_path / f"source-{text.replace(' ', '_')}.png"
        if not path.exists():
            g = torch.Generator().manual_seed(len(text))
            Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
        out.append(image_prompt(text, path))
    return out


def write_config(tmp_path: Path, folder: Path, family: str, objective: str) -> Path:
    """A complete YAML for a 2-iteration run of ``family`` (the pipeline in ``folder``) with ``objective``
    ("policy": Flow-GRPO chains at guidance 2; "nft": DiffusionNFT on ODE rollouts, CFG-free)."""
    (tmp_path / "train.txt").write_text("\n".join(family_prompts(tmp_path, family, TRAIN_PROMPTS)) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(family_prompts(tmp_path, family, EVAL_PROMPTS)) + "\n")
    sizes, rewards = FAMILIES[family][2], FAMILIES[family][3]
    policy = objective == "policy"
    cfg = {
        "model": {
            "family": family,
            "path": str(folder),
            "guidance": 2.0 if policy else 1.0,
            **sizes,
            "lora": {"rank": 4, "alpha": 8, "init": "default"},
        },
        "rollout": (
            {
                "plan": "chains",
                "group_size": 2,
                "steps": 3,
                "kernel": "flow_grpo",
                "eta": 0.7,
                "window": {"mode": "fixed", "start": 0, "size": 2},
                "max_batch": 8,
            }
            if policy
            else {"plan": "ode", "group_size": 2, "steps": 3, "max_batch": 8}
        ),
        "rewards": rewards,
        "loss": ({"clip_low": 0.2, "clip_high": 0.2, "kl_ref": 0.01} if policy else {"objective": "nft"}),
        "optim": {"lr": 3e-3 if policy else 1e-2},
        "prompts": {"train": str(tmp_path / "train.txt"), "eval": str(tmp_path / "eval.txt"), "per_step": 2},
        "eval": {"steps": 2, "images_per_prompt": 1, "grid_prompts": 2, "default_guidance": False},
        "train": {
            "name": f"{family}-{objective}",
            "output_dir": str(tmp_path / "runs"),
            "max_steps": 2,
            "checkpoint_every": 1,
            "progress": False,
            "num_threads": 1,
            "async_reward": False,
        },
    }
    path = tmp_path / f"{family}-{objective}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(config: Path, *overrides: str) -> list[dict]:
    """``flowrl train config overrides``: exit 0; the run folder's metrics.jsonl records."""
    assert main(["train", str(config), *overrides]) == 0
    cfg = yaml.safe_load(config.read_text())["train"]
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.name=")), cfg["name"])
    path = Path(cfg["output_dir"]) / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def iterations(records: list[dict]) -> list[dict]:
    return [r for r in records if "reward_mean" in r]


def check_finite(records: list[dict]) -> None:
    for r in records:
        for k, v in r.items():
            assert isinstance(v, (int, float)) and torch.isfinite(torch.tensor(float(v))), (k, r)


# ---- (1) + (2): the policy objective, and its checkpoint in the plain diffusers pipeline -----------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_policy_run_and_its_lora_in_diffusers(tmp_path, saved, family):
    """2 Flow-GRPO iterations (ratio exactly 1 at each first replay); the step-2 LoRA read by diffusers'
    ``load_lora_weights`` gives the run's velocities and ODE sample (flowrl's loader), and differs from the base."""
    import diffusers

    from flowrl.models import wrap
    from flowrl.rollout.sampling import ode_sample
    from flowrl.run.model import model_from_run

    folder = saved(family)
    records = train(write_config(tmp_path, folder, family, "policy"))
    steps = iterations(records)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["first_step_abs_delta_logp"] == 0.0 and r["ratio_mean"] == 1.0, r
        assert r["trained_edges"] == 2 * 2 * 2 and r["grad_norm"] > 0
    assert [r["step"] for r in records if any(k.startswith("eval/") for k in r)] == [0, 2]
    check_finite(records)
    run = tmp_path / "runs" / f"{family}-policy"
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file()

    # flowrl's own loader (flowrl sample / flowrl eval): the run's config, the newest checkpoint
    cfg, ours, _ = model_from_run(str(run), None, [])
    assert cfg.model.family == family and ours.has_lora
    # the plain diffusers pipeline from the same folder, the LoRA through diffusers' own loader
    pipeline_class = getattr(diffusers, FAMILIES[family][0])
    pipe = pipeline_class.from_pretrained(folder)
    keys = {k: getattr(cfg.model, k) for k in ("guidance", "height", "width", "max_sequence_length")}
    base = wrap(pipeline_class.from_pretrained(folder), **keys, **cfg.model.kwargs)
    pipe.load_lora_weights(str(ckpt))
    theirs = wrap(pipe, **keys, **cfg.model.kwargs)

    prompts = family_prompts(tmp_path, family, EVAL_PROMPTS + TRAIN_PROMPTS[:1])
    x, s = ours.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v_ours = ours.velocity(x, s, ours.encode(prompts))
        v_theirs = theirs.velocity(x, s, theirs.encode(prompts))
        v_base = base.velocity(x, s, base.encode(prompts))
        torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)  # measured: bit-equal
        assert (v_ours - v_base).abs().max() > 1e-4  # the trained LoRA matters: the comparison means something
        sample_ours = ode_sample(ours, prompts[:2], [11, 12], 3, decode=False)
        sample_theirs = ode_sample(theirs, prompts[:2], [11, 12], 3, decode=False)
        torch.testing.assert_close(sample_theirs, sample_ours, rtol=1e-6, atol=1e-6)


# ---- (1): DiffusionNFT ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_nft_run(tmp_path, saved, family):
    """2 DiffusionNFT iterations on ODE rollouts (CFG-free): 4 leaves trained each, metrics finite, a checkpoint."""
    records = train(write_config(tmp_path, saved(family), family, "nft"))
    steps = iterations(records)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["trained_leaves"] == 4.0 and r["grad_norm"] > 0, r
    if family == "wan":
        assert "reward/temporal_consistency" in steps[0] and "reward/brightness" in steps[0]
    if family == "qwen_image_edit":
        assert 0 < steps[0]["reward/source_fidelity"] < 1 and "reward/brightness" in steps[0]
    check_finite(records)
    ckpt = tmp_path / "runs" / f"{family}-nft" / "checkpoints" / "step-2"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file()


# ---- (3): resume == straight -----------------------------------------------------------------------------------
# nft (`pytest -m slow`): each family's resume is the policy run's here, NFT's old copy and its resume are
# test_forward_process.py::test_resume_restores_the_old_policy's, and each family's NFT run test_nft_run's
@pytest.mark.parametrize("objective", ["policy", pytest.param("nft", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_resume_equals_a_straight_run(tmp_path, saved, family, objective):
    """1 iteration, then train.resume=latest to 2: every non-time/ metric and the step-2 LoRA equal a straight
    2-iteration run's."""
    config = write_config(tmp_path, saved(family), family, objective)
    straight = train(config, "train.name=straight")
    train(config, "train.name=resumed", "train.max_steps=1")
    assert (tmp_path / "runs" / "resumed" / "checkpoints" / "step-1").is_dir()
    resumed = train(config, "train.name=resumed", "train.max_steps=2", "train.resume=latest")
    # the 1-step run's records, its closing eval at step 1 included, were kept (so it resumed, not restarted);
    # the straight run has no eval at step 1
    assert [r["step"] for r in resumed] == [0, 1, 1, 2, 2] and "reward_mean" not in resumed[2]
    del resumed[2]
    assert [r["step"] for r in straight] == [0, 1, 2, 2]

    drop_time = without_wall_clock

    for a, b in zip(straight, resumed):
        a, b = drop_time(a), drop_time(b)
        assert a == b, (a["step"], sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)))
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "runs" / name / "checkpoints" / "step-2" / "pytorch_lora_weights.safetensors")
        for name in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same trained LoRA
