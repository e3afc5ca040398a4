"""``compress serve``: an OpenAI-compatible HTTP server on the continuous-batching scheduler.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, and
``GET /stats`` (scheduler counters and KV memory in use; not OpenAI's). Built on FastAPI and
uvicorn (the ``serve`` extra).

One engine thread owns the model (``engine_loop.py``): it runs ``Scheduler.step`` while there is
work and hands each token to the request's asyncio queue. Handlers validate on the event loop,
tokenize in a worker thread, add the request under a lock (between steps) and stream what
arrives. Bad requests get a 400 with an OpenAI-style error body naming the field (a body over
``MAX_BODY_BYTES`` a 413); more than ``max_waiting`` queued requests get a 503; a client that
disconnects aborts its request, which frees its KV blocks. A request that fails in a step gets
a 500 naming what failed (a stream: an error event, then the end) and the engine serves the
others on; only when the engine stops (``engine_loop.py``) does every request get a 503.
Ctrl-C stops accepting connections and lets the requests in flight finish (uvicorn's graceful
shutdown).

Extensions that vLLM's server has too: ``top_k``, ``ignore_eos``, and ``prompt`` as token ids.
``n`` choices per prompt; ``logprobs`` (completions: the top k, chat: ``logprobs`` with
``top_logprobs``) are the model's log-probabilities before temperature, top-k and top-p (vLLM's
default); ``echo`` (completions, whole or streamed; with ``logprobs`` the prompt's tokens scored
too, what lm-eval's loglikelihood asks); presence/frequency/repetition penalties,
``logit_bias``, ``min_tokens`` and ``stop_token_ids`` (``compress.runtime.sampling.adjust_logits``),
``min_p``. Not supported (400): ``best_of``, ``suffix``, tools, a ``response_format`` other than
text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from compress.core.errors import ModelLoadError
from compress.runtime.connections import BodyLimit, error_json, uvicorn_config
from compress.runtime.engine_loop import Engine
from compress.runtime.sampling import MAX_TEMPERATURE
from compress.runtime.scheduler import Event, RequestError

log = logging.getLogger(__name__)

MAX_CHOICES = 64  # n per prompt: each is a request of its own in the scheduler
MAX_LOGPROBS = 20  # top log-probs per token, as vLLM's default limit
# stop strings per request (OpenAI takes 4): each is looked for after every token, and 200,000
# of them made a 100-token answer take 16 s of the event loop
MAX_STOPS = 64
# A request body past this is a 413 before it is read whole: a 100 MB body was held and parsed
# on the event loop. 32 MiB holds 256 prompts of 8192 token ids each as JSON, twice over.
MAX_BODY_BYTES = 32 << 20
# A text over max_model_len x (its tokenizer's longest token, in characters) x this many
# characters cannot fit and is refused before it is tokenized (a 10 MB prompt held every other
# client for seconds). The margin covers normalizers that drop or merge characters.
_CHARS_MARGIN = 4
ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
          "GET /stats")
# what a field that takes several shapes expects, for its 400 (pydantic would name one shape)
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string, a list of {"type": "text", "text": ...} parts or null',
}
_TYPE_TAGS = ("str", "int", "float", "bool", "none")  # pydantic's names of union members


class _Request(BaseModel):
    """The sampling fields both endpoints take (OpenAI's names and defaults). Strict types, as
    OpenAI's API: pydantic's lax mode would serve ``max_tokens: true`` as 1 token, ``prompt:
    [true, false]`` as token ids 1 and 0, and ``stream: "no"`` as a stream."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None)  # -1 or None: off (vLLM's convention)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # a torch generator's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    # choices per prompt; bounded like the batch a step can hold
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    logprobs: Any = None  # completions: k (the top k per token); chat: true or false
    top_logprobs: int | None = None  # chat: with logprobs true, the top k per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # logit adjustments before sampling (vLLM's definitions: compress.runtime.sampling)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # Sampling controls this server does not implement: a request that sets one is refused
    # (unknown fields are ignored, so without these it would be served as if unset).
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Request):
    # token ids first: pydantic tries the members in order, and a list of 15M ids tried as
    # list[str] first made 15M errors (40 s and 3.7 GB on the event loop) before list[int]
    prompt: list[int] | str | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None  # refused (tools): not dropped in silence


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # tool calling is not served: a request that sets any of these is refused, not served as
    # if they were unset (tool_choice "none" asks for no tools, which is what it gets)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


