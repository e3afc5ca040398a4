"""Malformed and edge-case requests to ``compress serve`` (found by fuzzing the endpoints): each
gets an OpenAI-style 400 naming the field, or a correct answer, and the server keeps serving. One
server (the tiny random Llama of test_server.py) for every case; the engine thread's health is
checked after each, since an exception in a step stops it for every client."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from compress.runtime.engine import Runtime
from compress.runtime.sampling import _make_sampling, _sample, adjust_logits, make_adjustments
from tests.runtime.test_server import CHAT_TEMPLATE, Running, greedy_text, tiny

# a template that refuses some messages, as real models' templates do (raise_exception)
REFUSING_TEMPLATE = (
    "{% if messages[0]['role'] == 'developer' %}"
    "{{ raise_exception('developer messages are not supported') }}{% endif %}" + CHAT_TEMPLATE
)
ALL_TOKENS = list(range(320))  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def served():
    model, tokenizer = tiny()
    tokenizer.chat_template = REFUSING_TEMPLATE
    runtime = Runtime(model, max_seq_len=128, compile=False)
    running = Running(runtime, tokenizer)
    yield running, runtime, tokenizer
    running.close()


def post(running, path, body, *, stream=False):
    """(status, JSON body) of a request; ``body`` bytes are sent as they are."""
    if isinstance(body, bytes):
        reply = httpx.post(running.url + path, content=body, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
    else:
        reply = httpx.post(running.url + path, json={**body, "stream": stream} if stream
                           else body, timeout=30)  # fmt: skip
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        return reply.status_code, events
    return reply.status_code, reply.json()


def assert_alive_and_correct(running, runtime, tokenizer):
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    body = {"prompt": [1, 40, 50], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, reply = post(running, "/v1/completions", body)
    assert status == 200
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 40, 50], 4)


# Valid requests whose sampling made NaN probabilities: multinomial raised in the engine thread,
# the request got a 500 and every later one a 503 (the server was dead).
@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-300},  # logits / T overflowed to inf
        {"temperature": 1e-300, "repetition_penalty": 1e-308},
        {"temperature": 1, "top_p": 1e-300},  # rounds to 0 in float32: every token dropped
        {"temperature": 1, "repetition_penalty": 1e-308},  # positive logits / 1e-308 = inf
        {"temperature": 1, "stop_token_ids": ALL_TOKENS, "min_tokens": 2},  # all masked
    ],
    ids=["tiny-temperature", "tiny-temperature-and-penalty", "tiny-top-p",
         "tiny-repetition-penalty", "min-tokens-with-every-token-a-stop"],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_extreme_sampling_settings_answer_and_keep_the_engine_alive(served, extra, stream):
    running, runtime, tokenizer = served
    body = {"prompt": [1, 40, 50], "max_tokens": 3, "ignore_eos": True, **extra}
    status, reply = post(running, "/v1/completions", body, stream=stream)
    assert status == 200, reply
    reasons = [e["choices"][0]["finish_reason"] for e in reply] if stream else [
        reply["choices"][0]["finish_reason"]]
    assert reasons[-1] in ("length", "stop") and not any("error" in e for e in reply)
    assert_alive_and_correct(running, runtime, tokenizer)


def test_a_near_zero_temperature_samples_the_greedy_tokens(served):
    """T -> 0 is greedy: the limit, not an error."""
    running, runtime, tokenizer = served
    body = {"prompt": [1, 40, 50], "max_tokens": 6, "temperature": 1e-300, "seed": 3,
            "ignore_eos": True}  # fmt: skip
    status, reply = post(running, "/v1/completions", body)
    assert status == 200
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 40, 50], 6)


def test_sampling_extremes_in_the_sampler():
    """The library's side of the cases above (the scheduler and the runtime share _sample)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0]])
    for temperature, top_p in [(1e-300, None), (1e-45, None), (1.0, 1e-300)]:
        sampling = _make_sampling(temperature, top_p=top_p, seed=0)
        assert _sample(logits, sampling).tolist() == [0]
    with pytest.raises(ValueError, match="temperature=inf must be finite"):
        _make_sampling(float("inf"))
    row = adjust_logits(logits[0], make_adjustments(repetition_penalty=1e-308), [0, 2], [],
                        frozenset())  # fmt: skip
    assert torch.isfinite(row).all()
    row = adjust_logits(logits[0], make_adjustments(min_tokens=2), [0], [],
                        frozenset(range(4)))  # fmt: skip
    assert torch.isfinite(row).all()  # nothing masked when every token is a stop token


