"""Sharing what was trained (issue 64, docs/sharing.md): the model card of an export, read back with huggingface_hub's
own parser, and its upload (``flowrl export --push-to-hub``, ``train.push_to_hub``) against a local stand-in for the
Hub's HTTP API (:class:`StandInHub`, ``HF_ENDPOINT`` on 127.0.0.1) that records every request and every file a commit
carries: which files are sent, that the token travels only in the request headers, and that every failure (no token,
someone else's repo, no network) is one line that keeps the local export."""

from __future__ import annotations

import base64
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from PIL import Image

from flowrl.commands.main import main
from flowrl.config.schema import TrainConfig
from flowrl.config.secrets import REDACTED

TOKEN = "hf_standInToken0123456789abcdefXYZ"
KEY = "sk-card-secret-0123456789"
EXPORTED = {"README.md", "config.yaml", "after.png", "pytorch_lora_weights.safetensors"}
RUN_ARGS = [
    "configs/shapes/grpo.yaml",
    "train.max_steps=1",
    "prompts.per_step=2",
    "rollout.group_size=2",
    "rollout.steps=4",
    "eval.steps=2",
    "eval.grid_prompts=2",
    "prompts.eval=a red circle|a blue square",
    "model.lora.rank=4",
    "train.progress=false",
]


