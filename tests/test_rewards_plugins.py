"""Custom reward plugins (module path, file path, errors), MultiReward and BackgroundScorer."""

import sys
import textwrap
import threading
import time

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl_rewards import REGISTRY, MultiReward, Reward, RewardSpec, build_reward, register
from flowrl_rewards.background import BackgroundScorer
from flowrl_rewards.core.registry import resolve_reward_class

PLUGIN = textwrap.dedent('''
    import torch
    from flowrl_rewards import Reward

    class MyReward(Reward):
        """Mean of one channel times a factor."""
        def __init__(self, channel: int = 0, factor: float = 1.0):
            self.channel, self.factor = channel, factor
        def score(self, images, prompts, meta):
            return self.factor * images[:, self.channel].mean(dim=(1, 2))

    class NotAReward:
        pass
''')


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "flowrl_test_plugin_mod.py").write_text(PLUGIN)
    (tmp_path / "needs_missing_dep.py").write_text("import surely_not_installed_pkg_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for mod in ("flowrl_test_plugin_mod", "needs_missing_dep"):
        sys.modules.pop(mod, None)


def _x(b=3):
    return torch.rand(b, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_plugin_by_module_path(plugin_dir):
    r = build_reward("flowrl_test_plugin_mod:MyReward", channel=1, factor=2.0)
    assert r.name == "MyReward"
    x = _x()
    assert torch.allclose(r(x, ["a"] * 3), 2 * x[:, 1].mean(dim=(1, 2)))


def test_plugin_by_file_path(plugin_dir):
    path = plugin_dir / "flowrl_test_plugin_mod.py"
    cls = resolve_reward_class(f"{path}:MyReward")
    assert resolve_reward_class(f"{path}:MyReward") is cls  # imported once per file
    r = build_reward(f"{path}:MyReward")
    assert torch.allclose(r(_x(), ["a"] * 3), _x()[:, 0].mean(dim=(1, 2)))


def test_plugin_errors_are_clear(plugin_dir):
    with pytest.raises(ModuleNotFoundError, match="no module named 'no_such_pkg.mod'"):
        build_reward("no_such_pkg.mod:R")
    with pytest.raises(ModuleNotFoundError, match="needs 'surely_not_installed_pkg_xyz'"):
        build_reward("needs_missing_dep:R")
    with pytest.raises(AttributeError, match="has no class 'Missing'"):
        build_reward("flowrl_test_plugin_mod:Missing")
    with pytest.raises(TypeError, match="not a subclass of flowrl_rewards.Reward"):
        build_reward("flowrl_test_plugin_mod:NotAReward")
    path = plugin_dir / "flowrl_test_plugin_mod.py"
    with pytest.raises(AttributeError, match=r"no class 'Missing'.*\['MyReward'"):
        build_reward(f"{path}:Missing")
    with pytest.raises(TypeError, match="not a subclass"):
        build_reward(f"{path}:NotAReward")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_reward(f"{plugin_dir}/nope.py:MyReward")
    with pytest.raises(
        ConfigError,
        match=r"colour=1 is not a key of reward 'flowrl_test_plugin_mod:MyReward' "
        r"\(MyReward\); accepted: \['channel', 'factor'\]",
    ):
        build_reward("flowrl_test_plugin_mod:MyReward", colour=1)
    with pytest.raises(KeyError, match="did you mean 'brightness'"):
        build_reward("brightnes")
    with pytest.raises(ValueError, match="'package.module:Class'"):
        build_reward("flowrl_test_plugin_mod:")


def test_register_validates():
    class Local(Reward):
        def score(self, images, prompts, meta):
            return images.mean(dim=(1, 2, 3))

    register("flowrl_test_local", Local)
    try:
        assert isinstance(build_reward("flowrl_test_local"), Local)
    finally:
        REGISTRY.pop("flowrl_test_local")
    with pytest.raises(TypeError):
        register("bad", object)
    with pytest.raises(ValueError):
        register("bad", "no_colon")
    for name in (
        "clip_score",
        "pickscore",
        "hpsv2",
        "imagereward",
        "aesthetic",
        "remote",
        "jpeg_compressibility",
        "jpeg_incompressibility",
    ):
        assert name in REGISTRY


def test_multireward_weights_labels_and_normalisation():
    m = MultiReward(
        [
            {"name": "brightness", "weight": 2.0},
            RewardSpec("redness", weight=-1.0),
            {"name": "jpeg_incompressibility", "weight": 0.5, "kwargs": {"quality": 80}, "label": "jpeg80"},
        ]
    )
    x = _x(4)
    comps = m.components(x, ["a"] * 4)
    assert list(comps) == ["brightness", "redness", "jpeg80"]
    expected = 2 * comps["brightness"] - comps["redness"] + 0.5 * comps["jpeg80"]
    assert torch.allclose(m(x, ["a"] * 4), expected)
    z = MultiReward(["brightness", "redness"], weights=[1.0, 1.0], normalize="batch")
    c = z.components(x, ["a"] * 4)
    total = z.combine(c)
    zs = [(v - v.mean()) / v.std(unbiased=False) for v in c.values()]
    assert torch.allclose(total, zs[0] + zs[1], atol=1e-5)
    flat = z.combine({"brightness": torch.ones(4), "redness": torch.tensor([1.0, float("nan"), 3.0, 5.0])})
    # brightness has zero spread → contributes 0; redness z-scored over its finite values; NaN stays NaN
    assert torch.isnan(flat[1]) and flat[2] == 0 and torch.isfinite(flat[[0, 3]]).all()
    with pytest.raises(ValueError, match="unique"):
        MultiReward(["brightness", "brightness"])
    with pytest.raises(ValueError, match="normalize='rank'"):
        MultiReward(["brightness"], normalize="rank")
    with pytest.raises(ValueError, match="unknown: \\['wieght'\\]"):
        MultiReward([{"name": "brightness", "wieght": 2}])
    single = MultiReward.from_config({"name": "saturation", "kwargs": {}})
    assert [r.name for r in single.rewards] == ["saturation"]
    assert [r.name for r in MultiReward.from_config(["brightness", {"name": "redness"}]).rewards] == [
        "brightness",
        "redness",
    ]


class Slow(Reward):
    name = "slow"

    def __init__(self, delay=0.3):
        self.delay, self.threads = delay, []

    def score(self, images, prompts, meta):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        meta["slow/seen"] = len(prompts)
        return images.mean(dim=(1, 2, 3))


def test_background_scorer_overlaps_and_returns_components():
    slow = Slow()
    m = MultiReward([slow, build_reward("redness")])
    x = _x(2)
    meta = {}
    with BackgroundScorer(m) as scorer:
        t = time.monotonic()
        fut = scorer.submit(x, ["a", "b"], meta)
        assert time.monotonic() - t < 0.15 and not fut.done()  # returned before scoring finished
        comps = fut.result(timeout=10)
    assert set(comps) == {"slow", "redness"}
    assert torch.allclose(comps["slow"], x.mean(dim=(1, 2, 3)))
    assert meta["slow/seen"] == 2
    assert slow.threads[0].startswith("reward-scorer") and slow.threads[0] != threading.current_thread().name
    with pytest.raises(RuntimeError, match="after close"):
        scorer.submit(x, ["a", "b"])


def test_background_scorer_keeps_order_errors_and_sync_mode():
    class Fails(Reward):
        name = "fails"

        def score(self, images, prompts, meta):
            raise ValueError("bad batch")

    scorer = BackgroundScorer(Slow(delay=0.05))
    futs = [scorer.submit(_x(1) * 0 + i / 10, ["a"]) for i in range(3)]
    assert [f.result(timeout=10)["slow"].item() for f in futs] == pytest.approx([0.0, 0.1, 0.2])
    scorer.close()
    bad = BackgroundScorer(Fails())
    with pytest.raises(ValueError, match="bad batch"):
        bad.submit(_x(1), ["a"]).result(timeout=10)
    bad.close()
    sync = BackgroundScorer(Slow(delay=0.0), enabled=False)
    fut = sync.submit(_x(1), ["a"])
    assert fut.done() and sync.reward.threads == [threading.current_thread().name]
    with pytest.raises(ValueError, match="bad batch"):
        BackgroundScorer(Fails(), enabled=False).submit(_x(1), ["a"]).result()
    assert BackgroundScorer(Slow(), enabled="auto").enabled == torch.cuda.is_available()
    with pytest.raises(ValueError, match="enabled='yes'"):
        BackgroundScorer(Slow(), enabled="yes")


def test_docs_worked_example_runs(tmp_path):
    """The plugin example in docs/rewards.md, loaded by file path as the docs say."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class ColourMatch" in b)
    (tmp_path / "colour.py").write_text(code)
    r = build_reward(f"{tmp_path / 'colour.py'}:ColourMatch", rgb=[0.0, 0.0, 1.0])
    blue = torch.zeros(2, 3, 4, 4)
    blue[:, 2] = 1
    meta = {}
    assert torch.allclose(r(blue, ["a", "b"], meta), torch.ones(2)) and meta["colour_match/mean_dist"] == 0
    assert r.name == "colour_match"
