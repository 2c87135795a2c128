"""A model family is one adapter module plus its data (issue 62): the estimate's modules name no family, and a family
registered out of tree (here: an SD3 adapter subclass under a new name, its architecture a saved tiny pipeline
folder) gets ``flowrl bench --estimate``, :func:`flowrl.estimate.estimate` and ``train.fit: auto``."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from flowrl.models import MODEL_FAMILIES, ModelFamily, register_model_family
from flowrl.models.sd3 import SD3FlowModel

ESTIMATE = Path(__file__).resolve().parents[1] / "flowrl" / "estimate"


class OutOfTreeSD3(SD3FlowModel):
    """An adapter declared outside flowrl: it inherits SD3's estimate data (``estimate_spec``)."""


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from flowrl.models.testing.sd3 import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("oot") / "pipe"
    tiny_sd3_pipeline().save_pretrained(folder)
    register_model_family("oot_sd3", ModelFamily(None, OutOfTreeSD3))
    try:
        yield folder
    finally:
        MODEL_FAMILIES.pop("oot_sd3", None)


def _overrides(folder) -> list[str]:
    return [
        "model.family=oot_sd3",
        f"model.path={folder}",
        "model.height=32",
        "model.width=32",
        "prompts.per_step=2",
        "rollout.max_batch=4",
    ]


def family_strings(source: str) -> set[str]:
    """The registered family names among the string literals of ``source``, a report section's key (a dict literal's
    key whose value is a dict literal: the estimate's ``"shapes": {...}``) left out."""
    tree = ast.parse(source)
    sections = {
        id(key)
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for key, value in zip(node.keys, node.values)
        if isinstance(value, ast.Dict)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in MODEL_FAMILIES and id(node) not in sections
    }


@pytest.mark.parametrize("name", ["inputs.py", "iteration.py", "iteration_work.py", "iteration_memory.py", "archs.py"])
def test_the_estimate_modules_name_no_family(name):
    named = family_strings((ESTIMATE / name).read_text())
    assert not named, f"flowrl/estimate/{name} names the families {named}: their data belongs to their adapters"


def test_an_out_of_tree_family_gets_an_estimate_and_a_fit(family):
    from flowrl.estimate import estimate, load_config
    from flowrl.estimate.fit import fit_config

    cfg = load_config(None, _overrides(family))
    result = estimate(cfg, target="cpu")
    assert result["family"] == "oot_sd3" and result["memory_gib"]["peak"] > 0
    # SD3's data, inherited: the CLIP tokens join the adapter's default 16 tokens; the tiny VAE: 2 px a cell
    assert result["shapes"]["text_tokens"] > 16 and result["shapes"]["latent"][-2:] == [16, 16]
    fit = fit_config(cfg, "H100")
    assert fit.peak_gib <= fit.budget_gib


def test_flowrl_bench_estimate_on_an_out_of_tree_family(family, capsys):
    from flowrl.commands.main import main

    assert main(["bench", "--estimate", "--json", "--gpu", "H100", *_overrides(family), "train.fit=auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_gib"] <= out["fit"]["budget_gib"]