# (id, path, body, param, message fragment). Before: served as garbage (a 200), a 500, or a 400
# whose message or param was pydantic's internals ("prompt.str", "None: Field required",
# "1: JSON decode error").
C, CHAT = "/v1/completions", "/v1/chat/completions"


def said(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


MALFORMED = [
    # types pydantic's lax mode converted: max_tokens true was 1 token, [true, false] ids 1, 0
    ("max-tokens-bool", C, {"prompt": "hi", "max_tokens": True}, "max_tokens", "got true"),
    ("max-tokens-string", C, {"prompt": "hi", "max_tokens": "5"}, "max_tokens", 'got "5"'),
    ("n-bool", C, {"prompt": "hi", "n": True}, "n", "valid integer"),
    ("stream-string", C, {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("prompt-bools", C, {"prompt": [True, False]}, "prompt", "expected a string, a list of"),
    ("prompt-int", C, {"prompt": 5}, "prompt", "list of token ids"),
    ("stop-int", C, {"prompt": "hi", "stop": [5]}, "stop", "a string or a list of strings"),
    ("temperature-infinity", C, b'{"prompt": "hi", "temperature": Infinity}', "temperature",
     "finite"),
    ("logit-bias-key-spaces", C, {"prompt": "hi", "logit_bias": {" 5 ": 1}}, "logit_bias",
     "' 5 ' is not a token id"),
    ("logit-bias-key-underscore", C, {"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias",
     "'1_0' is not a token id"),
    # was reported as param "prompt"
    ("logit-bias-token-past-vocabulary", C, {"prompt": "hi", "logit_bias": {"320": 1}},
     "logit_bias", "outside the vocabulary 0..319"),
    ("max-tokens-past-max-model-len", C, {"prompt": "hi", "max_tokens": 500}, "max_tokens",
     "ask for at most 126 tokens"),
    # a request that can never be queued: was a 503 "retry later", forever
    ("prompts-over-queue-bound", C, {"prompt": ["hi"] * 65, "max_tokens": 1}, "prompt",
     "65 prompts x n=1 are 65 sequences; this server queues at most 64"),
    ("prompts-x-n-over-queue-bound", C, {"prompt": ["a", "b"], "n": 33, "max_tokens": 1},
     "prompt", "queues at most 64"),
    # the body itself
    ("body-not-json", C, b"{not json", None, "the request body is not valid JSON"),
    ("body-empty", C, b"", None, "the request body is empty"),
    ("body-a-list", C, b"[1, 2]", None, "must be a JSON object"),
    # FastAPI's "There was an error parsing the body", which named nothing
    ("body-nested-too-deep", C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None,
     "could not be read as JSON"),
    ("body-not-utf8", C, b'{"prompt": "\xff\xfe"}', None, "send UTF-8 JSON"),
    ("body-5000-digit-integer", C, b'{"prompt": [' + b"9" * 5000 + b"]}", None,
     "could not be read as JSON (Exceeds the limit"),
    # chat: content parts whose text was not a string were a 500 (str.join)
    ("content-part-text-null", CHAT, said([{"type": "text", "text": None}]),
     "messages.0.content", "only text content parts"),
    ("content-part-text-int", CHAT, said([{"type": "text", "text": 5}]), "messages.0.content",
     "only text content parts"),
    ("content-int", CHAT, said(5), "messages.0.content", "expected a string, a list of"),
    # a chat template's raise_exception was a 500
    ("template-raise-exception", CHAT, {"messages": [{"role": "developer", "content": "x"}]},
     "messages", "chat template refused the messages: developer messages are not supported"),
    ("chat-prompt-too-long", CHAT, said("x" * 200), "messages", "max_model_len is 128"),
    # past max_model_len x the longest token (5 characters) x 4 characters: refused untokenized
    ("prompt-too-many-characters", C, {"prompt": "x" * 2561}, "prompt",
     "prompt has 2561 characters; this server's max_model_len of 128 tokens holds none over "
     "2560"),
    ("chat-too-many-characters", CHAT, said("x" * 2000 + "y" * 561), "messages",
     "messages has 2561 characters"),
    # a lone surrogate in a JSON string: the tokenizer raised a TypeError (a plain-text 500)
    ("prompt-lone-surrogate", C, b'{"prompt": "\\ud800x", "max_tokens": 2}', "prompt",
     "prompt is not valid Unicode text"),
    ("content-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\udfffa"}]}',
     "messages.0.content", "messages.0.content is not valid Unicode text"),
    # taken and then ignored, or slow: 200,000 stop strings held the event loop for 16 s, a
    # million stop ids past the vocabulary the engine thread (sorted every token)
    ("stop-strings-too-many", C, {"prompt": "hi", "stop": ["a"] * 65}, "stop",
     "stop has 65 strings; this server takes at most 64"),
    ("stop-token-past-vocabulary", C, {"prompt": "hi", "stop_token_ids": [5, 320]},
     "stop_token_ids", "outside the vocabulary 0..319: [320]"),
    ("stream-options-without-stream", C, {"prompt": "hi", "stream": False,
     "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ("include-usage-not-a-bool", C, {"prompt": "hi", "stream": True,
     "stream_options": {"include_usage": "yes"}}, "stream_options", "must be true or false"),
    ("tools", CHAT, {**said("hi"), "tools": [{"type": "function"}]}, "tools",
     "tool calling is not supported"),
    ("tool-choice", CHAT, {**said("hi"), "tool_choice": "required"}, "tool_choice",
     "tool calling is not supported"),
    ("functions", CHAT, {**said("hi"), "functions": [{"name": "f"}]}, "functions",
     "tool calling is not supported"),
    ("tool-calls-in-a-message", CHAT, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1"}]},
        {"role": "user", "content": "hi"}]}, "messages.0.tool_calls",
     "tool calling is not supported"),
    # empty messages passed the character bound; their template held the tokenizer 20 s
    ("messages-more-than-max-model-len", CHAT, {"messages": [{"role": "user"}] * 129},
     "messages", "messages has 129 messages; this server's max_model_len of 128"),
    # past float32's max the logits' temperature is inf: every token tied, top_k ignored
    ("temperature-past-float32", C, {"prompt": "hi", "temperature": 1e39}, "temperature",
     "less than or equal to 3402823466385288"),
]


