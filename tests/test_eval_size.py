"""``eval.height`` / ``eval.width`` (issue 45, item 2): the eval, its grids, ``flowrl sample`` and the benchmarks draw
at another resolution than the rollouts, for a transformer that accepts both (the tiny SD3 pipeline: 16 px rollouts,
a position table of 64 px a side); a size it cannot take is refused at the start, naming the keys."""

from __future__ import annotations

import pytest
from PIL import Image

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)


@pytest.fixture(scope="module")
def tiny_model(tiny_folder):  # noqa: F811
    from flowrl.models.sd3 import SD3FlowModel

    return SD3FlowModel.from_pretrained(str(tiny_folder))


def test_the_eval_draws_at_its_own_size_and_the_rollouts_keep_theirs(tiny_model):
    from flowrl.rollout.sampling import ode_sample

    model = tiny_model
    before = (model.height, model.width, model.latent_shape)
    with model.sized(32, 48):
        assert model.latent_shape[1:] == (32 // model.vae_scale_factor, 48 // model.vae_scale_factor)
        images = ode_sample(model, ["a red circle"], [3], 2)
    assert tuple(images.shape) == (1, 3, 32, 48)
    assert (model.height, model.width, model.latent_shape) == before  # restored for the next rollout
    assert tuple(ode_sample(model, ["a red circle"], [3], 2).shape) == (1, 3, before[0], before[1])
    with pytest.raises(RuntimeError), model.sized(32, 32):  # restored after a failure inside the block too
        raise RuntimeError("inside")
    assert (model.height, model.width) == before[:2]


@pytest.mark.parametrize(
    "size, words", [((128, 16), ["128×16", "at most 64 pixels a side"]), ((17, 16), ["17×16", "multiples of"])]
)
def test_a_size_the_transformer_cannot_take_is_refused_naming_the_keys(tiny_model, size, words):
    with pytest.raises(ConfigError) as e:
        with tiny_model.sized(*size):
            pass
    assert "eval.height/eval.width" in str(e.value) and all(w in str(e.value) for w in words)


def test_a_run_evaluates_at_eval_height_and_width(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    import flowrl.rollout.scoring as scoring
    import flowrl.training.evaluation as evaluation

    seen = {"eval": set(), "rollout": set()}
    score_images, decode = evaluation.score_images, scoring.decode

    def eval_spy(images, *a, **k):
        seen["eval"].add(tuple(images.shape[-2:]))
        return score_images(images, *a, **k)

    def rollout_spy(model, latents, max_batch):
        images = decode(model, latents, max_batch)
        seen["rollout"].add(tuple(images.shape[-2:]))
        return images

    monkeypatch.setattr(evaluation, "score_images", eval_spy)
    monkeypatch.setattr(scoring, "decode", rollout_spy)
    assert (
        main(
            [
                "train",
                *tiny_args(tiny_folder, tmp_path),
                "train.max_steps=1",
                "eval.height=32",
                "eval.width=48",
                "eval.default_guidance=false",
                "train.checkpoint_every=0",
            ]
        )
        == 0
    )
    assert seen == {"eval": {(32, 48)}, "rollout": {(16, 16)}}
    assert (tmp_path / "run" / "samples" / "after.png").is_file()


def test_a_run_refuses_an_eval_size_the_model_cannot_take_before_training(tiny_folder, tmp_path, capsys):  # noqa: F811
    assert main(["train", *tiny_args(tiny_folder, tmp_path), "train.max_steps=1", "eval.height=256"]) == 2
    err = capsys.readouterr().err
    assert "eval.height/eval.width = 256×16" in err and "at most 64" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sample_draws_at_the_eval_size(tiny_folder, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    assert (
        main(
            [
                "sample",
                "--config",
                "configs/shapes/grpo.yaml",
                "--num",
                "1",
                "--steps",
                "2",
                "--prompt",
                "a red circle",
                "--out",
                str(out),
                f"model.path={tiny_folder}",
                "model.family=sd3",
                "eval.height=32",
                "eval.width=48",
            ]
        )
        == 0
    )
    assert Image.open(out / "000-a_red_circle.png").size == (48, 32)