class _Detokenizer:
    """Text of a growing token list, released as deltas: decoding the whole each time keeps
    multi-token characters right; a trailing replacement character waits for its next token."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int | None, final: bool) -> tuple[str, bool]:
        """The new text after ``token`` and whether a stop string ended the output."""
        if token is not None:
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop, max(0, len(self.sent) - len(stop)))
            if at != -1:
                delta, self.sent = text[len(self.sent) : at], text[:at]
                return delta, True
        if not final:
            # hold back what could still grow into a stop string or a whole character
            hold = max((len(s) - 1 for s in self.stops), default=0)
            keep = len(text) - hold if hold else len(text)
            while keep > len(self.sent) and text[keep - 1] == "\ufffd":
                keep -= 1
            text = text[: max(keep, len(self.sent))]
        delta, self.sent = text[len(self.sent) :], text
        return delta, False


class Server:
    """The OpenAI-compatible app over one engine; ``app`` is the ASGI application."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, *, max_model_len: int) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len = max_model_len
        check_chat_template(tokenizer)
        self.created = int(time.time())
        stops = getattr(tokenizer, "eos_token_id", None)
        self.eos = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
        # the most characters a servable text can have (``_CHARS_MARGIN``)
        self.max_text_chars = max_model_len * _longest_token_chars(tokenizer) * _CHARS_MARGIN
        app = FastAPI(title="compress serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
        self.app = app

        @app.exception_handler(RequestValidationError)
        async def invalid(_request, exc: RequestValidationError):
            return _error(400, *_validation_message(exc.errors()))

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException):
            # FastAPI's own {"detail": ...} (unknown route, wrong method, a body it cannot
            # parse) in OpenAI's error shape, which clients read
            message = str(exc.detail)
            if message == "There was an error parsing the body":  # not JSONDecodeError's
                # invalid UTF-8 (a gzip body), a 5000-digit integer, nesting past the recursion
                # limit: FastAPI keeps the reason as the cause
                reason = f" ({str(exc.__cause__)[:200]})" if exc.__cause__ else ""
                message = (f"the request body could not be read as JSON{reason}: send UTF-8 "
                           "JSON, not compressed (no Content-Encoding)")
            if exc.status_code in (404, 405):
                message += f": {request.method} {request.url.path}; this server serves {ROUTES}"
            response = _error(exc.status_code, message, None)
            response.headers.update(exc.headers or {})  # a 405's Allow
            return response

        @app.exception_handler(Exception)
        async def unexpected(_request, exc: Exception):  # a bug of ours, in OpenAI's shape
            log.exception("request failed")
            return _error(500, f"internal error: {type(exc).__name__}: {exc}"[:500], None,
                          "server_error")

        @app.api_route("/health", methods=["GET", "HEAD"])
        async def health():
            if engine.error is not None:
                return _error(503, f"the engine stopped: {engine.error}", None, "server_error")
            return {"status": "ok"}

        @app.get("/stats")
        async def stats():
            return engine.snapshot

        @app.api_route("/v1/models", methods=["GET", "HEAD"])
        async def models():
            card = {
                "id": model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "compress",
                "max_model_len": max_model_len,
            }
            return {"object": "list", "data": [card]}

        # Tokenizing runs in a worker thread of its own, so /health, /stats and streams stay
        # answered while a long prompt is read (the tokenizers release the GIL); one thread,
        # since not every tokenizer is safe to call from two at once.
        tokenizing = ThreadPoolExecutor(1, thread_name_prefix="compress-tokenize")

        async def in_worker(function, body):
            return await asyncio.get_running_loop().run_in_executor(tokenizing, function, body)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            try:
                self._check_request(body)
                self._check_sequences(_prompt_count(body.prompt), body.n)
                prompts = await in_worker(self._completion_prompts, body)
            except RequestError as exc:
                return _error(400, str(exc), exc.param)
            return await self._serve(body, prompts, request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request):
            try:
                self._check_request(body)
                self._check_sequences(1, body.n)
                prompts = [await in_worker(self._chat_prompt, body)]
            except RequestError as exc:
                return _error(400, str(exc), exc.param)
            return await self._serve(body, prompts, request, chat=True)

    # ---- request -> token ids ------------------------------------------------------------
    def _check_request(self, body: _Request) -> None:
        """What pydantic's types do not say, checked before any prompt is tokenized."""
        options = body.stream_options
        if options is not None and not body.stream:
            raise RequestError("stream_options is only allowed with stream: true",
                               "stream_options")
        if not isinstance((options or {}).get("include_usage", False), bool):
            raise RequestError("stream_options.include_usage must be true or false",
                               "stream_options")
        if isinstance(body.stop, list) and len(body.stop) > MAX_STOPS:
            raise RequestError(f"stop has {len(body.stop)} strings; this server takes at most "
                               f"{MAX_STOPS}", "stop")
        if body.stop_token_ids:  # (a million ids past the vocabulary were taken)
            vocab = self.engine.scheduler.runtime.embed.shape[0]
            outside = [t for t in body.stop_token_ids if t >= vocab]
            if outside:
                raise RequestError(f"stop_token_ids names tokens outside the vocabulary "
                                   f"0..{vocab - 1}: {outside[:5]}", "stop_token_ids")
        if isinstance(body, ChatRequest):
            asked = {"tools": body.tools, "functions": body.functions,
                     "function_call": body.function_call,
                     "tool_choice": None if body.tool_choice == "none" else body.tool_choice}
            asked.update({f"messages.{i}.tool_calls": m.tool_calls
                          for i, m in enumerate(body.messages)})
            for name, value in asked.items():
                if value:
                    raise RequestError(f"{name}: tool calling is not supported by this server",
                                       name)
            # every message costs the template's tokens around it, however short its content:
            # 300,000 empty messages passed the character bound and held the tokenizer 20 s
            if len(body.messages) > self.max_model_len:
                raise RequestError(f"messages has {len(body.messages)} messages; this server's "
                                   f"max_model_len of {self.max_model_len} tokens holds fewer",
                                   "messages")

    def _check_sequences(self, prompts: int, n: int) -> None:
        """Refuse, before any prompt is tokenized, more sequences than the queue ever holds:
        never servable, whatever the load (a 400, not a 503 whose "retry later" loops)."""
        if prompts * n > self.engine.max_waiting:
            raise RequestError(
                f"{prompts} prompts x n={n} are {prompts * n} sequences; this server queues at "
                f"most {self.engine.max_waiting}: send fewer prompts or a smaller n per request",
                "prompt" if prompts > 1 else "n",
            )

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_text_chars:
            raise RequestError(
                f"{param} has {chars} characters; this server's max_model_len of "
                f"{self.max_model_len} tokens holds none over {self.max_text_chars}: shorten it",
                param,
            )

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
            ids = self.tokenizer(_text(p, "prompt"))["input_ids"] if isinstance(p, str) \
                else list(p)
            if not ids:
                raise RequestError("a prompt has no tokens", "prompt")
            out.append(ids)
        return out

    def _chat_prompt(self, body: ChatRequest) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError(
                f"{self.model_name}'s tokenizer has no chat template; use /v1/completions",
                "messages",
            )
        from jinja2 import TemplateError, TemplateSyntaxError

        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):  # content parts: text only
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise RequestError(
                            f"messages.{i}.content: only text content parts are supported, "
                            f'{{"type": "text", "text": "..."}}; got {str(part)[:80]}',
                            f"messages.{i}.content",
                        )
                content = "".join(part["text"] for part in content)
            messages.append({"role": m.role,
                             "content": _text(content or "", f"messages.{i}.content")})
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except TemplateSyntaxError:
            raise  # the model's template is broken: a 500, not the client's fault
        except TemplateError as exc:  # the template's raise_exception: roles out of order, ...
            raise RequestError(f"the model's chat template refused the messages: {exc}",
                               "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return list(ids)

    def _sampling(self, body: _Request, prompt: list[int],
                  sample: int = 0) -> tuple[int, dict[str, Any]]:
        """The token limit and sampling settings of choice ``sample`` of ``prompt`` (with a
        seed, choice j samples with seed + j: the n choices differ and each is reproducible)."""
        if body.echo and isinstance(body, ChatRequest):
            raise RequestError("echo is served for /v1/completions only", "echo")
        unsupported = {
            "best_of": body.best_of not in (None, 1),
            "suffix": body.suffix is not None,
            "response_format": (body.response_format or {}).get("type", "text") != "text",
        }
        for name, bad in unsupported.items():
            if bad:
                raise RequestError(f"{name} is not supported by this server", name)
        limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this server's max_model_len is "
                f"{self.max_model_len}",
                "messages" if isinstance(body, ChatRequest) else "prompt",
            )
        if limit is None:
            limit = min(room, 16 if isinstance(body, CompletionRequest) else room)
        elif limit > room:
            chat_limit = getattr(body, "max_completion_tokens", None)
            name = "max_completion_tokens" if chat_limit else "max_tokens"
            raise RequestError(
                f"{name}={limit} with the prompt's {len(prompt)} tokens is more than this "
                f"server's max_model_len {self.max_model_len}: ask for at most {room} "
                f"token{'s' if room > 1 else ''} or shorten the prompt",
                name,
            )
        top_k = None if body.top_k in (None, -1, 0) else body.top_k
        if top_k is not None and top_k < 1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {top_k}", "top_k")
        top_p = None if body.top_p >= 1.0 else body.top_p
        stops = (() if body.ignore_eos else tuple(self.eos)) + tuple(body.stop_token_ids or ())
        if body.min_tokens > limit:
            raise RequestError(f"min_tokens {body.min_tokens} is more than max_tokens {limit}",
                               "min_tokens")
        return limit, dict(
            logprobs=_logprobs_asked(body),
            # echo with logprobs: the prompt's tokens scored too (lm-eval's loglikelihood ask)
            prompt_logprobs=_logprobs_asked(body) if body.echo else None,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias),
            min_tokens=body.min_tokens,
            stop_tokens=stops,
            temperature=body.temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=body.min_p or None,
            seed=None if body.seed is None else (body.seed + sample + 2**63) % 2**64 - 2**63,
        )

    # ---- serving ---------------------------------------------------------------------------
    async def _serve(self, body: _Request, prompts: list[list[int]], request, *, chat: bool):
        if body.model is not None and body.model != self.model_name:
            # as OpenAI and vLLM answer: a client that names another model gets no other's text
            return _error(404, f"the model {body.model!r} does not exist; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", "model", "NotFoundError")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stops = [stop for stop in stops if stop]  # "" would match before any text
        opened: list[tuple[int, asyncio.Queue, _Detokenizer]] = []
        echoed: list[list[int]] = []  # each choice's prompt, when echo is asked
        try:
            for prompt in prompts:  # choice index: prompt * n + sample, as vLLM orders them
                for sample in range(body.n):
                    limit, sampling = self._sampling(body, prompt, sample)
                    seq_id, queue = self.engine.add(prompt, limit, **sampling)
                    opened.append((seq_id, queue, _Detokenizer(self.tokenizer, stops)))
                    echoed += [prompt] if body.echo else []
        except (RequestError, OverflowError, RuntimeError) as exc:
            for seq_id, _, _ in opened:
                self.engine.abort(seq_id)
            if isinstance(exc, RequestError):
                return _error(400, str(exc), exc.param)
            response = _error(503, str(exc), None, "server_error")
            if isinstance(exc, OverflowError):  # the queue is full: it drains in seconds
                response.headers["retry-after"] = "1"
            return response
        usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": 0}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = self._stream(rid, opened, usage, chat=chat, include_usage=include_usage,
                                  logprobs=_logprobs_asked(body) is not None, echoed=echoed)
            return StreamingResponse(events, media_type="text/event-stream")
        texts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in echoed] or [
            "" for _ in opened]
        reasons: list[str | None] = [None] * len(opened)
        scored: list[list[Event]] = [[] for _ in opened]  # events carrying log-probs
        try:
            async for index, delta, reason, event in self._merge(opened, usage, request):
                texts[index] += delta
                reasons[index] = reason or reasons[index]
                if event.logprob is not None:
                    scored[index].append(event)
        except RuntimeError as exc:
            return _error(500, str(exc), None, "server_error")
        finally:
            for seq_id, _, _ in opened:
                self.engine.abort(seq_id)  # no-op for finished requests
        if any(r is None for r in reasons):  # the client went away
            return JSONResponse({}, status_code=499)
        logprobs = [self._logprobs(events, chat=chat, prompt=echoed[i] if echoed else None)
                    if _logprobs_asked(body) is not None else None
                    for i, events in enumerate(scored)]
        return self._body(rid, texts, reasons, usage, chat=chat, logprobs=logprobs)

    async def _merge(self, opened, usage, request=None) -> AsyncIterator[tuple]:
        """(choice index, text delta, finish reason or None, the event) as tokens arrive, every
        choice."""
        pending = {i: q.get() for i, (_, q, _) in enumerate(opened)}
        tasks = {asyncio.ensure_future(c): i for i, c in pending.items()}
        checked = time.monotonic()
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, timeout=1.0, return_when="FIRST_COMPLETED")
                # once a second whether tokens arrive or not: a client that left a running
                # non-streamed request had it decode to its limit (its tokens kept coming)
                if request is not None and time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                for task in done:
                    index = tasks.pop(task)
                    event = task.result()
                    if isinstance(event, BaseException):
                        raise RuntimeError(f"the engine failed: {event}") from event
                    if event.error is not None:  # this request failed; the engine goes on
                        raise RuntimeError(event.error)
                    seq_id, queue, detok = opened[index]
                    usage["completion_tokens"] += event.token is not None
                    final = event.finish_reason is not None
                    delta, stopped = detok.add(event.token, final)
                    if stopped:
                        self.engine.abort(seq_id)
                        yield index, delta, "stop", event
                        continue
                    yield index, delta, event.finish_reason, event
                    if not final:
                        tasks[asyncio.ensure_future(queue.get())] = index
        finally:
            for task in tasks:
                task.cancel()

    async def _stream(self, rid, opened, usage, *, chat: bool, include_usage: bool,
                      logprobs: bool = False, echoed: list[list[int]] | None = None):
        """Server-sent events; a disconnect cancels this generator, whose finally aborts.
        ``echoed`` (completions' echo): each choice's prompt, whose text (and, with logprobs,
        scored tokens) its first event carries before its first token, as in the whole
        answer."""
        offsets = [0] * len(opened)  # completions' text_offset of each choice's next token
        unechoed = set(range(len(opened))) if echoed else set()
        try:
            if chat:  # every choice's first delta names the role, as OpenAI's do
                for index in range(len(opened)):
                    yield _sse(self._chunk(rid, index, None, None, chat=True, role=True))
            async for index, delta, reason, event in self._merge(opened, usage):
                # one event per token, as OpenAI's and vLLM's servers send, even when its text
                # waits for the next token (a split character): clients count tokens by events
                prompt = None
                if index in unechoed:
                    unechoed.discard(index)
                    prompt = echoed[index]
                    delta = self.tokenizer.decode(prompt, skip_special_tokens=True) + delta
                chunk = self._chunk(rid, index, delta, reason, chat=chat)
                if logprobs and (event.logprob is not None or prompt is not None):
                    scored = self._logprobs([event] if event.logprob is not None else [],
                                            chat=chat, offset=offsets[index], prompt=prompt,
                                            prompt_event=event)
                    chunk["choices"][0]["logprobs"] = scored
                    if not chat:
                        offsets[index] += sum(len(t) for t in scored["tokens"])
                yield _sse(chunk)
            if include_usage:
                chunk = self._chunk(rid, 0, None, None, chat=chat)
                chunk["choices"] = []
                chunk["usage"] = _usage(usage)
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        except RuntimeError as exc:
            yield _sse({"error": {"message": str(exc), "type": "server_error"}})
        finally:
            for seq_id, _, _ in opened:
                self.engine.abort(seq_id)

    def _chunk(self, rid, index, delta, reason, *, chat: bool, role: bool = False) -> dict:
        """One streamed event's body: choice ``index`` gains the text ``delta``."""
        if chat:
            content = {"role": "assistant", "content": ""} if role else {"content": delta or ""}
            choice = {"index": index, "delta": content, "finish_reason": reason}
            return self._response(rid, "chat.completion.chunk", [choice])
        return self._response(rid, "text_completion", [_text_choice(index, delta or "", reason)])

    def _logprobs(self, events: list[Event], *, chat: bool, offset: int = 0,
                  prompt: list[int] | None = None, prompt_event: Event | None = None) -> dict:
        """OpenAI's ``logprobs`` object for ``events``' tokens: completions' parallel lists
        (``top_logprobs`` a token -> log-prob map each, None without alternatives), chat's
        ``content`` entries with the tokens' UTF-8 bytes. ``prompt`` (echo): its tokens come
        first, the first one without a log-prob (nothing predicts it), the others scored by the
        ``prompt_logprobs`` of ``prompt_event`` (default: the first event)."""
        def text(token: int) -> str:
            return self.tokenizer.decode([token])

        if chat:
            def entry(token: int, logprob: float) -> dict:
                piece = text(token)
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

            return {"content": [
                {**entry(e.token, e.logprob),
                 "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs or ()]}
                for e in events
            ]}  # fmt: skip
        ids = [e.token for e in events]
        scores = [(e.logprob, e.top_logprobs) for e in events]
        if prompt is not None:
            prompt_event = prompt_event or (events[0] if events else None)
            scored_prompt = (prompt_event.prompt_logprobs if prompt_event else None) or ()
            ids = list(prompt) + ids
            scores = [(None, None), *scored_prompt, *scores]
        tokens = [text(t) for t in ids]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in scores],
            "top_logprobs": [{text(t): lp for t, lp in top} if top else None
                             for _, top in scores],
            "text_offset": offsets,
        }

    def _body(self, rid, texts, reasons, usage, *, chat: bool,
              logprobs: list[dict | None] | None = None) -> dict:
        """The whole answer of a request that does not stream: every choice's text (and its
        log-probs, where asked)."""
        pairs = list(enumerate(zip(texts, reasons, strict=True)))
        logprobs = logprobs or [None] * len(pairs)
        if chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r,
                 "logprobs": logprobs[i]}
                for i, (t, r) in pairs
            ]
            kind = "chat.completion"
        else:
            choices = [{**_text_choice(i, t, r), "logprobs": logprobs[i]} for i, (t, r) in pairs]
            kind = "text_completion"
        return {**self._response(rid, kind, choices), "usage": _usage(usage)}

    def _response(self, rid: str, kind: str, choices: list[dict]) -> dict:
        """What every response and streamed event of OpenAI's API carries around its choices."""
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }


def _prompt_count(prompt) -> int:
    """How many prompts ``prompt`` (a string, token ids, or a list of either) holds."""
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` covers: its vocabulary's longest
    entry as written (a byte-level piece spells each byte as one character, a character is at
    least one byte; byte-fallback pieces like ``<0x41>`` only overcount)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings, biases in [-100, 100]) as ids -> bias."""
    out = {}
    for key, value in (bias or {}).items():
        # digits only: int() also takes " 5 " and "1_0" (token 10)
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias key {key!r} is not a token id", "logit_bias")
        token = int(key)
        if not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key}] = {value} is outside [-100, 100]",
                               "logit_bias")
        out[token] = float(value)
    return out


def _logprobs_asked(body: _Request) -> int | None:
    """How many alternatives per token the request asks log-probs for (0: the chosen token's
    only), None when it asks none; RequestError for a malformed ask. Completions take
    ``logprobs: k``; chat ``logprobs: true`` and ``top_logprobs: k``."""
    chat = isinstance(body, ChatRequest)
    asked, top = body.logprobs, body.top_logprobs
    if chat:
        if asked not in (None, True, False):
            raise RequestError("logprobs must be true or false for chat completions", "logprobs")
        if top is not None and not asked:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        k = (top or 0) if asked else None
        name = "top_logprobs"
    else:
        if top is not None:
            raise RequestError("top_logprobs is a chat field; completions take logprobs: k",
                               "top_logprobs")
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int)):
            raise RequestError("logprobs must be an integer k (the top k per token)", "logprobs")
        k, name = asked, "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}", name)
    return k


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of a request pydantic refused: its first error, with ``param`` the
    field's path (``messages.0.role``) without pydantic's union-member tags (``prompt.str``)."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason, at = (first.get("ctx") or {}).get("error", "JSON decode error"), first["loc"][-1]
        return f"the request body is not valid JSON: {reason} at character {at}", None
    loc = first.get("loc", ())[1:]
    # the path ends at a union's member tag: what follows is inside that one member
    tags = [i for i, p in enumerate(loc) if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)]
    path = list(loc[: tags[0]] if tags else loc)
    if not path:
        if first.get("type") == "missing":
            return "the request body is empty: send a JSON object of the request's fields", None
        return ("the request body must be a JSON object of the request's fields (with "
                f"content-type application/json): {first.get('msg')}", None)
    param = ".".join(str(p) for p in path)
    if len(path) < len(loc) and str(path[-1]) in _EXPECTED:  # a field of several shapes
        return f"{param}: expected {_EXPECTED[str(path[-1])]}", param
    got = ""
    if str(first.get("type", "")).endswith("_type"):  # a wrong type: show what came
        got = f", got {json.dumps(first.get('input'), default=str)[:60]}"
    return f"{param}: {first.get('msg', 'invalid')}{got}", param


def _text_choice(index: int, text: str, reason: str | None) -> dict:
    """A /v1/completions choice, streamed or whole (the same fields in both)."""
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}


def _usage(usage: dict[str, int]) -> dict[str, int]:
    return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _text(text: str, param: str) -> str:
    """``text`` when it is Unicode that UTF-8 holds; a JSON string may carry a lone surrogate
    (``"\\ud800"``), which the tokenizer refused with a TypeError (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode text ({exc.reason} at character "
                           f"{exc.start}); send UTF-8 text", param) from None
    return text


def check_chat_template(tokenizer) -> None:
    """Compile the tokenizer's chat template once, at start: a template with a syntax error
    failed every chat request with a 500 instead of the server refusing to start."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(template)
    except TemplateSyntaxError as exc:
        raise ModelLoadError(f"the tokenizer's chat template does not compile ({exc.message}, line "
                         f"{exc.lineno}); fix chat_template in the model's tokenizer files") \
            from None


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
    return JSONResponse(error_json(status, message, kind, param), status_code=status)


def serve(server: Server, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the app until Ctrl-C (or SIGTERM): the engine (made with ``thread=False``) in this,
    the main, thread and uvicorn in another. The first signal stops accepting connections and
    keeps stepping, at step boundaries, until the requests in flight are answered (uvicorn's
    graceful shutdown); a second one quits at once."""
    import signal

    import uvicorn

    http = uvicorn.Server(uvicorn_config(server.app, host=host, port=port))
    # uvicorn installs signal handlers only in the main thread: this one keeps them
    thread = threading.Thread(target=http.run, name="compress-http", daemon=True)
    signals: list[int] = []
    handlers = {
        sig: signal.signal(sig, lambda number, _: signals.append(number))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    thread.start()
    try:
        server.engine.run(until=lambda: bool(signals) or not thread.is_alive())
        if thread.is_alive():
            print("draining the requests in flight (Ctrl-C again to quit now)", file=sys.stderr)
            http.should_exit = True
            server.engine.run(until=lambda: len(signals) > 1 or not thread.is_alive())
            http.force_exit = len(signals) > 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        server.engine.stop()
        thread.join(5)
    if not http.started and not signals:  # uvicorn logged why (a failed bind) and returned
        raise ModelLoadError(f"serve: the HTTP server did not start on {host}:{port} (its log "
                             "above says why); pick a free --port")