# each case whole and streamed (where the body is JSON that does not set stream itself)
MALFORMED_CASES = [
    pytest.param(*case[1:], stream, id=f"{case[0]}-{'stream' if stream else 'whole'}")
    for case in MALFORMED for stream in (False, True)
    if not stream or not (isinstance(case[2], bytes) or "stream" in case[2])
]


@pytest.mark.parametrize("path, body, param, fragment, stream", MALFORMED_CASES)
def test_malformed_requests_get_an_openai_style_400(served, path, body, param, fragment, stream):
    running, _, _ = served
    status, reply = post(running, path, body, stream=stream)
    assert status == 400, reply
    error = reply["error"]
    assert fragment in error["message"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error",
                                                              400)
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "method, path, status",
    [("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405),
     ("POST", "/v1/models", 405)],
)  # fmt: skip
def test_unknown_routes_and_methods_answer_in_openais_error_shape(served, method, path, status):
    """Were FastAPI's {"detail": "Not Found"}, which OpenAI clients do not read."""
    running, _, _ = served
    reply = httpx.request(method, running.url + path, json={})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert f"{method} {path}" in error["message"] and "POST /v1/completions" in error["message"]
    if status == 405:
        assert "allow" in reply.headers


def test_chat_streams_name_the_role_for_every_choice_and_take_tool_choice_none(served):
    """Only choice 0 got the {"role": "assistant"} delta; ``tool_choice: "none"`` asks for no
    tools, which is what it gets."""
    running, _, _ = served
    body = {**said("hi"), "n": 2, "max_tokens": 2, "tool_choice": "none"}
    status, events = post(running, CHAT, body, stream=True)
    assert status == 200, events
    roles = [e["choices"][0]["index"] for e in events
             if e["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    status, reply = post(running, CHAT, body)
    assert status == 200 and len(reply["choices"]) == 2, reply


def test_head_asks_of_health_and_models_are_answered(served):
    running, _, _ = served
    for path in ("/health", "/v1/models"):
        assert httpx.head(running.url + path).status_code == 200


def test_after_every_malformed_request_the_answers_stay_right(served):
    running, runtime, tokenizer = served
    for _, path, body, _, _ in MALFORMED[:6]:
        post(running, path, body)
    assert_alive_and_correct(running, runtime, tokenizer)
    assert running.stats()["running"] == 0 and running.stats()["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": [1, 40, 50], "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}),
])
def test_a_request_for_another_model_is_a_404_naming_the_served_one(served, path, body):
    """OpenAI and vLLM answer a model name they do not serve with a 404; the served name, or
    none, is answered."""
    running, _, _ = served
    status, reply = post(running, path, {**body, "model": "other-model"})
    assert status == 404, reply
    error = reply["error"]
    assert (error["param"], error["code"]) == ("model", 404)
    assert "'other-model' does not exist; this server serves 'tiny'" in error["message"]
    for named in ({"model": "tiny"}, {}):
        status, reply = post(running, path, {**body, **named})
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply


def test_an_unexpected_error_is_a_json_500_and_the_server_goes_on(served, monkeypatch):
    """A bug of ours in a handler was Starlette's plain-text "Internal Server Error", which
    OpenAI clients cannot read."""
    from compress.runtime.server import Server

    running, runtime, tokenizer = served

    def broken(self, body):
        raise KeyError("a bug")

    monkeypatch.setattr(Server, "_completion_prompts", broken)
    status, reply = post(running, "/v1/completions", {"prompt": "hi"})
    assert status == 500
    assert reply["error"]["type"] == "server_error" and "KeyError" in reply["error"]["message"]
    monkeypatch.undo()
    assert_alive_and_correct(running, runtime, tokenizer)


def test_a_chat_template_that_does_not_compile_refuses_to_start():
    """It failed every chat request with a 500 instead."""
    from compress.core.errors import ModelLoadError
    from compress.runtime.server import Server

    _, tokenizer = tiny()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        Server(None, tokenizer, "tiny", max_model_len=64)


def test_oversized_asks_are_refused_before_anything_is_tokenized(served, monkeypatch):
    """100k prompts, or a 10 MB one, were tokenized whole on the event loop (every other client
    and /health waited) before the queue bound or max_model_len refused them."""
    running, runtime, tokenizer = served

    def tokenized(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(type(tokenizer), "__call__", tokenized)
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", tokenized)
    for path, body, fragment in [
        (C, {"prompt": ["hi"] * 100_000}, "100000 prompts x n=1"),
        (C, {"prompt": "x" * 10**7}, "prompt has 10000000 characters"),
        (CHAT, said("x" * 10**7), "messages has 10000000 characters"),
    ]:
        status, reply = post(running, path, body)
        assert status == 400 and fragment in reply["error"]["message"], reply
    monkeypatch.undo()
    assert_alive_and_correct(running, runtime, tokenizer)


def test_health_answers_while_a_prompt_is_tokenized(served, monkeypatch):
    """Tokenizing ran on the event loop: a long prompt held /health and every stream."""
    import threading
    import time

    running, runtime, tokenizer = served
    encode, started = type(tokenizer).__call__, threading.Event()

    def slow(self, *args, **kwargs):
        started.set()
        time.sleep(3)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", slow)
    replies = []
    sender = threading.Thread(target=lambda: replies.append(post(
        running, C, {"prompt": "hello", "max_tokens": 2, "ignore_eos": True})))
    sender.start()
    assert started.wait(10)
    assert httpx.get(running.url + "/health", timeout=2).json() == {"status": "ok"}
    sender.join()
    assert replies[0][0] == 200 and replies[0][1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_naming_it(monkeypatch, chunked):
    """There was no bound: a 100 MB body was read and parsed on the event loop."""
    from starlette.testclient import TestClient

    from compress.runtime import server

    monkeypatch.setattr(server, "MAX_BODY_BYTES", 1000)
    _, tokenizer = tiny()
    app = server.Server(None, tokenizer, "tiny", max_model_len=64).app
    body = json.dumps({"prompt": "x" * 2000}).encode()
    reply = TestClient(app).post(C, content=iter([body[:500], body[500:]]) if chunked else body,
                                 headers={"content-type": "application/json"})
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert "this server takes at most 1000 bytes" in error["message"], error
    assert error["code"] == 413
