"""The OpenAI-compatible HTTP API: a thin FastAPI layer over the engine.

Each route validates the request (`protocol`), turns it into engine requests (one per choice), and
streams the engine's tokens back as text (`text`) — as server-sent events or one JSON body. The
engine runs in its own thread; the event loop only waits on its streams. Every error, including
the ones FastAPI and the door middleware raise, leaves as OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from decoderlm.errors import DecoderLMError
from decoderlm.sampling import SamplingParams
from decoderlm.serve.engine import EngineClosed
from decoderlm.serve.metrics import EngineCollector, Metrics
from decoderlm.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from decoderlm.serve.text import Delta, Timing, text_deltas

log = logging.getLogger("decoderlm.serve")
M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 2 * 1024 * 1024
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


# --- the door: key and body size, before any routing or parsing ------------------------------------


class Door:
    """ASGI middleware: 401 without the right bearer key on /v1/*, 413 for a body over the limit
    (by Content-Length, or counted as it streams in when the client sends it chunked)."""

    def __init__(self, app, api_key: str | None, max_body: int, on_reject: Callable[[], None]) -> None:
        self.app, self.api_key, self.max_body, self.on_reject = app, api_key, max_body, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                self.on_reject()
                message = "wrong API key" if given else "missing API key; send the header 'Authorization: Bearer <key>'"
                return await error_response(401, message, code="invalid_api_key")(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            self.on_reject()
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise HTTPException(413, self._too_large_message())
            return message

        await self.app(scope, counted_receive, send)

    def _too_large_message(self) -> str:
        return f"request body larger than {self.max_body} bytes; send a shorter prompt"

    async def _too_large(self, scope, receive, send) -> None:
        await error_response(413, self._too_large_message(), code="request_too_large")(scope, receive, send)


# --- turning a request into engine sequences ------------------------------------------------------


@dataclass
class Sequence:
    """One choice: its prompt, sampling parameters and what it has produced so far."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    timing: Timing
    text: list[str] = field(default_factory=list)
    tokens: list[Delta] = field(default_factory=list)
    finish_reason: str | None = None
    request_id: str | None = None  # set once the engine has accepted it
    engine_done: bool = False  # the engine sent its final output (nothing to abort)


class Server:
    """What the routes share: the engine, the tokenizer, the model's limits and the metrics."""

    def __init__(self, engine, tokenizer, model_name: str, max_seq_len: int, defaults: dict, metrics: Metrics) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_seq_len, self.defaults, self.metrics = max_seq_len, defaults, metrics
        self.stop_token_ids = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {self.model_name!r} (see GET /v1/models)",
                               "model", 404, "model_not_found")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            ids = list(prompt)
        if not ids:
            raise RequestError("prompt: the prompt is empty; send at least one token", "prompt")
        return ids

    def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template([m.for_template() for m in req.messages], add_generation_prompt=True)
        return self.encode_prompt(self.tokenizer.encode(text, add_special_tokens=False))  # the template writes BOS itself

    def sequences(self, req, prompts: list[list[int]], max_tokens: int | None, arrival: float) -> list[Sequence]:
        """n sequences per prompt; seeded requests give choice i the seed seed + i."""
        values = self.defaults | req.sampling_values()
        stop_ids = [] if req.ignore_eos else self.stop_token_ids
        out = []
        for p, ids in enumerate(prompts):
            room = self.max_seq_len - len(ids)
            if room <= 0:
                raise RequestError(f"the prompt is {len(ids)} tokens but the model's context is {self.max_seq_len}; shorten it",
                                   "messages" if isinstance(req, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
            if max_tokens is not None and max_tokens > room:
                raise RequestError(f"max_tokens is {max_tokens} but the prompt ({len(ids)} tokens) leaves room for {room} in the "
                                   f"model's context of {self.max_seq_len}; lower max_tokens", "max_tokens", code="context_length_exceeded")
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                try:
                    params = SamplingParams(max_new_tokens=max_tokens or room, seed=seed, stop_token_ids=stop_ids, **values)
                except DecoderLMError as e:  # a checkpoint default the request did not override
                    raise RequestError(str(e)) from None
                out.append(Sequence(p * req.n + i, p, ids, params, Timing(arrival)))
        return out

    # --- logprobs in OpenAI's two shapes --------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, deltas: list[Delta], offset: int = 0) -> dict:
        tokens = [self.token_text(d.token_id) for d in deltas]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        top = [self.top_by_text(d.top_logprobs or []) for d in deltas]
        return {"tokens": tokens, "token_logprobs": [d.logprob for d in deltas], "top_logprobs": top, "text_offset": offsets}

    def top_by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's {token text: logprob}; where two ids decode alike the likelier one is kept."""
        out: dict[str, float] = {}
        for token_id, logprob in top:
            out.setdefault(self.token_text(token_id), logprob)
        return out

    def chat_logprobs(self, deltas: list[Delta]) -> dict:
        def entry(token_id: int, logprob: float | None) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [entry(d.token_id, d.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in (d.top_logprobs or [])]}
                            for d in deltas], "refusal": None}


class Generation:
    """The engine requests behind one HTTP request. `close()` aborts those still running — after a
    stop string, a failure, or a client that went away — and records the metrics, exactly once."""

    def __init__(self, server: Server, seqs: list[Sequence], stops: list[str], logprobs: int | None) -> None:
        self.server, self.seqs, self.closed = server, seqs, False
        self.streams = []
        try:  # every request is added before any is awaited, so a refused one is a 400 before streaming
            for s in seqs:
                request_id = uuid.uuid4().hex
                outputs = server.engine.add_request(s.prompt_ids, s.params, logprobs=logprobs, request_id=request_id)
                s.request_id = request_id
                self.streams.append(text_deltas(outputs, server.tokenizer, stops, s.timing))
        except EngineClosed:  # not the client's mistake: the server is going away, retry elsewhere
            self.close()
            raise RequestError("the server is shutting down; retry the request", status=503) from None
        except DecoderLMError as e:
            self.close()
            raise RequestError(str(e), "prompt") from None

    async def events(self) -> AsyncIterator[tuple[Sequence, Delta]]:
        """(sequence, delta) pairs from all sequences, in arrival order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(s: Sequence, deltas: AsyncIterator[Delta]) -> None:
            try:
                async for delta in deltas:
                    await queue.put((s, delta))
            except Exception as e:  # re-raised by the consumer below
                await queue.put((s, e))
            finally:
                await queue.put((s, None))

        tasks = [asyncio.create_task(drain(s, d)) for s, d in zip(self.seqs, self.streams)]
        try:
            left = len(tasks)
            while left:
                s, item = await queue.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                s.text.append(item.text)
                if item.token_id is not None:
                    s.tokens.append(item)
                if item.finish_reason is not None:
                    s.finish_reason, s.engine_done = item.finish_reason, not item.stop_string
                yield s, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        async for _ in self.events():
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        metrics = self.server.metrics
        for s in self.seqs:
            if s.request_id is not None and not s.engine_done:
                self.server.engine.abort(s.request_id)
            if s.request_id is not None:
                metrics.observe(s.timing)
                metrics.finished.labels(s.finish_reason or "abort").inc()
                if s.finish_reason is not None:
                    metrics.completion_tokens.inc(len(s.tokens))


def usage(seqs: list[Sequence]) -> dict:
    prompt = sum(len(ids) for ids in {s.prompt_index: s.prompt_ids for s in seqs}.values())
    completion = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose engine requests are closed however the response ends: normally, by
    an error, or by a client disconnect (Starlette then cancels the send mid-way)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def until_disconnect(request: Request, work: Awaitable[None]) -> bool:
    """Await `work`, cancelling it if the client goes away first. True if it finished."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
    task.result()
    return True


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form-encoded)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestError(*describe(e.errors()[0])) from None


def describe(error: dict) -> tuple[str, str | None]:
    """One pydantic error as (message, param) for OpenAI's error JSON."""
    if error["type"] == "json_invalid":
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')}); send a JSON object", None
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error" and ": " in message:  # our validators start with the field's name
        return message, message.split(": ", 1)[0]
    loc = list(error["loc"])
    while loc and isinstance(loc[-1], str) and (loc[-1] in ("str", "int", "float", "bool") or "[" in loc[-1]):
        loc.pop()  # pydantic names the union member it tried last ("prompt.list[int]"); the field is enough
    param = ".".join(str(p) for p in loc) or None
    return (f"{param}: {message}", param) if param else (f"the body: {message}; send a JSON object", None)


ChunkFn = Callable[[Sequence, Delta], dict | None]


async def respond(request: Request, gen: Generation, head: dict, stream: bool, include_usage: bool,
                  chunk: ChunkFn, choice: Callable[[Sequence], dict]) -> Response:
    """The response to a generation request: SSE chunks (`chunk` per delta) or one body (`choice` per sequence)."""
    requests = gen.server.metrics.requests
    if stream:
        return EventStream(stream_events(gen, head, chunk, include_usage), gen.close)
    try:
        finished = await until_disconnect(request, gen.run())
    finally:
        gen.close()
    requests.labels("ok" if finished else "aborted").inc()
    if not finished:
        return Response(status_code=499)  # nobody is listening; nginx's code for "client closed request"
    return JSONResponse(head | {"choices": [choice(s) for s in gen.seqs], "usage": usage(gen.seqs)})


async def stream_events(gen: Generation, head: dict, chunk: ChunkFn, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks as tokens arrive, then usage (if asked) and [DONE]."""
    extra = {"usage": None} if include_usage else {}
    finished = False
    events = gen.events()
    try:
        async for s, d in events:
            choice = chunk(s, d)
            if choice is not None:
                yield sse(head | {"choices": [choice]} | extra)
        finished = True
    except Exception:  # the response has started: report in the stream, never as a traceback
        log.exception("generation failed")
        yield sse({"error": {"message": "internal server error during generation", "type": "server_error", "param": None, "code": None}})
    finally:
        await events.aclose()
        gen.server.metrics.requests.labels("ok" if finished else "aborted").inc()
    if include_usage:
        yield sse(head | {"choices": [], "usage": usage(gen.seqs)})
    yield sse("[DONE]")


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None, *, max_seq_len: int,
               sampling_defaults: dict | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app for one started engine. sampling_defaults (the checkpoint's generation_config) fill the
    sampling parameters a request leaves out; OpenAI's defaults (temperature 1, top_p 1) fill the rest."""
    metrics = Metrics()
    metrics.registry.register(EngineCollector(engine))
    server = Server(engine, tokenizer, model_name, max_seq_len, dict(sampling_defaults or {}), metrics)
    app = FastAPI(title="decoderlm", summary="OpenAI-compatible API over decoderlm's batching engine")
    rejected = metrics.requests.labels("rejected").inc

    def reject(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if 400 <= status < 500:
            rejected()
        return error_response(status, message, param, code)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return reject(e.status, str(e), e.param, e.code)

    @app.exception_handler(DecoderLMError)
    async def _user_error(request: Request, e: DecoderLMError) -> JSONResponse:
        return reject(400, str(e))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        return reject(e.status_code, str(e.detail), code="request_too_large" if e.status_code == 413 else None)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal server error; the server log has the details")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created, "owned_by": "decoderlm",
                                            "max_model_len": max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse_body(request, CompletionRequest)
        server.check_model(req.model)
        seqs = server.sequences(req, [server.encode_prompt(p) for p in req.prompts], req.max_tokens, arrival)
        gen = Generation(server, seqs, req.stop_strings, req.logprobs)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        want_logprobs = req.logprobs is not None

        def chunk(s: Sequence, d: Delta) -> dict | None:
            if not d.text and d.finish_reason is None and not (want_logprobs and d.token_id is not None):
                return None
            lp = server.completion_logprobs([d] if d.token_id is not None else []) if want_logprobs else None
            return {"index": s.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}

        def choice(s: Sequence) -> dict:
            lp = server.completion_logprobs(s.tokens) if want_logprobs else None
            return {"index": s.index, "text": "".join(s.text), "logprobs": lp, "finish_reason": s.finish_reason}

        return await respond(request, gen, head, req.stream, req.include_usage, chunk, choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse_body(request, ChatCompletionRequest)
        server.check_model(req.model)
        seqs = server.sequences(req, [server.encode_chat(req)], req.max_new_tokens, arrival)
        gen = Generation(server, seqs, req.stop_strings, req.engine_logprobs)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model_name}
        started: set[int] = set()

        def chunk(s: Sequence, d: Delta) -> dict | None:
            delta = {} if s.index in started else {"role": "assistant", "content": ""}  # the first chunk names the role
            started.add(s.index)
            if d.text:
                delta["content"] = d.text
            if not delta and d.finish_reason is None and not (req.logprobs and d.token_id is not None):
                return None
            lp = server.chat_logprobs([d] if d.token_id is not None else []) if req.logprobs else None
            return {"index": s.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}

        def choice(s: Sequence) -> dict:
            lp = server.chat_logprobs(s.tokens) if req.logprobs else None
            return {"index": s.index, "message": {"role": "assistant", "content": "".join(s.text)}, "logprobs": lp,
                    "finish_reason": s.finish_reason}

        return await respond(request, gen, head | {"object": "chat.completion.chunk"} if req.stream else head,
                             req.stream, req.include_usage, chunk, choice)

    app.add_middleware(Door, api_key=api_key, max_body=max_body_bytes, on_reject=rejected)
    return app


class _Uvicorn(uvicorn.Server):
    """Stops the engine as shutdown begins, so streams in flight end at once (finish_reason "abort")
    instead of holding the shutdown until uvicorn cancels them mid-send."""

    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)


def serve(app: FastAPI, engine, sock: socket.socket) -> None:
    """Serve on a bound socket until SIGINT or SIGTERM, then shut down gracefully and return."""
    # uvicorn re-raises the signal it caught to the handler that was there before it started;
    # a no-op one lets the caller stop the engine and exit normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Uvicorn(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), engine).run(sockets=[sock])