# ---- the stand-in Hub ---------------------------------------------------------------------------------------------
class StandInHub:
    """A tiny HTTP server answering what ``create_repo``, ``create_branch`` and ``create_commit`` (its card check,
    preupload and commit) call, every file in "regular" mode so a commit carries the files' bytes. ``forbid``: the repo
    is someone else's (creating and writing answer 403, reading it answers 200)."""

    def __init__(self, forbid: bool = False):
        self.forbid = forbid
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self.created: list[dict] = []
        self.branches: list[str] = []
        self.commits: list[tuple[str, dict[str, bytes]]] = []  # (revision, path in repo → bytes)
        self.validated: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("X-Error-Message", body.get("error", ""))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                path = unquote(urlsplit(self.path).path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append((method, path, self.headers.get("Authorization")))
                base = f"http://127.0.0.1:{self.server.server_port}"
                if method == "POST" and path == "/api/repos/create":
                    payload = json.loads(body)
                    hub.created.append(payload)
                    if hub.forbid:
                        return self._answer(403, {"error": f"You cannot create a repo in {payload['organization']}"})
                    return self._answer(200, {"url": f"{base}/{payload['organization']}/{payload['name']}"})
                if method == "POST" and path == "/api/validate-yaml":
                    hub.validated.append(json.loads(body)["content"])
                    return self._answer(200, {"errors": [], "warnings": []})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(preupload|commit|branch)/(.+))?", path)
                if m is None:
                    return self._answer(404, {"error": f"no route {method} {path}"})
                repo, action, revision = m.groups()
                if method == "GET" and action is None:
                    return self._answer(200, {"id": repo, "sha": "0" * 40, "private": False})
                if hub.forbid:
                    return self._answer(403, {"error": f"You don't have the rights to write to {repo}"})
                if action == "branch":
                    hub.branches.append(revision)
                    return self._answer(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._answer(200, {"files": modes})
                if action == "commit":
                    sent = {}
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        assert item["key"] in ("header", "file"), item  # regular files only
                        if item["key"] == "file":
                            sent[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    hub.commits.append((revision, sent))
                    url = f"{base}/{repo}/commit/{'1' * 40}"
                    return self._answer(200, {"commitUrl": url, "commitOid": "1" * 40, "pullRequestUrl": None})
                return self._answer(404, {"error": f"no route {method} {path}"})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def online(monkeypatch, tmp_path):
    """The Hub reachable (the suite runs with HF_HUB_OFFLINE=1), no saved login, HF_TOKEN set to :data:`TOKEN`."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))  # its own fetch
    for name in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return constants


def point_at(server: StandInHub, monkeypatch) -> None:
    """``HF_ENDPOINT`` names ``server``, as huggingface_hub reads it when imported (its ``constants.ENDPOINT``)."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)


@pytest.fixture
def hub(online, monkeypatch):
    server = StandInHub()
    point_at(server, monkeypatch)
    yield server
    server.close()


@pytest.fixture
def forbidding_hub(online, monkeypatch):
    server = StandInHub(forbid=True)
    point_at(server, monkeypatch)
    yield server
    server.close()


# ---- a run --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A one-iteration LoRA run of the shapes model (held-out evals before and after, after.png)."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", *RUN_ARGS, f"train.output_dir={out}", "train.name=tiny"]) == 0
    return out / "tiny"


def fake_run(tmp_path: Path, cfg: TrainConfig, evals: list[dict]) -> Path:
    """A run folder as the card reads it: config.yaml, metrics.jsonl (``evals`` with a training record between) and
    samples/after.png."""
    run_dir = tmp_path / "run"
    (run_dir / "samples").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    records = [evals[0], {"step": 1, "reward_mean": 0.4}, *evals[1:]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    Image.new("RGB", (8, 8), "red").save(run_dir / "samples" / "after.png")
    return run_dir


def keyed_cfg(tmp_path: Path, *overrides: str) -> TrainConfig:
    """A config whose training reward holds a secret (:data:`KEY`) in its kwargs, as a user's plugin may."""
    plugin = tmp_path / "keyed.py"
    plugin.write_text(
        "from flowrl_rewards import Reward\n\n\nclass Keyed(Reward):\n    name = 'keyed'\n\n"
        "    def __init__(self, api_key: str = '', scale: float = 1.0):\n        self.api_key = api_key\n\n"
        "    def score(self, images, prompts, meta):\n        return images.float().mean(dim=(1, 2, 3))\n"
    )
    term = f"[{{name: '{plugin}:Keyed', kwargs: {{api_key: {KEY}, scale: 2.0}}}}]"
    return TrainConfig.from_yaml(None, [f"rewards={term}", "eval.rewards=[{name: brightness}]", *overrides])


EVALS = [
    {"step": 0, "eval/brightness_mean": 0.25, "eval/brightness/n": 8.0, "eval/guidance": 4.5},
    {"step": 3, "eval/brightness_mean": 0.5, "eval/brightness/n": 8.0, "eval/guidance": 4.5},
]


# ---- the card -----------------------------------------------------------------------------------------------------
def test_the_card_says_what_was_trained_and_huggingface_hub_parses_it(tmp_path):
    from flowrl.run.model_card import write_card

    cfg = keyed_cfg(tmp_path, "model.family=sd3", "model.path=stabilityai/stable-diffusion-3.5-medium")
    assert cfg.rewards[0].kwargs["api_key"] == KEY  # the config in memory holds it
    run_dir = fake_run(tmp_path, cfg, EVALS)
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    card_path = write_card(folder, cfg, run_dir, step=3, last_step=3, guidance=4.5)

    meta = metadata_load(card_path)
    assert meta["base_model"] == "stabilityai/stable-diffusion-3.5-medium"
    assert meta["base_model_relation"] == "adapter" and meta["library_name"] == "diffusers"
    assert meta["pipeline_tag"] == "text-to-image"
    assert {"flowrl", "lora", "text-to-image", "reinforcement-learning"} <= set(meta["tags"])
    assert (meta["license"], meta["license_name"]) == ("other", "stabilityai-ai-community")
    assert meta["license_link"].startswith("https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/")
    assert meta["widget"][0]["output"]["url"] == "after.png" and (folder / "after.png").is_file()

    card = ModelCard.load(card_path)
    assert card.data.base_model == meta["base_model"]
    text = card.text
    assert "rollout plan `chains`" in text and "credit rule `group`" in text and "objective `clipped`" in text
    assert re.search(r"\| training \| `\S+:Keyed` \| 1 \| api_key: <redacted>, scale: 2\.0 \|", text)
    assert "| held-out eval | `brightness` | 1 |" in text
    assert "| `eval/brightness_mean` | 0.2500 | 0.5000 | +0.2500 |" in text and "8 held-out images" in text
    assert "`eval/brightness/n`" not in text  # counts are in the heading, not rows
    assert "![held-out prompts after training](after.png)" in text
    assert 'pipe = DiffusionPipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium"' in text
    assert 'pipe.load_lora_weights("REPO_ID")' in text and "guidance_scale=4.5" in text
    import flowrl

    assert f"flowrl-align=={flowrl.__version__}" in text and "flowrl train config.yaml" in text
    assert f"api_key: {REDACTED}" in text and "give it again" in text
    shared = (folder / "config.yaml").read_text()
    assert "push_to_hub: null" in shared and f"output_dir: {tmp_path}" not in shared
    for path in folder.iterdir():
        assert KEY.encode() not in path.read_bytes(), path


def test_a_full_fine_tune_card_loads_the_transformer_and_a_local_base_has_no_base_model(tmp_path):
    from flowrl.run.model_card import write_card

    local = tmp_path / "my-flux"
    local.mkdir()
    cfg = TrainConfig.from_yaml(None, ["model.family=flux", f"model.path={local}", "model.full_finetune=true"])
    run_dir = fake_run(tmp_path, cfg, EVALS[1:])
    (run_dir / "samples" / "after.png").unlink()  # a run without held-out prompts has no grid
    folder = tmp_path / "export"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    write_card(folder, cfg, run_dir, step=3, last_step=3, guidance=None, repo_id="me/flux-rl")

    meta = metadata_load(folder / "README.md")
    assert "base_model" not in meta and "license" not in meta and "base_model_relation" not in meta
    assert "widget" not in meta and not (folder / "after.png").exists()
    assert "full-finetune" in meta["tags"] and "lora" not in meta["tags"]
    text = ModelCard.load(folder / "README.md").text
    assert text.startswith("\n# flux-rl") or text.lstrip().startswith("# flux-rl")
    assert 'transformer = FluxTransformer2DModel.from_pretrained("me/flux-rl", subfolder="transformer"' in text
    assert 'DiffusionPipeline.from_pretrained("BASE_MODEL", transformer=transformer' in text
    assert "load_lora_weights" not in text and "guidance_scale" not in text
    assert "| metric | step 3 |" in text and "Read the base model's card for the license" in text
    assert "hf download me/flux-rl config.yaml" in text and "## Samples" not in text


def test_an_older_checkpoints_card_shows_its_own_eval_and_grid(tmp_path):
    """Exporting checkpoint step-2 of a run that went on to step 3: the eval up to step 2 and step 2's grid."""
    from flowrl.run.model_card import write_card

    cfg = TrainConfig.from_yaml(None, ["model.family=sd3", "model.path=stabilityai/stable-diffusion-3.5-large"])
    middle = {"step": 2, "eval/brightness_mean": 0.375, "eval/brightness/n": 8.0}
    run_dir = fake_run(tmp_path, cfg, [EVALS[0], middle, EVALS[1]])
    Image.new("RGB", (8, 8), "blue").save(run_dir / "samples" / "step-2.png")
    folder = tmp_path / "export"
    folder.mkdir()
    write_card(folder, cfg, run_dir, step=2, last_step=3)
    text = ModelCard.load(folder / "README.md").text
    assert "| `eval/brightness_mean` | 0.2500 | 0.3750 | +0.1250 |" in text and "after (step 2)" in text
    assert (folder / "after.png").read_bytes() == (run_dir / "samples" / "step-2.png").read_bytes()
    assert "exported at step 2" in text and "Trained for 2 iterations" in text


def test_a_video_family_is_tagged_text_to_video(tmp_path):
    from flowrl.run.model_card import build_card

    cfg = TrainConfig.from_yaml(None, ["model.family=wan", "model.path=Wan-AI/Wan2.1-T2V-1.3B-Diffusers"])
    card = build_card(cfg, fake_run(tmp_path, cfg, EVALS), tmp_path)
    assert card.data.pipeline_tag == "text-to-video" and "text-to-video" in card.data.tags
    assert card.data.license == "apache-2.0" and ").frames[0]" in card.text


# ---- flowrl export ------------------------------------------------------------------------------------------------
def test_export_writes_the_card_and_its_loading_code_loads_the_lora(run, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "with its model card (README.md)" in capsys.readouterr().out
    assert EXPORTED <= {p.name for p in out.iterdir()}
    meta = metadata_load(out / "README.md")
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # the shapes model ships with flowrl
    text = ModelCard.load(out / "README.md").text
    assert "| `eval/shapes_mean` |" in text and "before (step 0)" in text and "after (step 1)" in text
    code = re.search(r"## Use\n\n```\n(.*?)```", text, re.S).group(1)
    assert 'pipe.load_lora_weights("REPO_ID")' in code
    code = code.replace('"REPO_ID"', repr(str(out))).replace("two red circles", "a red circle")
    code = code.replace(").images[0]", ", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]")
    scope: dict = {}
    exec(compile(code, "card", "exec"), scope)  # the card's own code, with the folder for the repo
    assert scope["image"].size == (32, 32)
    lora = [n for n, p in scope["pipe"].transformer.named_parameters() if "lora" in n]
    assert lora  # the export's LoRA went into the transformer


def test_push_sends_the_export_in_one_commit_and_the_token_only_in_headers(run, tmp_path, hub, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--push-to-hub", "me/shapes-grpo", "--private"]) == 0
    printed = capsys.readouterr()
    assert f"pushed {out} to {hub.url}/me/shapes-grpo" in printed.out
    assert hub.created == [{"name": "shapes-grpo", "organization": "me", "visibility": "private", "type": "model"}]
    [(revision, sent)] = hub.commits
    assert revision == "main" and set(sent) == EXPORTED  # the marker (.flowrl-output.json) stays local
    for name, data in sent.items():
        assert data == (out / name).read_bytes(), name
    assert hub.validated == [(out / "README.md").read_text()]  # the card checked before any weight is sent
    assert 'pipe.load_lora_weights("me/shapes-grpo")' in sent["README.md"].decode()
    assert {auth for method, _, auth in hub.requests if method == "POST"} == {f"Bearer {TOKEN}"}
    assert {auth for _, _, auth in hub.requests} <= {f"Bearer {TOKEN}", None}  # and nothing else anywhere
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path
    assert all(TOKEN.encode() not in data for data in sent.values())
    assert TOKEN not in printed.out + printed.err


def test_revision_commits_to_its_branch_with_the_login_token(run, tmp_path, hub, online, monkeypatch):
    login = "hf_fromTheLoginFile987654321"
    Path(online.HF_TOKEN_PATH).parent.mkdir(parents=True)
    Path(online.HF_TOKEN_PATH).write_text(login)
    monkeypatch.delenv("HF_TOKEN")
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--push-to-hub", "me/shapes", "--revision", "rl-v2"]) == 0
    assert hub.branches == ["rl-v2"] and [r for r, _ in hub.commits] == ["rl-v2"]
    assert hub.created[0].get("visibility") is None  # not --private: the Hub's default
    assert {auth for method, _, auth in hub.requests if method == "POST"} == {f"Bearer {login}"}


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("failure", ["no token", "someone else's repo", "no network", "offline"])
def test_a_failed_push_is_one_line_and_keeps_the_export(run, tmp_path, capsys, online, monkeypatch, failure):
    server = StandInHub(forbid=failure == "someone else's repo")
    point_at(server, monkeypatch)
    if failure == "no token":
        monkeypatch.delenv("HF_TOKEN")
    if failure == "no network":
        server.close()  # nothing listens there any more
    if failure == "offline":
        monkeypatch.setattr(online, "HF_HUB_OFFLINE", True)
    out = tmp_path / "export"
    try:
        status = main(["export", str(run), "--out", str(out), "--push-to-hub", "someone/else"])
    finally:
        if failure != "no network":
            server.close()
    line = _one_line(capsys.readouterr().err)
    assert status == 1 and line.startswith("flowrl export: push to the Hub failed: ")
    assert line.endswith(f"the export in {out} is kept") and TOKEN not in line
    expected = {
        "no token": "needs a Hugging Face token: set HF_TOKEN or run `hf auth login`",
        "someone else's repo": "the token may not write to someone/else (403 Forbidden)",
        "no network": f"could not reach the Hub at {server.url}",
        "offline": "HF_HUB_OFFLINE is set",
    }[failure]
    assert expected in line
    assert EXPORTED <= {p.name for p in out.iterdir()}  # the export is whole
    assert "someone/else" in (out / "README.md").read_text()
    if failure in ("no token", "offline"):
        assert server.requests == []


def test_a_bad_repo_id_or_a_lone_private_flag_is_refused_before_anything_is_written(run, tmp_path, capsys):
    out = tmp_path / "export"
    for repo in ("a/b/c", "no-namespace", "me/bad..name"):
        assert main(["export", str(run), "--out", str(out), "--push-to-hub", repo]) == 2
        assert f"--push-to-hub={repo!r} is not a Hub repo id" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(out), "--private"]) == 2
    assert "add --push-to-hub REPO_ID" in capsys.readouterr().err
    assert not out.exists()


# ---- train.push_to_hub --------------------------------------------------------------------------------------------
def test_train_push_to_hub_uploads_the_run_at_its_end(tmp_path, hub, capsys):
    args = [*RUN_ARGS, f"train.output_dir={tmp_path}", "train.name=pushed", "train.push_to_hub=me/pushed"]
    assert main(["train", *args]) == 0
    assert f"pushed {tmp_path / 'pushed' / 'export'} to {hub.url}/me/pushed" in capsys.readouterr().out
    [(_, sent)] = hub.commits
    assert set(sent) == EXPORTED
    card = sent["README.md"].decode()
    assert 'pipe.load_lora_weights("me/pushed")' in card and "after (step 1)" in card
    assert "push_to_hub: null" in sent["config.yaml"].decode()  # a reproduction does not push to this repo
    state = torch.load(tmp_path / "pushed" / "checkpoints" / "step-1" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1


def test_a_failed_push_at_the_end_of_training_keeps_the_run_and_says_so(tmp_path, forbidding_hub, capsys):
    args = [*RUN_ARGS, f"train.output_dir={tmp_path}", "train.name=kept", "train.push_to_hub=someone/else"]
    assert main(["train", *args]) == 1
    line = _one_line(capsys.readouterr().err)
    run_dir = tmp_path / "kept"
    assert line.startswith("flowrl train: push to the Hub failed: the token may not write to someone/else (403")
    assert f"the run in {run_dir} and its export are kept" in line
    assert f"`flowrl export {run_dir} --push-to-hub someone/else` pushes again" in line
    assert (run_dir / "checkpoints" / "step-1").is_dir() and (run_dir / "samples" / "after.png").is_file()
    assert EXPORTED <= {p.name for p in (run_dir / "export").iterdir()}


def test_train_push_to_hub_without_a_token_is_refused_before_training(tmp_path, online, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    args = [*RUN_ARGS, f"train.output_dir={tmp_path}", "train.name=never", "train.push_to_hub=me/never"]
    assert main(["train", *args]) == 2
    assert "train.push_to_hub='me/never' needs a Hugging Face token" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "never").exists()


def test_the_shared_config_reproduces_the_run_config(run, tmp_path):
    """The card's config.yaml loads as a config, equal to the run's but for the keys it resets."""
    from flowrl.run.model_card import RESET_KEYS

    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    shared = TrainConfig.from_yaml(str(out / "config.yaml")).to_dict()
    original = TrainConfig.from_yaml(str(run / "config.yaml")).to_dict()
    for key, value in RESET_KEYS.items():
        assert shared["train"].pop(key) == value
        original["train"].pop(key)
    assert shared == original
    shutil.rmtree(out)
