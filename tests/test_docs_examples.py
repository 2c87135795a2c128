"""Every code example of README.md and docs/*.md runs (issue 26).

``test_python_block``: each ```python block is executed as a module of its own, in a fresh temporary
working directory (with a ``configs`` link to the repository's presets, so relative preset paths resolve as
they do from a checkout; nothing lands in the repository). A block that raises fails the test. A block that
needs a GPU or the model hub runs with the substitutions below, applied to its text by this test (each one
must match, so the table cannot go stale):

| in the docs | run here as | why |
|---|---|---|
| ``StableDiffusion3Pipeline.from_pretrained("<hub id>", ...)`` | ``tiny_sd3_pipeline()`` (models/testing) | no hub |
| ``device="cuda"`` | ``device="cpu"`` | no GPU |
| ``torch.bfloat16`` / ``dtype="bf16"`` | ``torch.float32`` / ``dtype="fp32"`` | bf16 is ~5× slower on CPU |
| ``TrainConfig.from_yaml(GPU preset)`` (sd35, flux, sana) | + :data:`GPU_PRESET_OVERRIDES` | a GPU job's data, sizes |
| rewards ``pickscore``, ``hpsv2`` by name | :func:`offline_stand_in` under the same names | weights from the hub |

(The stand-ins check the keywords they are built with against the real class's signature and score with
image statistics.)

Blocks that are fragments (they use names a surrounding text defines) get a short prelude
(:data:`PRELUDES`); some get a few assertions of what their comments promise (:data:`CHECKS`). Block ids
are ``FILE:LINE`` with LINE the line of the opening fence.

``test_flowrl_commands``: each ```bash block made only of ``flowrl`` commands (plus shell variables and
loops) is run by bash with ``flowrl`` replaced by a recorder; every recorded command is then parsed by the
CLI's own parser and its configuration (preset, overrides, ``--vs``/``--vs-set``, ``compare``'s
``LABEL=CONFIG`` and ``--set``) is loaded and validated as the command would, without training. Synopsis
lines with placeholders (``[CONFIG]``, ``OTHER``) are only parsed. Blocks with other commands (pip,
accelerate, torchrun, python scripts) are not run.
"""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flowrl.paths import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    file: str  # relative to the repository root
    line: int  # line of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file (``` or ~~~ fences, possibly indented)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]]
        blocks.append(Block(str(path.relative_to(ROOT)), i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for f in DOC_FILES for b in extract_blocks(f)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]
SLOW_BLOCKS = {
    "RewardServerProcess(": "starts a real reward server (3–6 s of two processes importing torch); the same calls "
    "(RewardServerProcess, build_reward('remote', url=...), health()) run in the default set in "
    "tests/test_rewards_remote.py::test_remote_matches_local_reward_in_batches",
}
"""Blocks run in the slow set only (`pytest -m slow`): a text their code holds → why, and the cheaper test that
holds the same behaviour."""
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")]

# ---- substitutions: (regex, replacement, why); applied to every block, each must match somewhere -------------
GPU_PRESET_OVERRIDES = [
    "prompts.train=a photo of a cat|a red circle left of a blue square",
    "prompts.eval=null",
    "prompts.per_step=2",
    "rollout.group_size=2",
    "rollout.steps=2",
    "rollout.max_batch=8",
    "train.max_steps=1",
    "train.log_with=none",
    "train.checkpoint_every=0",
    "train.num_threads=1",
    "train.progress=false",
]
"""A GPU preset cut to one tiny iteration on the tiny in-process pipeline (its own prompt files are a
dataset download; everything else, the method, stays the preset's)."""

SUBSTITUTIONS = [
    (
        r'StableDiffusion3Pipeline\.from_pretrained\("[\w.-]+/[\w.-]+"[^)\n]*\)',
        '__import__("flowrl.models.testing", fromlist=["_"]).tiny_sd3_pipeline()',
        "no hub: the tiny SD3 pipeline",
    ),
    (r'device="cuda(:\d+)?"', 'device="cpu"', "no GPU"),
    (r"torch\.bfloat16", "torch.float32", "bf16 is slow on CPU"),
    (r'dtype="bf16"', 'dtype="fp32"', "bf16 is slow on CPU"),
    (
        r'TrainConfig\.from_yaml\(("configs/(?:sd35|flux|sana)/[\w.]+\.yaml")\)',
        r"TrainConfig.from_yaml(\1, GPU_PRESET_OVERRIDES)",
        "a GPU preset, cut to one tiny iteration",
    ),
]


def offline_stand_in(name: str, score):
    """A reward registered as ``name`` for the docs' blocks: built with the real class's keywords (checked
    against its signature, so a wrong keyword in the docs fails), scoring with ``score(images)``."""
    from flowrl_rewards.core.registry import resolve_reward_class

    real = resolve_reward_class(name)  # imports the module only; its models load in __init__, not called here

    class StandIn(real):
        def __init__(self, **kwargs):
            inspect.signature(real).bind(**kwargs)

        def score(self, images, prompts, meta):
            return score(images.float())

    StandIn.__name__ = StandIn.__qualname__ = f"Offline{real.__name__}"
    return StandIn


STAND_INS = {"pickscore": lambda x: x.mean(dim=(1, 2, 3)), "hpsv2": lambda x: x.std(dim=(1, 2, 3))}

HUB_LEFT = re.compile(r'from_pretrained\("[\w.-]+/[\w.-]+"')

# ---- fragments: (file, a snippet of the block) → code run before it -----------------------------------------
_IMAGES = (
    "import torch\nimages = torch.rand(4, 3, 16, 16)\n"
    "prompts = ['a red circle'] * 2 + ['two blue squares'] * 2\nmeta = {}\n"
)
PRELUDES = {
    ("docs/rewards.md", "scores = reward(images, prompts, meta)"): _IMAGES
    + "from flowrl_rewards import build_reward\nreward = build_reward('brightness')\n",
    ("docs/rewards.md", "BackgroundScorer(multi_reward"): _IMAGES
    + "from flowrl_rewards import MultiReward\nmulti_reward = MultiReward(['brightness', 'redness'])\n",
    ("docs/rewards.md", "m.components(images, prompts, meta)"): _IMAGES,
}

# ---- what a block's comments promise, checked after it: (file, snippet) → code -------------------------------
CHECKS = {
    (
        "README.md",
        'flowrl.sample(model, ["a photo of a cat"]',
    ): "assert out.images.shape[0] == 8 and 0 <= out.images.min() and out.images.max() <= 1\n"
    "assert trainer.step == 1\n",
    ("README.md", "pipe.load_lora_weights(checkpoint)"): "assert tuple(out.images.shape) == (4, 3, 32, 32)\n"
    "assert (checkpoint / 'pytorch_lora_weights.safetensors').is_file()\n"
    "assert image.size == (32, 32)\n"
    # the LoRA loaded by plain diffusers is the trained policy: same transformer output as the trained model
    "args = dict(hidden_states=torch.randn(2, 4, 16, 16), encoder_hidden_states=torch.randn(2, 24, 128),\n"
    "            pooled_projections=torch.randn(2, 64), timestep=torch.tensor([300.0, 700.0]))\n"
    "with torch.no_grad():\n"
    "    trained, loaded = model.pipe.transformer(**args).sample, pipe.transformer(**args).sample\n"
    "assert torch.allclose(trained, loaded, atol=1e-5), (trained - loaded).abs().max()\n",
    (
        "docs/explore.md",
        "Explore(inner={",
    ): "assert tuple(out.images.shape) == (16, 3, 32, 32)\nassert len(out.forest.roots()) == 16\n",
    (
        "docs/trees.md",
        "flowrl.Tree(steps=20",
    ): "assert out.images.shape[0] == 32\nassert torch.isfinite(out.forest.advantage[out.forest.edges()]).all()\n",
    (
        "docs/rewards.md",
        "scores = reward(images, prompts, meta)",
    ): "assert scores.dtype == torch.float32 and tuple(scores.shape) == (4,)\n",
    (
        "docs/rewards.md",
        "class ColourMatch(Reward)",
    ): "s = ColourMatch()(torch.rand(2, 3, 8, 8), ['a', 'b'], {})\nassert tuple(s.shape) == (2,)\n",
    ("docs/rewards.md", "BackgroundScorer(multi_reward"): "assert set(components) == {'brightness', 'redness'}\n",
}


def _lookup(table: dict, block: Block) -> str:
    hits = [v for (f, snippet), v in table.items() if f == block.file and snippet in block.code]
    return "".join(hits)


def prepare(block: Block) -> tuple[str, str, str]:
    """(prelude, the block's code as this test runs it, checks): substitutions applied line by line, so
    line numbers stay those of the docs file."""
    code = block.code
    for pattern, repl, _ in SUBSTITUTIONS:
        code = re.sub(pattern, repl, code)
    assert code.count("\n") == block.code.count("\n"), "a substitution must not add or remove lines"
    left = HUB_LEFT.search(code)
    if left:
        raise AssertionError(f"{block.id} loads {left.group(0)}... from the hub: add a substitution to this test")
    return _lookup(PRELUDES, block), code, "import torch\n" + _lookup(CHECKS, block)


def test_tables_match_the_docs():
    """Every substitution, prelude and check still matches a block: the tables follow the docs."""
    assert len(PYTHON_BLOCKS) >= 10, [b.id for b in PYTHON_BLOCKS]
    for pattern, _, why in SUBSTITUTIONS:
        assert any(re.search(pattern, b.code) for b in PYTHON_BLOCKS), f"{pattern!r} ({why}) matches no block"
    for table in (PRELUDES, CHECKS):
        for f, snippet in table:
            n = sum(b.file == f and snippet in b.code for b in PYTHON_BLOCKS)
            assert n == 1, f"{f}: {snippet!r} matches {n} python blocks (expected 1)"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A temporary working directory with ``configs`` linked in; global registries and torch threads restored."""
    from flowrl.core import components
    from flowrl.models import MODEL_FAMILIES
    from flowrl.rollout import sde
    from flowrl_rewards import REGISTRY

    (tmp_path / "configs").symlink_to(CONFIG_DIR, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    registries = [k.registry for k in components.KINDS] + [MODEL_FAMILIES, REGISTRY, sde.KERNEL_FUNCTIONS]
    saved, kernels = [dict(r) for r in registries], sde.KERNELS
    for name, score in STAND_INS.items():
        REGISTRY[name] = offline_stand_in(name, score)
    threads, modules = torch.get_num_threads(), set(sys.modules)
    yield tmp_path
    for reg, old in zip(registries, saved):
        reg.clear()
        reg.update(old)
    components.section_schema.cache_clear()
    sde.KERNELS = kernels
    torch.set_num_threads(threads)
    for name in set(sys.modules) - modules:
        if name.startswith("docs_block_"):
            del sys.modules[name]


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=pytest.mark.slow) if any(k in b.code for k in SLOW_BLOCKS) else b for b in PYTHON_BLOCKS],
    ids=[b.id for b in PYTHON_BLOCKS],
)
def test_python_block(block: Block, sandbox):
    prelude, code, checks = prepare(block)
    name = "docs_block_" + re.sub(r"\W", "_", block.id)
    module = types.ModuleType(name)  # a real module, so dataclasses and pickling in the block work
    module.__dict__["GPU_PRESET_OVERRIDES"] = list(GPU_PRESET_OVERRIDES)
    sys.modules[name] = module
    exec(compile(prelude, f"{block.id} (prelude)", "exec"), module.__dict__)
    # padded to its place in the docs file: a traceback names the file and line of the docs
    exec(compile("\n" * block.line + code, str(ROOT / block.file), "exec"), module.__dict__)
    exec(compile(checks, f"{block.id} (checks)", "exec"), module.__dict__)


# ---- bash: flowrl commands, parsed and their configs loaded ------------------------------------------------
PLACEHOLDERS = {"[CONFIG]", "CONFIG", "OTHER", "A.yaml", "B=b.yaml", "[key=value", "...]", "[--batches"}
"""Words of synopsis lines (README "Commands"): such a command is only parsed."""

# Files a page tells the reader to create, made before its commands run: (file, snippet of a block) → name.
PAGE_FILES = {
    ("docs/extending.md", "class ProbedChains(RolloutPlan)"): "probed_method.py",
    ("docs/extending.md", "plan: probed_method.py:ProbedChains"): "method.yaml",
}

_SHELL_WORD = re.compile(r"^\s*(#.*)?$|^\s*(\w+=\S*\s+)*flowrl\s|^\s*\w+=|^\s*for\s.*;\s*do\s*$|^\s*done\s*$")


def flowrl_only(block: Block) -> bool:
    """Whether every command of a bash block is ``flowrl`` (or a variable assignment / a for loop)."""
    joined = re.sub(r"\\\n", " ", block.code)
    lines = [ln for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return (
        bool(lines)
        and any(re.search(r"(^|\s)flowrl\s", ln) for ln in lines)
        and all(_SHELL_WORD.match(ln) and not re.search(r"&&|\|\||;(?!\s*do)|\|", ln.split("#")[0]) for ln in lines)
    )


FLOWRL_BLOCKS = [b for b in BASH_BLOCKS if flowrl_only(b)]

BASH_NOT_RUN = {
    ("docs/gpu.md", "pip install -e '.[rewards,quant,tensorboard,test]'"): "installs the GPU environment",
    ("docs/gpu.md", "for c in configs/sd35/*.yaml"): "one iteration of every GPU preset, on a GPU",
    ("docs/gpu.md", "accelerate launch --config_file configs/accelerate/ddp.yaml"): "several processes on GPUs",
    ("docs/gpu.md", "# SD3.5-M LoRA, sharded over 8 GPUs"): "sharded launches on GPUs / gloo: tests/test_sharding.py",
    ("docs/gpu.md", "--num_machines M --machine_rank r"): "several machines",
    ("docs/video.md", "configs/wan/flow_grpo_14b_cp.yaml"): "8 GPUs / gloo: tests/test_context_parallel.py",
    ("README.md", "pip install -e . && flowrl train"): "installs the package, trains the full job, runs the suite",
    ("README.md", "accelerate launch --config_file"): "several processes on GPUs / gloo: tests/test_distributed.py",
    (
        "docs/rewards.md",
        "python -m flowrl_rewards.serving.serve imagereward",
    ): "a reward server in another environment, on a GPU",
    (
        "docs/rewards.md",
        "python -m flowrl_rewards.serving.serve NAME",
    ): "the reward server's synopsis: tests/test_rewards_remote.py",
    ("docs/shapes.md", "scripts/pretrain_shapes.py"): "30 minutes of pretraining",
    ("docs/pipeline.md", "train.rollout_processes=1"): "launched rollout processes: 3 gloo processes in "
    "tests/test_pipeline_layout.py; the asynchronous main job: tests/test_pipeline.py",
    ("docs/results.md", "time flowrl rollouts configs/shapes/gdro.yaml"): "a rollout store written, then replayed by "
    "its compare: tests/test_offline_plan.py and tests/test_gdro.py run both steps",
    ("docs/results.md", "--budget minutes=5.2"): "replays the rollout store the block above writes (not here)",
}
"""Bash blocks with other commands than ``flowrl``, and why they are not run: every bash block is either
checked by :func:`test_flowrl_commands` or listed here."""


def recorded_commands(block: Block, cwd: Path) -> list[list[str]]:
    """The argv of every ``flowrl`` call of the block, with the shell's own expansion."""
    record = cwd / "flowrl_calls"
    out = shlex.quote(str(record))
    script = f'flowrl() {{ printf "%s\\0" "$@" >> {out}; printf "\\n\\0" >> {out}; }}\n'
    subprocess.run(["bash", "-euc", script + block.code], cwd=cwd, check=True, timeout=30)
    calls, current = [], []
    for word in record.read_bytes().decode().split("\0")[:-1]:
        if word == "\n":
            calls.append(current)
            current = []
        else:
            current.append(word)
    return calls


def check_command(argv: list[str]) -> None:
    """Parse ``argv`` as ``flowrl`` does and load every configuration it names, as the command would."""
    from flowrl.commands.common import load_config as _load_config
    from flowrl.commands.common import split_config_arg as _split_config_arg
    from flowrl.commands.main import parse_args

    argv = [a for a in argv if a not in ("--help", "-h", "--debug")]
    args = parse_args(argv)
    if any(w in PLACEHOLDERS for w in argv):
        return
    if args.command in ("train", "bench", "snr"):
        config, overrides = _split_config_arg(args.config, args.overrides)
        _load_config(config, overrides)
        if getattr(args, "vs", None):
            _load_config(args.vs, args.vs_set or [])
    elif args.command == "compare":
        configs = [w for w in args.items if w.endswith((".yaml", ".yml"))]
        overrides = [w for w in args.items if w not in configs]
        assert configs, f"flowrl compare without a config: {argv}"
        sets: dict[str, list[str]] = {}
        for label, item in args.set or []:
            sets.setdefault(label, []).append(item)
        for spec in configs:
            label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).stem, "", spec)
            _load_config(path, overrides + sets.pop(label, []))
        assert not sets, f"--set names labels {sorted(sets)} that no config has"
    elif getattr(args, "config", None):  # sample / eval with --config; their --checkpoint runs/... needs a trained run
        _load_config(args.config, args.overrides)


