"""``compress serve`` through real HTTP clients (the ``openai`` package and httpx) against a real
socket on localhost: a tiny random Llama with a character tokenizer. The reference for the text
is the contiguous runtime's greedy tokens for the same prompt, decoded by the same tokenizer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from compress.runtime.connections import uvicorn_config
from compress.runtime.engine import Runtime
from compress.runtime.scheduler import Scheduler
from compress.runtime.server import Engine, Server
from compress.testing import make_char_tokenizer, make_tiny_model

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny():
    model = make_tiny_model("llama", 0, initializer_range=0.3)
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


class Running:
    """A server on a free localhost port, in a thread, stopped at exit."""

    def __init__(self, runtime, tokenizer, *, max_waiting=64, header_timeout=30.0,
                 max_connections=None, **scheduler):
        scheduler = Scheduler(runtime, **{"num_blocks": 64, "block_size": 4, **scheduler})
        self.engine = Engine(scheduler, max_waiting=max_waiting)
        self.app = Server(self.engine, tokenizer, "tiny", max_model_len=runtime.max_seq_len).app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # the protocol and bounds ``serve`` runs (compress.runtime.connections)
        config = uvicorn_config(self.app, log_level="warning", header_timeout=header_timeout,
                                max_connections=max_connections)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.02)

    def stats(self):
        return httpx.get(self.url + "/stats").json()

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.stop()


@pytest.fixture(scope="module")
def served():
    model, tokenizer = tiny()
    runtime = Runtime(model, max_seq_len=128, compile=False)
    running = Running(runtime, tokenizer)
    yield running, runtime, tokenizer
    running.close()


def greedy_text(runtime, tokenizer, ids, n):
    return tokenizer.decode(runtime.generate([ids], n)[0], skip_special_tokens=True)


def test_openai_client_streams_completions_and_chat(served):
    running, runtime, tokenizer = served
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "Hello, world"
    expected = greedy_text(runtime, tokenizer, tokenizer(prompt)["input_ids"], 20)
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = greedy_text(runtime, tokenizer, list(ids), 12)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == 12
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)


def test_token_id_prompts_several_choices_and_stop_strings(served):
    running, runtime, tokenizer = served
    prompts = [[1, 40, 50, 60], [1, 70, 80]]
    body = {"prompt": prompts, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    assert texts == [greedy_text(runtime, tokenizer, p, 10) for p in prompts]
    full = texts[0]
    stop = full[3:5]
    body = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}  # fmt: skip
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["text"] == full[: full.find(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "n": 65}, "n: Input should be less than or equal to 64"),
        ({"prompt": "hi", "n": 0}, "n: Input should be greater than or equal to 1"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": [1, 99999], "max_tokens": 2}, "outside the vocabulary"),
        ({"prompt": "x" * 200, "max_tokens": 2}, "max_model_len"),
        ({"prompt": "hi", "max_tokens": 500}, "max_tokens=500 with the prompt's 2 tokens"),
        ({"prompt": "hi", "top_k": -5}, "top_k"),
        # sampling controls that would otherwise be ignored: refused, not served as if unset
        ({"prompt": "hi", "min_p": 1.5}, "min_p: Input should be less than or equal to 1"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias key 'abc' is not a token id"),
        ({"prompt": "hi", "logit_bias": {"5": 200}}, "outside [-100, 100]"),
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, "outside the vocabulary"),
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens 5 is more than"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt": "hi", "seed": 2**80, "temperature": 1}, "seed"),
    ],
)
def test_malformed_requests_get_a_400_that_names_the_problem(served, body, fragment):
    running, _, _ = served
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert fragment in reply.json()["error"]["message"]
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}


def test_defaults_spelt_out_and_an_empty_stop_string_change_nothing(served):
    running, runtime, tokenizer = served
    body = {"prompt": [1, 40, 50], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stop": [""], "presence_penalty": 0, "repetition_penalty": 1,
            "response_format": {"type": "text"}}  # fmt: skip
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 40, 50], 6)


def test_logit_bias_stop_token_ids_and_min_tokens_reach_the_scheduler(served):
    running, _, tokenizer = served
    body = {"prompt": [1, 40, 50], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"9": 100}}  # fmt: skip
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["text"] == tokenizer.decode([9, 9, 9])
    body = {**body, "max_tokens": 8, "stop_token_ids": [9], "min_tokens": 2}
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 3  # two held back, then the stop token


def test_n_choices_per_prompt_in_vllms_order(served):
    """n copies of each prompt, choice index prompt * n + j: greedy choices are the greedy
    text; seeded sampled choices differ from each other (choice j samples with seed + j) and
    come back the same on a second request."""
    running, runtime, tokenizer = served
    prompts = [[1, 40, 50, 60], [1, 70, 80]]
    body = {"prompt": prompts, "n": 3, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    assert texts == [greedy_text(runtime, tokenizer, p, 8) for p in prompts for _ in range(3)]
    assert reply["usage"]["prompt_tokens"] == 7 and reply["usage"]["completion_tokens"] == 48
    streamed = ["" for _ in texts]
    with httpx.stream("POST", running.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    sampled = {"prompt": prompts[0], "n": 4, "max_tokens": 12, "temperature": 1.5, "seed": 7,
               "ignore_eos": True}  # fmt: skip
    first, again = (httpx.post(running.url + "/v1/completions", json=sampled, timeout=60).json()
                    for _ in range(2))
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1
    assert texts == [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])]


def test_logprobs_are_the_models_log_probabilities(served):
    """Completions' logprobs: k and chat's logprobs/top_logprobs: each token's log-probability
    and its top k under the model (transformers' fp32 log-softmax at the same positions, the
    reference; sampled requests: tests/runtime/test_scheduler.py); streamed pieces add up to
    the whole answer's."""
    running, runtime, tokenizer = served
    model, _ = tiny()  # the served weights (same seed), run by transformers
    prompt = [1, 40, 50, 60]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 3}  # fmt: skip
    got = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    got = got["choices"][0]["logprobs"]
    ids = runtime.generate([prompt], 6)[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    ref = ref.log_softmax(-1)
    assert got["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert got["token_logprobs"] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids)],
                                                  abs=1e-4)
    for row, top in zip(ref, got["top_logprobs"], strict=True):
        values, tokens = row.topk(3)
        want = {tokenizer.decode([t]): float(v) for t, v in zip(tokens, values, strict=True)}
        assert top == pytest.approx(want, abs=1e-4)
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(6)]

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = httpx.post(running.url + "/v1/chat/completions", json=chat, timeout=60).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6 for c in content)
    streamed = []
    with httpx.stream("POST", running.url + "/v1/chat/completions",
                      json={**chat, "stream": True}, timeout=60) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += (choice.get("logprobs") or {}).get("content", [])
    # the same entries (their numbers within the float rounding of another batch's matmuls)
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content],
                                                             abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, token ids): the prompt's
    tokens come first, the first without a log-prob, the others transformers' fp32
    log-softmax at their positions; then the generated token."""
    running, runtime, tokenizer = served
    model, _ = tiny()
    prompt = [1, 40, 50, 60, 41, 42, 43, 44, 45]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "ignore_eos": True}  # fmt: skip
    choice = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    choice = choice["choices"][0]
    got = choice["logprobs"]
    new = runtime.generate([prompt], 1)[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + new])).logits[0, :-1].log_softmax(-1)
    ids = prompt + new
    assert got["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(
        [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)], abs=1e-4)
    assert all(len(top) == 1 for top in got["top_logprobs"][1:])
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    plain = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={**body, "logprobs": None, "max_tokens": 3}).json()  # fmt: skip
    assert plain["choices"][0]["text"] == tokenizer.decode(
        prompt + runtime.generate([prompt], 3)[0], skip_special_tokens=True)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_streamed_echo_sends_what_the_whole_answer_holds(served, logprobs):
    """echo with stream: each choice's first event carries its prompt's text (and, with
    logprobs, its scored tokens) before the first token; the events put together equal the
    whole answer, text offsets included, for every choice of n = 2."""
    running, _, _ = served
    body = {"prompt": [1, 40, 50, 60, 41, 42], "max_tokens": 3, "temperature": 0, "n": 2,
            "echo": True, "ignore_eos": True, "logprobs": logprobs}  # fmt: skip
    whole = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    texts, scored = ["", ""], [[], []]
    with httpx.stream("POST", running.url + "/v1/completions",
                      json={**body, "stream": True}, timeout=60) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts[choice["index"]] += choice["text"]
                scored[choice["index"]].append(choice["logprobs"])
    for i, want in enumerate(whole["choices"]):
        assert texts[i] == want["text"] and texts[i].startswith("CMWDE")  # the prompt's text
        if logprobs is None:
            assert scored[i] == [None] * 3 and want["logprobs"] is None  # an event a token
            continue
        got = {key: sum((part[key] for part in scored[i]), []) for key in want["logprobs"]}
        assert got["tokens"] == want["logprobs"]["tokens"]  # 6 prompt tokens, then 3 new
        assert len(scored[i][0]["tokens"]) == 7 and got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:],
                                                          abs=1e-5)
        assert got["text_offset"] == want["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True},
         "echo is served for /v1/completions"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs must be in 0..20"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs must be an integer"),
        ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs is a chat field"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ],
)
def test_malformed_logprobs_asks_are_400(served, path, body, fragment):
    running, _, _ = served
    reply = httpx.post(running.url + path, json=body, timeout=30)
    assert reply.status_code == 400 and fragment in reply.json()["error"]["message"]


def test_invalid_json_and_unknown_roles_are_400(served):
    running, _, _ = served
    reply = httpx.post(running.url + "/v1/completions", content=b"{not json", timeout=30,
                       headers={"content-type": "application/json"})  # fmt: skip
    assert reply.status_code == 400
    body = {"messages": [{"role": "wizard", "content": "x"}]}
    assert httpx.post(running.url + "/v1/chat/completions", json=body).status_code == 400


def test_a_client_that_disconnects_frees_its_blocks_and_others_finish(served):
    running, runtime, tokenizer = served
    body = {"prompt": [1, 5, 6, 7], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # the connection is closed: the request is aborted and its blocks go back
    for _ in range(200):
        stats = running.stats()
        if stats["running"] == 0 and stats["kv_blocks_in_use"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0
    reply = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 9], "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True}).json()  # fmt: skip
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 9], 5)


def test_a_client_that_leaves_a_non_streamed_request_has_it_aborted(served, monkeypatch):
    """Its disconnect was checked only when no token had come for a second, so a request
    that kept decoding ran to its limit for nobody."""
    running, runtime, tokenizer = served
    scheduler = running.engine.scheduler
    step = scheduler.step

    def slow_step():  # 120 tokens take 6 s
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(scheduler, "step", slow_step)
    body = json.dumps({"prompt": [1, 5, 6], "max_tokens": 120, "temperature": 0,
                       "ignore_eos": True}).encode()
    port = int(running.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        for _ in range(100):
            if running.stats()["running"] == 1:
                break
            time.sleep(0.02)
    left = time.monotonic()
    while running.stats()["running"] and time.monotonic() - left < 10:
        time.sleep(0.05)
    assert time.monotonic() - left < 3.0  # within a check or two, not the 6 s to its limit
    monkeypatch.undo()
    reply = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 9], "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True}).json()  # fmt: skip
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 9], 5)


def test_blocks_running_out_preempts_and_every_request_still_gets_its_text():
    model, tokenizer = tiny()
    runtime = Runtime(model, max_seq_len=96, compile=False)
    running = Running(runtime, tokenizer, num_blocks=14, max_batch=8)  # 56 slots for 6 x 40
    try:
        prompts = [[1, 10 + i, 20 + i, 30] for i in range(6)]
        results = [None] * len(prompts)

        def ask(i):
            body = {"prompt": prompts[i], "max_tokens": 36, "temperature": 0, "ignore_eos": True}
            results[i] = httpx.post(running.url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        texts = [r.json()["choices"][0]["text"] for r in results]
        assert texts == [greedy_text(runtime, tokenizer, p, 36) for p in prompts]
        assert running.stats()["preemptions"] > 0
    finally:
        running.close()


def test_overload_queues_up_to_the_bound_then_answers_503():
    model, tokenizer = tiny()
    runtime = Runtime(model, max_seq_len=64, compile=False)
    running = Running(runtime, tokenizer, max_waiting=2)
    release = threading.Event()
    step = running.engine.scheduler.step

    def held_step():
        release.wait(30)
        return step()

    running.engine.scheduler.step = held_step
    try:
        body = {"prompt": [1, 5], "max_tokens": 3, "temperature": 0}
        replies = []
        threads = [
            threading.Thread(target=lambda: replies.append(
                httpx.post(running.url + "/v1/completions", json=body, timeout=60)))
            for _ in range(3)
        ]  # fmt: skip
        for t in threads:  # one at a time: the first is in the held step, two wait
            t.start()
            time.sleep(0.3)
        rejected = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
        assert rejected.status_code == 503 and "retry later" in rejected.json()["error"]["message"]
        assert rejected.headers["retry-after"] == "1"
        release.set()
        for t in threads:
            t.join()
        assert [r.status_code for r in replies] == [200, 200, 200]
    finally:
        release.set()
        running.close()


def test_ctrl_c_drains_requests_in_flight(tmp_path):
    """``compress serve`` in its own process: SIGINT while a stream is open lets it finish."""
    model, tokenizer = tiny()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "compress.cli", "serve", str(tmp_path), "--port", str(port),
               "--max-model-len", "128", "--kv-memory", "4MB"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": [1, 5, 6], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        texts, reasons = [], []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    texts.append(None)
                    break
                choice = json.loads(line[6:])["choices"][0]
                if not texts:
                    proc.send_signal(signal.SIGINT)  # mid-stream
                texts.append(choice["text"])
                reasons.append(choice["finish_reason"])
        assert texts[-1] is None and reasons[-1] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    expected = Runtime(model, max_seq_len=128, compile=False).generate([[1, 5, 6]], 100)[0]
    assert "".join(texts[:-1]) == tokenizer.decode(expected, skip_special_tokens=True)


def test_engine_failure_reaches_the_waiting_client():
    """A scheduler whose every step raises (an exception from its bookkeeping, not a forward):
    each waiting client gets a 500 naming it and the scheduler starts afresh; the third such
    step in a row stops the engine (503s from then on)."""
    model, tokenizer = tiny()
    runtime = Runtime(model, max_seq_len=64, compile=False)
    running = Running(runtime, tokenizer)

    def broken_step():
        raise torch.cuda.OutOfMemoryError("simulated")

    running.engine.scheduler.step = broken_step
    try:
        body = {"prompt": [1, 5], "max_tokens": 3}
        for attempt in range(3):
            reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 500 and "simulated" in reply.text
            health = httpx.get(running.url + "/health").status_code
            assert health == (503 if attempt == 2 else 200), attempt
    finally:
        running.close()


def test_a_step_whose_bookkeeping_raises_fails_its_requests_and_the_next_gets_its_text(
        served, monkeypatch):
    """One step raises outside any forward (injected into the scheduling): the requests it held,
    a running one and a waiting one, get a 500 or a stream's error event, the scheduler starts
    afresh (no block held) and the next request gets the model's text."""
    import compress.runtime.scheduler as scheduler_module

    running, runtime, tokenizer = served
    schedule, armed = scheduler_module.Scheduler._schedule, []

    def failing(self):
        if armed and armed.pop():
            raise KeyError("injected bookkeeping failure")
        return schedule(self)

    monkeypatch.setattr(scheduler_module.Scheduler, "_schedule", failing)
    long = {"prompt": [1, 5, 6, 7], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", running.url + "/v1/completions", json=long, timeout=60) as r:
        lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)  # the long request is running
        armed.append(True)
        status, reply = post_events(running, {"prompt": [1, 9], "max_tokens": 4})
        rest = list(lines)
    assert json.loads(first)["choices"]
    assert "[DONE]" not in rest and "injected bookkeeping failure" in rest[-1]
    assert status in (200, 500)  # queued before or after the failing step
    if status == 500:
        assert "scheduler failed (KeyError" in reply["error"]["message"]
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    body = {"prompt": [1, 40, 50], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, reply = post_events(running, body)
    assert status == 200
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 40, 50], 6)
    assert running.stats()["kv_blocks_in_use"] == 0


