"""vlm_judge: a served judge against a real chat-completions server on 127.0.0.1 (and servers that hang, fail,
omit log-probabilities or serve another model), the in-process judge on a tiny random Qwen2-VL, bad settings."""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from flowrl_rewards import build_reward
from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.judges.vlm_judge import DEFAULT_QUESTION, VlmJudge, check_pattern, pattern_score, yes_share
from flowrl_rewards.serving.remote import RemoteRewardError

FAST = dict(timeout=5.0, retries=2, backoff=0.01, max_backoff=0.05)
YES_LP, NO_LP = -0.1, -2.4
P_YES = math.exp(YES_LP) / (math.exp(YES_LP) + math.exp(NO_LP))  # the VQAScore of a (Yes −0.1, No −2.4) reply


# ---- a chat-completions server ---------------------------------------------------------------------------
class ChatServer:
    """An OpenAI-style server on a free port of 127.0.0.1, in a thread: ``POST /v1/chat/completions`` answers
    ``reply(request_json) -> (status, body)`` after ``delay`` seconds; ``GET /v1/models`` lists ``models``.
    Records every request (path, headers, JSON) and the most requests it had in flight at once."""

    def __init__(self, reply, models=("judge",), delay=0.0):
        self.reply, self.models, self.delay = reply, list(models), delay
        self.requests, self.paths, self.headers = [], [], []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.record(self, None)
                outer.send(self, 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in outer.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                outer.record(self, body)
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                time.sleep(outer.delay)
                with outer.lock:
                    outer.in_flight -= 1
                outer.send(self, *outer.reply(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def record(self, handler, body):
        with self.lock:
            self.paths.append((handler.command, handler.path))
            self.headers.append(dict(handler.headers))
            if body is not None:
                self.requests.append(body)

    @staticmethod
    def send(handler, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(reply, **kw):
        servers.append(ChatServer(reply, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def completion(content, top=None, asked=20):
    """A chat-completions reply: ``content``, and with ``top`` [(token, logprob), ...] the first token's log-probs,
    padded to the ``asked`` alternatives a server returns with unlikely tokens (neither yes nor no)."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
        "logprobs": None,
    }
    if top is not None:
        top = list(top) + [(f"<filler{i}>", -30.0) for i in range(asked - len(top))]
        choice["logprobs"] = {
            "content": [
                {
                    "token": top[0][0],
                    "logprob": top[0][1],
                    "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top],
                }
            ]
        }
    return 200, {"id": "c", "object": "chat.completion", "model": "judge", "choices": [choice]}


def question_of(request):
    return request["messages"][-1]["content"][1]["text"]


def images(b=2, h=24, w=20, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def judge(url, **kw):
    return build_reward("vlm_judge", url=url, model="judge", **{**FAST, **kw})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the served judge ------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_request_carries_model_image_and_question_and_the_score_is_the_yes_share(serve, suffix):
    server = serve(lambda req: completion("Yes", [("Yes", YES_LP), ("No", NO_LP), ("The", -5.0)]))
    reward = judge(server.url + suffix, system="You judge {prompt}.")
    x, meta = images(), {}
    scores = reward(x, ["a red circle", "two cats"], meta)
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert torch.allclose(scores, torch.full((2,), P_YES), atol=1e-6)
    assert meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 0} and reward.last_error is None
    assert server.paths == [("POST", "/v1/chat/completions")] * 2
    by_question = {question_of(r): r for r in server.requests}
    req = by_question['Does this figure show "a red circle"? Please answer yes or no.']
    assert req["model"] == "judge" and req["temperature"] == 0 and req["max_tokens"] == 1
    assert req["logprobs"] is True and req["top_logprobs"] == 20
    assert req["messages"][0] == {"role": "system", "content": "You judge a red circle."}
    url = req["messages"][1]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    from PIL import Image

    png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert png.size == (20, 24) and png.mode == "RGB"
    assert (np.asarray(png) == to_uint8(x)[0]).all()  # the image itself, as 8 bits


@pytest.mark.parametrize(
    "top, expected",
    [
        ([("Yes", -0.1), ("No", -2.4)], P_YES),
        (
            [(" yes", -1.0), ("Yes", -1.0), ("no", -0.5), ("Maybe", -0.2)],
            2 * math.exp(-1) / (2 * math.exp(-1) + math.exp(-0.5)),
        ),
        ([("YES", -0.3), ("ĠNo", -0.3)], 0.5),
        ([("No", -0.01)], 0.0),
        ([("Maybe", -0.1), ("Yesterday", -1.0)], float("nan")),
    ],
)
def test_yes_share_counts_every_yes_like_and_no_like_token(top, expected):
    got = yes_share(top)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, abs=1e-12)


def test_no_yes_or_no_among_the_top_logprobs_is_nan_counted_and_explained(serve):
    server = serve(lambda req: completion("Maybe", [("Maybe", -0.1), ("Perhaps", -1.0)]))
    reward, meta = judge(server.url), {}
    scores = reward(images(1), ["a cat"], meta)
    assert torch.isnan(scores).all() and meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 1}
    assert "neither 'yes' nor 'no'" in reward.last_error and "'Maybe'" in reward.last_error


def test_pattern_mode_maps_the_final_score_and_counts_answers_without_one(serve):
    answers = {
        "good": "Sharp and faithful.\nFinal Score: 4",
        "silent": "I cannot tell.",
        "half": "Final Score: 2.5",
        "twice": "Final Score: 2 ... on reflection Final Score: 5",
    }
    server = serve(lambda req: completion(answers[question_of(req).split()[-1]]))
    reward = judge(server.url, score="pattern", question="Rate the image for: {prompt}", score_range=[1, 5])
    meta = {}
    scores = reward(images(4), ["good", "twice", "silent", "half"], meta)
    assert scores[0] == pytest.approx((4 - 1) / (5 - 1)) and scores[1] == 1.0 and scores[3] == pytest.approx(0.375)
    assert torch.isnan(scores[2]) and meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 1}
    assert "Final Score" in reward.last_error and "I cannot tell." in reward.last_error
    req = server.requests[0]
    assert "logprobs" not in req and "top_logprobs" not in req and req["max_tokens"] == 512
    assert {question_of(r) for r in server.requests} >= {"Rate the image for: good", "Rate the image for: silent"}


def test_pattern_score_clips_to_the_range_and_reads_a_whole_match_without_groups():
    assert pattern_score("Final Score: 7", check_pattern(r"Final Score:\s*([0-9]+)"), 1, 5) == 1.0
    assert pattern_score("score 0", check_pattern(r"[0-9]+"), 1, 5) == 0.0
    assert pattern_score("8/10", check_pattern(r"[0-9]+(?=/10)"), 0, 10) == pytest.approx(0.8)
    assert math.isnan(pattern_score("", check_pattern(r"([0-9]+)"), 0, 10))


def test_requests_run_concurrently_and_scores_keep_their_order(serve):
    server = serve(lambda req: completion(f"Final Score: {question_of(req)[-1]}"), delay=0.3)
    reward = judge(server.url, score="pattern", question="image {prompt}", score_range=[0, 10], concurrency=4)
    t = time.monotonic()
    scores = reward(images(4), ["p7", "p1", "p9", "p3"])
    assert scores.tolist() == pytest.approx([0.7, 0.1, 0.9, 0.3])
    assert server.max_in_flight == 4 and time.monotonic() - t < 1.0  # four requests of 0.3 s in flight at once


@pytest.fixture
def hanging_url():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    conns = []

    def accept():
        while True:
            try:
                conns.append(listener.accept()[0])  # never answers
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for c in conns:
        c.close()


def test_a_hanging_server_times_out_naming_the_url(hanging_url):
    chat = f"{hanging_url}/v1/chat/completions"
    t = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"vlm_judge: POST {chat}: timed out after 0.5 s.*1 attempt"):
        judge(hanging_url, timeout=0.5, retries=0)(images(2), ["a", "b"])
    meta = {}
    reward = judge(hanging_url, timeout=0.5, retries=0, on_error="nan")
    scores = reward(images(2), ["a", "b"], meta)
    assert time.monotonic() - t < 3
    assert torch.isnan(scores).all() and meta == {"vlm_judge/failed": 2, "vlm_judge/unscored": 0}
    assert "timed out" in reward.last_error and chat in reward.last_error and reward.failed == 2


def test_a_500_is_retried_then_fails_naming_the_status_and_message(serve):
    server = serve(lambda req: (500, {"error": {"message": "CUDA out of memory"}}))
    with pytest.raises(RemoteRewardError, match=r"/v1/chat/completions: HTTP 500.*CUDA out of memory.*3 attempts"):
        judge(server.url, retries=2)(images(1), ["a"])
    assert len(server.requests) == 3
    meta = {}
    scores = judge(server.url, retries=1, on_error="nan")(images(1), ["a"], meta)
    assert torch.isnan(scores).all() and meta["vlm_judge/failed"] == 1 and len(server.requests) == 5


def test_a_reply_without_logprobs_names_the_score_setting_and_the_server_flag(serve):
    server = serve(lambda req: completion("Yes"))
    with pytest.raises(RuntimeError, match=r"without log-probabilities.*--max-logprobs.*score: pattern"):
        judge(server.url)(images(1), ["a"])


def test_health_check_passes_and_sends_the_api_key(serve, monkeypatch):
    server = serve(lambda req: completion("Yes"), models=["other", "judge"])
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    judge(server.url + "/v1", api_key_env="JUDGE_KEY").check_ready()
    assert server.paths == [("GET", "/v1/models")] and server.headers[0]["Authorization"] == "Bearer s3cret"


def test_health_check_against_nothing_listening_names_the_url_key():
    url = f"http://127.0.0.1:{free_port()}"
    reward = judge(url)  # building never contacts the server
    with pytest.raises(RuntimeError, match=rf"no judge server answers at url='{url}'.*model='judge'"):
        reward.check_ready()


def test_health_check_names_the_models_a_server_serves(serve):
    server = serve(lambda req: completion("Yes"), models=["Qwen/Qwen2.5-VL-7B-Instruct", "UnifiedReward"])
    with pytest.raises(
        RuntimeError,
        match=r"serves the models \['Qwen/Qwen2.5-VL-7B-Instruct', 'UnifiedReward'\], "
        r"not model='judge'; set model",
    ):
        judge(server.url).check_ready()


# ---- bad settings ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "vllm"}, r"backend='vllm' is not one of \('openai', 'transformers'\)"),
        ({"score": "logits"}, r"score='logits' is not one of \('yes_probability', 'vqascore', 'pattern'\)"),
        (
            {"question": "Is {subject} in the image?"},
            r"question=.*has the field \{subject\}; the only field accepted is \{prompt\}",
        ),
        ({"question": "Does it show {}?"}, r"question=.*has the field \{\}"),
        ({"system": "Judge {prompt} by {rubric}"}, r"system=.*has the field \{rubric\}"),
        ({"question": "Does it show {prompt?"}, r"question=.*is not a valid template"),
        ({"score_range": [5, 1]}, r"score_range=\[5, 1\] must be \[low, high\]"),
        ({"pattern": "Final Score: ("}, r"pattern='Final Score: \(' is not a regular expression"),
        ({"on_error": "skip"}, r"on_error='skip' is not one of \('raise', 'nan'\)"),
        ({"url": "127.0.0.1:8000"}, r"url='127.0.0.1:8000' must start with http://"),
        ({"concurrency": 0}, r"concurrency=0 must be an integer >= 1"),
        ({"timeout": 0}, r"timeout=0 must be a number > 0"),
        ({"api_key_env": "NO_SUCH_JUDGE_KEY_VAR"}, r"api_key_env='NO_SUCH_JUDGE_KEY_VAR'.*not set"),
    ],
)
def test_bad_settings_fail_at_build_naming_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_reward("vlm_judge", **kwargs)


def test_a_template_without_prompt_and_with_escaped_braces_is_accepted():
    reward = VlmJudge(question="Is this image {{well}} composed?")
    assert reward.fill(["x"]) == (["Is this image {well} composed?"], [None])
    assert VlmJudge().fill(['a "b"'])[0] == [DEFAULT_QUESTION.replace("{prompt}", 'a "b"')]


# ---- the in-process judge on a tiny random Qwen2-VL ------------------------------------------------------
WORDS = [
    "Does",
    "this",
    "figure",
    "show",
    "Please",
    "answer",
    "yes",
    "no",
    "Yes",
    "No",
    "Final",
    "Score",
    "red",
    "circle",
    "cat",
    "a",
    "two",
]
CHAT_TEMPLATE = (  # Qwen's chat layout: turns between <|im_start|> and <|im_end|>, the image as its vision tokens
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A folder with a random 2-layer Qwen2-VL (hidden 32, a 1-block vision tower, 2 px patches, merge 1) and its
    processor: flowrl's offline byte-level BPE tokenizer (every word of WORDS one token) and a chat template."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    from flowrl.models.testing.qwen_image import EDIT_PIXELS, tiny_qwen_tokenizer, vision_token_ids

    tokenizer = tiny_qwen_tokenizer(WORDS, edit=True)
    vision = dict(patch_size=2, temporal_patch_size=1, merge_size=1, **EDIT_PIXELS)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )
    ids = vision_token_ids(tokenizer)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            ),
            vision_config=dict(
                depth=1,
                embed_dim=16,
                hidden_size=32,
                mlp_ratio=1,
                num_heads=2,
                patch_size=2,
                temporal_patch_size=1,
                spatial_merge_size=1,
            ),
            **ids,
        )
    )
    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def local_judge(tiny_vlm):
    return build_reward("vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", batch_size=4)


PROMPTS = ["a red circle", "two", "a cat with a red circle and two red circle", "cat"]  # different lengths: padding


def test_local_yes_probability_is_in_range_and_does_not_depend_on_the_batch(local_judge):
    x = images(4, 16, 16, seed=1)
    batched = local_judge(x, PROMPTS)
    assert batched.dtype == torch.float32 and batched.shape == (4,)
    assert ((batched > 0) & (batched < 1)).all() and batched.std() > 0  # a random judge: different, unsaturated
    alone = torch.cat([local_judge(x[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)])
    assert torch.allclose(batched, alone, atol=1e-5)  # left padding: the last position is every row's own
    reordered = local_judge(x.flip(0), PROMPTS[::-1])
    assert torch.allclose(reordered.flip(0), batched, atol=1e-5)


def test_local_yes_probability_equals_the_softmax_mass_of_yes_over_yes_and_no(local_judge):
    from PIL import Image

    processor, model = local_judge.local.processor, local_judge.local.model
    tok = processor.tokenizer
    yes = [tok.convert_tokens_to_ids(t) for t in ("Yes", "ĠYes", "yes", "Ġyes")]
    no = [tok.convert_tokens_to_ids(t) for t in ("No", "ĠNo", "no", "Ġno")]
    assert sorted(local_judge.local.yes_ids) == sorted(yes) and sorted(local_judge.local.no_ids) == sorted(no)
    x = images(1, 16, 16, seed=2)
    text = (
        '<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Does this figure show "a red circle"? '
        "Please answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = processor(text=[text], images=[Image.fromarray(to_uint8(x)[0])], return_tensors="pt")
    with torch.no_grad():
        probs = model(**inputs).logits[0, -1].double().softmax(-1)
    expected = probs[yes].sum() / (probs[yes].sum() + probs[no].sum())
    assert local_judge(x, ["a red circle"]).item() == pytest.approx(expected.item(), abs=1e-6)


def test_local_pattern_mode_decodes_a_greedy_answer(tiny_vlm):
    reward = build_reward(
        "vlm_judge", backend="transformers", model=tiny_vlm, device="cpu", score="pattern", max_tokens=5, batch_size=2
    )
    tok = reward.local.processor.tokenizer
    ids = tok.encode("Final Score: 4", add_special_tokens=False)
    # steer the random model's greedy answer to exactly "Final Score: 4": each token after its predecessor
    bias = {(ids[0],): 50.0, **{(a, b): 100.0 for a, b in zip(ids, ids[1:])}}
    reward.local.model.generation_config.sequence_bias = bias
    meta = {}
    scores = reward(images(3, 16, 16), PROMPTS[:3], meta)
    assert scores.tolist() == [0.75] * 3 and meta["vlm_judge/unscored"] == 0
    reward.local.model.generation_config.sequence_bias = None
    scores = reward(images(1, 16, 16), ["cat"], meta)  # a random model's answer holds no "Final Score: n"
    assert torch.isnan(scores).all() and meta["vlm_judge/unscored"] == 1 and "no number matching" in reward.last_error


# ---- round four (issue 54): secrets, malformed log-probabilities, bounded time -----------------------------
class Redirector:
    """A server on 127.0.0.1 answering every request with ``status`` and ``Location: target(path)``; records hits."""

    def __init__(self, status, target):
        self.hits = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self):
                length = int(self.headers.get("Content-Length", 0))
                outer.hits.append((self.command, self.path, self.rfile.read(length) if length else b""))
                self.send_response(status)
                self.send_header("Location", target(self.path))
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def redirector():
    made = []

    def start(status, target):
        made.append(Redirector(status, target))
        return made[-1]

    yield start
    for r in made:
        r.close()


@pytest.mark.parametrize("status", [302, 307, 308])
def test_a_redirect_to_another_origin_is_refused_and_the_key_never_leaves(serve, redirector, monkeypatch, status):
    elsewhere = serve(lambda req: completion("Yes", [("Yes", YES_LP), ("No", NO_LP)]))
    hop = redirector(status, lambda path: elsewhere.url + path)  # another port: another origin
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    reward = judge(hop.url, api_key_env="JUDGE_KEY", retries=0)
    with pytest.raises(
        RemoteRewardError,
        match=rf"{hop.url}/v1/chat/completions answered HTTP {status} redirecting "
        rf"to Location: {elsewhere.url}/v1/chat/completions; not followed",
    ) as e:
        reward(images(1), ["a cat"])
    assert "credentials" in str(e.value) and "s3cret" not in str(e.value)
    with pytest.raises(
        RuntimeError, match=rf"refused GET {hop.url}/v1/models.*Location: {elsewhere.url}/v1/models"
    ) as e:
        reward.check_ready()
    assert "no judge server answers" not in str(e.value)
    assert elsewhere.paths == [] and elsewhere.headers == []  # nothing reached the other server, key or not
    assert [h[:2] for h in hop.hits] == [("POST", "/v1/chat/completions"), ("GET", "/v1/models")]


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_within_the_origin_keeps_the_post_and_its_body(serve, status):
    holder = {}

    def reply(req):
        return completion("Yes", [("Yes", YES_LP), ("No", NO_LP)])

    server = serve(reply)
    original = ChatServer.send

    # the same server answers /old/v1/chat/completions with a redirect to /v1/chat/completions
    def send(handler, code, body):
        if handler.path.startswith("/old/"):
            holder.setdefault("hits", 0)
            holder["hits"] += 1
            handler.send_response(status)
            handler.send_header("Location", handler.path[len("/old") :])
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        original(handler, code, body)

    server.send = send
    reward = judge(server.url + "/old", retries=0)
    assert reward(images(1), ["a cat"]).item() == pytest.approx(P_YES, abs=1e-6)
    assert holder["hits"] == 1 and server.paths[-1] == ("POST", "/v1/chat/completions")
    assert question_of(server.requests[-1]) == DEFAULT_QUESTION.format(prompt="a cat")  # the body came along


@pytest.mark.parametrize(
    "value, what",
    [
        ("s3cret-key\n", r"a newline \(U\+000A\) at its end \(character 11 of 11\)"),
        (" s3cret-key", r"a space \(U\+0020\) at its start"),
        ("s3cret key", r"a space \(U\+0020\) at character 7"),
        ("s3cret\x07key", r"a control character \(U\+0007\) at character 7"),
    ],
)
def test_a_key_with_whitespace_or_control_characters_is_refused_at_build_without_showing_it(monkeypatch, value, what):
    monkeypatch.setenv("JUDGE_KEY", value)
    with pytest.raises(
        ValueError, match=rf"the key in the environment variable JUDGE_KEY \(api_key_env\) holds {what}"
    ) as e:
        build_reward("vlm_judge", api_key_env="JUDGE_KEY")
    assert "s3cret" not in str(e.value) and "no judge server answers" not in str(e.value)
    with pytest.raises(ValueError, match=rf"the key in api_key holds {what}") as e:
        build_reward("vlm_judge", api_key=value)
    assert "s3cret" not in str(e.value)


def first_token(top, token=("Yes", -0.1)):
    """A reply whose first answer token is ``token`` and whose ``top_logprobs`` is ``top`` as given."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": token[0]},
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": token[0], "logprob": token[1], "top_logprobs": top}]},
    }
    return 200, {"id": "c", "object": "chat.completion", "model": "judge", "choices": [choice]}


def padded(*pairs):
    return [{"token": t, "logprob": lp} for t, lp in pairs] + [
        {"token": f"<f{i}>", "logprob": -30.0} for i in range(20 - len(pairs))
    ]


@pytest.mark.parametrize(
    "reply, match",
    [
        (
            first_token(padded(("Yes", 0.5), ("No", -2.0)), ("Yes", 0.5)),
            r"logprob=0.5 \(token 'Yes'\) is not a log-probability: one is finite and at most 0",
        ),
        (
            first_token(padded(("Yes", 1e9), ("No", -2.0)), ("Yes", 1e9)),
            r"logprob=1000000000.0 \(token 'Yes'\) is not a",
        ),
        (
            first_token(padded(("Yes", float("nan")), ("No", -2.0)), ("Yes", float("nan"))),
            r"top_logprobs\[0\].logprob is NaN \(token 'Yes'\)",
        ),
        (first_token(padded(("Yes", -0.1), ("No", float("-inf")))), r"top_logprobs\[1\].logprob=-inf \(token 'No'\)"),
        (
            first_token({"Yes": -0.1, "No": -2.0}),
            r"top_logprobs is dict, not a list of \{token, logprob\}; the reply held \{\"token\": \"Yes\"",
        ),
        (first_token([]), r"top_logprobs holds 0 alternatives, fewer than the top_logprobs=20 asked for"),
        (first_token(padded(("Yes", -0.1))[:3]), r"holds 3 alternatives, fewer than the top_logprobs=20"),
        (first_token(padded(("Yes", "-0.1"))), r"top_logprobs\[0\].logprob='-0.1' \(token 'Yes'\) is not a number"),
    ],
)
def test_log_probabilities_that_cannot_be_are_a_named_failure_raised_or_counted(serve, reply, match):
    server = serve(lambda req: reply)
    with pytest.raises(
        RemoteRewardError,
        match=rf"vlm_judge: POST {server.url}/v1/chat/completions: malformed "
        rf"reply: .*{match}",
    ):
        judge(server.url)(images(1), ["a cat"])
    reward, meta = judge(server.url, on_error="nan"), {}
    scores = reward(images(2), ["a cat", "a dog"], meta)
    assert torch.isnan(scores).all() and meta == {"vlm_judge/failed": 2, "vlm_judge/unscored": 0}
    assert "malformed reply" in reward.last_error and "neither 'yes' nor 'no'" not in reward.last_error


def test_pattern_mode_refuses_non_finite_numbers(serve):
    answers = {
        "nan": "Final Score: nan",
        "inf": "Final Score: inf",
        "big": "Final Score: 1e999",
        "ok": "Final Score: 4",
    }
    server = serve(lambda req: completion(answers[question_of(req).split()[-1]]))
    reward = judge(server.url, score="pattern", question="Rate {prompt}", pattern=r"Final Score:\s*(\S+)")
    meta = {}
    scores = reward(images(4), ["nan", "inf", "big", "ok"], meta)
    assert torch.isnan(scores[:3]).all() and scores[3] == pytest.approx(0.75)
    assert meta == {"vlm_judge/failed": 0, "vlm_judge/unscored": 3}
    assert "matched 'nan', not a finite number" in reward.last_error
    assert math.isnan(pattern_score("Score: inf", check_pattern(r"Score: (\S+)"), 1, 5))
    assert math.isnan(pattern_score("Score: -inf", check_pattern(r"Score: (\S+)"), 1, 5))


class Dripper:
    """A server on 127.0.0.1 that reads a request and answers one byte every ``every`` seconds: the status line and
    headers too (``phase="headers"``) or, after whole headers promising 10,000 bytes, the body (``"body"``)."""

    def __init__(self, phase, every=0.25):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.stop = threading.Event()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.phase, self.every = phase, every
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while not self.stop.is_set():
            try:
                conn = self.listener.accept()[0]
            except OSError:
                return
            threading.Thread(target=self.drip, args=(conn,), daemon=True).start()

    def drip(self, conn):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
        try:
            conn.recv(1 << 20)
            if self.phase == "body":
                conn.sendall(head)
            for byte in head if self.phase == "headers" else b" " * 10000:
                if self.stop.wait(self.every):
                    break
                conn.sendall(bytes([byte]) if isinstance(byte, int) else byte)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.listener.close()


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_server_that_drips_its_reply_fails_within_the_timeout(phase):
    dripper = Dripper(phase)
    box = {}

    def call():
        t = time.monotonic()
        try:
            judge(dripper.url, timeout=1.0, retries=0)(images(1), ["a cat"])
        except Exception as e:  # noqa: BLE001 — inspected below
            box["error"] = e
        box["seconds"] = time.monotonic() - t

    worker = threading.Thread(target=call, daemon=True)
    try:
        worker.start()
        worker.join(6.0)  # a per-read timeout alone would wait 10,000 × 0.25 s
        assert not worker.is_alive(), "the request outlived its 1 s deadline by 5 s"
    finally:
        dripper.close()
        worker.join(5.0)
    assert isinstance(box.get("error"), RemoteRewardError) and "timed out after 1 s" in str(box["error"])
    assert box["seconds"] < 2.5