def test_every_bash_block_is_checked_or_listed():
    for block in BASH_BLOCKS:
        listed = [why for (f, snippet), why in BASH_NOT_RUN.items() if f == block.file and snippet in block.code]
        assert (block in FLOWRL_BLOCKS) + len(listed) == 1, (
            f"{block.id}: a bash block is either only flowrl commands (checked) or listed in BASH_NOT_RUN"
        )
    for f, snippet in [*BASH_NOT_RUN, *PAGE_FILES]:
        assert any(b.file == f and snippet in b.code for b in ALL_BLOCKS), f"{f}: {snippet!r} matches no block"


@pytest.mark.parametrize("block", FLOWRL_BLOCKS, ids=[b.id for b in FLOWRL_BLOCKS])
def test_flowrl_commands(block: Block, sandbox):
    for (f, snippet), name in PAGE_FILES.items():
        for b in ALL_BLOCKS:
            if b.file == f == block.file and snippet in b.code:
                (sandbox / name).write_text(b.code)
    calls = recorded_commands(block, sandbox)
    assert calls, f"{block.id}: no flowrl command recorded"
    for argv in calls:
        try:
            check_command(argv)
        except SystemExit as e:
            raise AssertionError(f"{block.id}: `flowrl {shlex.join(argv)}` does not parse (exit {e.code})") from None
        except Exception as e:
            raise AssertionError(f"{block.id}: `flowrl {shlex.join(argv)}`: {type(e).__name__}: {e}") from e