def post_events(running, body):
    """(status, the body) of a completion, a stream's as its list of ``data:`` payloads."""
    reply = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
    if body.get("stream"):
        return reply.status_code, [line[6:] for line in reply.text.splitlines()
                                   if line.startswith("data: ")]  # fmt: skip
    return reply.status_code, reply.json()


def test_a_request_whose_sampling_raises_gets_a_500_and_the_others_their_text(served,
                                                                              monkeypatch):
    """Its sampling raises for one request (top_k 13 marks it): a 500 naming what failed, or a
    stream's error event and its end; a long request beside it gets its text, blocks go back."""
    import compress.runtime.scheduler as scheduler_module

    running, runtime, tokenizer = served
    sample = scheduler_module._sample

    def failing(logits, s, **kwargs):
        if s.top_k == 13:
            raise RuntimeError("injected sampling failure")
        return sample(logits, s, **kwargs)

    monkeypatch.setattr(scheduler_module, "_sample", failing)
    before = running.stats()["failed_requests"]
    long = {"prompt": [1, 5, 6, 7], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", running.url + "/v1/completions", json=long, timeout=60) as r:
        lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        events = [next(lines)]  # the long request is running
        bad = {"prompt": [1, 9, 9], "max_tokens": 5, "temperature": 1.0, "top_k": 13}
        status, reply = post_events(running, bad)
        assert status == 500 and reply["error"]["type"] == "server_error"
        assert ("failed while sampling its next token: RuntimeError: injected sampling failure"
                in reply["error"]["message"])
        status, failed = post_events(running, {**bad, "stream": True})
        assert status == 200 and "[DONE]" not in failed
        assert "injected sampling failure" in json.loads(failed[-1])["error"]["message"]
        events += lines
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == greedy_text(runtime, tokenizer, [1, 5, 6, 7], 100)
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    stats = running.stats()
    assert stats["failed_requests"] == before + 2 and stats["kv_blocks_in_use"] == 0


def test_a_failed_forward_gets_a_500_and_the_next_request_its_text(served, monkeypatch):
    """The batched forward raises twice (whole, then streamed): both requests hear why, the
    engine stays up, and the next request gets the text of a fresh runtime."""
    import compress.runtime.scheduler as scheduler_module

    running, runtime, tokenizer = served
    forward, failures = scheduler_module.forward_step, [2]

    def failing(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("injected forward failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "forward_step", failing)
    body = {"prompt": [1, 40, 50], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, reply = post_events(running, body)
    assert status == 500 and "forward failed" in reply["error"]["message"]
    assert "injected forward failure" in reply["error"]["message"]
    status, events = post_events(running, {**body, "stream": True})
    assert "injected forward failure" in json.loads(events[-1])["error"]["message"]
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    status, reply = post_events(running, body)
    assert status == 200
    assert reply["choices"][0]["text"] == greedy_text(runtime, tokenizer, [1, 40, 50], 6)
    assert running.stats()["kv_blocks_in_use"] == 0


def test_forwards_that_fail_every_time_stop_the_engine_after_three(monkeypatch):
    """A model whose every forward raises: the first two requests get a 500 and the engine goes
    on; the third failure in a row stops it (503s from then on)."""
    import compress.runtime.scheduler as scheduler_module

    def failing(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    model, tokenizer = tiny()
    running = Running(Runtime(model, max_seq_len=64, compile=False), tokenizer)
    monkeypatch.setattr(scheduler_module, "forward_step", failing)
    try:
        body = {"prompt": [1, 5], "max_tokens": 3}
        for _ in range(2):
            status, reply = post_events(running, body)
            assert status == 500 and "injected forward failure" in reply["error"]["message"]
            assert httpx.get(running.url + "/health").status_code == 200
        status, reply = post_events(running, body)
        assert status == 500 and "injected forward failure" in reply["error"]["message"]
        health = httpx.get(running.url + "/health")
        assert health.status_code == 503 and "3 times in a row" in health.text
        assert post_events(running, body)[0] == 503
    finally:
        running.close()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-size", "0"], "--block-size 0: give a number above 0"),
        (["--prefill-budget", "-4"], "--prefill-budget -4: give a number above 0"),
        (["--kv-memory", "1KiB", "--max-model-len", "128"], "holds no block of 16 tokens"),
        # past the positions the rotary tables grew with it (10**8 was killed for memory)
        (["--max-model-len", "1024"], "--max-model-len 1024 exceeds the 256 positions"),
        (["--kv-memory", "0"], "--kv-memory: a size must be positive"),
        (["--port", "BUSY"], "cannot listen on --host 127.0.0.1 --port"),  # it exited 0
        (["--host", "999.1.1.1"], "cannot listen on --host 999.1.1.1"),
    ],
)
def test_serve_refuses_bad_settings_with_a_message(tmp_path, capsys, flags, message):
    """Exit status 2 and the problem named, no traceback (the first two before the model
    loads: the folder is empty)."""
    import socket

    from compress.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    flags = [str(busy.getsockname()[1]) if f == "BUSY" else f for f in flags]
    folder = tmp_path / "model"
    if "1KiB" in flags or "1024" in flags:  # refused once the model is read
        model, tokenizer = tiny()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        folder.mkdir()
    with busy:
        assert main(["serve", str(folder), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--python-layers"]])
def test_serve_runs_decode_layers_where_its_banner_says(tmp_path, monkeypatch, capsys, flags):
    """``--python-layers`` keeps decode steps in the Python layer loop; by default they run as
    one C++ call where the kernels build; the banner says which."""
    from compress import cli
    from compress.kernels import cpu_q8
    from compress.runtime import server

    model, tokenizer = tiny()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    served = []
    monkeypatch.setattr(server, "serve", lambda s, **_: served.append(s))
    assert cli.main(["serve", str(tmp_path), "--max-model-len", "128", "--kv-memory", "4MB",
                     *flags]) == 0  # fmt: skip
    scheduler = served[0].engine.scheduler
    banner = capsys.readouterr().err
    if flags or cpu_q8.unavailable_reason() is not None:
        assert scheduler.decode_stack is None
        assert f"decode layers in Python: {scheduler.decode_stack_reason}" in banner
    else:
        assert scheduler.decode_stack is not None and "decode layers in C++;" in banner
    if flags:
        assert scheduler.decode_stack_reason == "asked for"


def test_serve_fits_its_default_length_to_the_kv_cache_and_refuses_an_asked_one(tmp_path,
                                                                               monkeypatch,
                                                                               capsys):
    """A server whose cache held 76 tokens advertised max_model_len 256 and refused every chat
    request without max_tokens (the default output fills max_model_len). The default length is
    the model's positions (256 here, under 2048) where the cache holds them, else what it
    holds, with a note; a length asked for that the cache cannot hold is refused."""
    from compress import cli
    from compress.runtime import server

    model, tokenizer = tiny()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    served = []
    monkeypatch.setattr(server, "serve", lambda s, **_: served.append(s))
    assert cli.main(["serve", str(tmp_path), "--kv-memory", "4MB"]) == 0
    cache = served[0].engine.scheduler.cache
    assert served[0].max_model_len == 256 < cache.num_blocks * cache.block_size
    small = str(10 * cache.bytes_per_block)  # 10 blocks of 16 tokens
    assert cli.main(["serve", str(tmp_path), "--kv-memory", small]) == 0
    assert served[1].max_model_len == 160
    assert f"note: max_model_len 160 (what --kv-memory {small} holds" in capsys.readouterr().err
    assert cli.main(["serve", str(tmp_path), "--kv-memory", small, "--max-model-len", "200"]) == 2
    assert (f"--max-model-len 200 needs 13 KV blocks of 16 tokens; --kv-memory {small} holds 10 "
            "(160 tokens)") in capsys.readouterr().err
