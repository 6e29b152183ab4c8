"""The OpenAI-compatible HTTP API: a thin FastAPI layer over the engine.

Each route parses the body (`protocol`), turns it into one engine request per choice (`requests`),
and streams the engine's tokens back as text (`text`) in OpenAI's formats (`openai`): as server-sent
events or one JSON body. The engine runs in its own thread; the event loop only waits on its streams.
Every error, including the ones FastAPI and the middleware raise, leaves as OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from decoderlm.errors import DecoderLMError
from decoderlm.image import ImageProcessor
from decoderlm.serve.metrics import EngineCollector, Metrics
from decoderlm.serve.openai import ChatFormat, CompletionFormat, ResponseFormat, error_body, sse, usage
from decoderlm.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_request
from decoderlm.serve.requests import ChoiceStreams, ServedModel, off_thread

log = logging.getLogger("decoderlm.serve")
MAX_BODY_BYTES = 2 * 1024 * 1024


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


# --- key and body size, before any routing or parsing ---------------------------------------------


class KeyAndSizeCheck:
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


async def disconnected(request: Request) -> None:
    """Return when the client hangs up (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[None]) -> bool:
    """Await `work`, cancelling it the moment the client goes away. True if it finished."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True


async def respond(request: Request, streams: ChoiceStreams, fmt: ResponseFormat, stream: bool, include_usage: bool) -> Response:
    """The response to a generation request: SSE chunks as tokens arrive, or one body at the end."""
    if stream:
        return EventStream(stream_events(streams, fmt, include_usage), streams.close)
    try:
        finished = await until_disconnect(request, streams.run())
    finally:
        streams.close()
    streams.served.metrics.requests.labels("ok" if finished else "aborted").inc()
    if not finished:
        return Response(status_code=499)  # nobody is listening; nginx's code for "client closed request"
    return JSONResponse(fmt.head | {"choices": [fmt.choice(c) for c in streams.choices], "usage": usage(streams.choices)})


async def stream_events(streams: ChoiceStreams, fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks as tokens arrive, then usage (if asked) and [DONE]."""
    extra = {"usage": None} if include_usage else {}
    finished = False
    events = streams.events()
    try:
        async for c, d in events:
            choice = fmt.chunk(c, d)
            if choice is not None:
                yield sse(fmt.chunk_head | {"choices": [choice]} | extra)
        finished = True
    except Exception:  # the response has started: report in the stream, never as a traceback
        log.exception("generation failed")
        yield sse(error_body(500, "internal server error during generation"))
    finally:
        await events.aclose()
        streams.served.metrics.requests.labels("ok" if finished else "aborted").inc()
    if include_usage:
        yield sse(fmt.chunk_head | {"choices": [], "usage": usage(streams.choices)})
    yield sse("[DONE]")


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None, *, max_seq_len: int,
               sampling_defaults: dict | None = None, max_body_bytes: int = MAX_BODY_BYTES, tool_parser: str | None = None,
               image_processor: ImageProcessor | None = None, grammar_timeout: float | None = None) -> FastAPI:
    """The app for one started engine. sampling_defaults (the checkpoint's generation_config) fill the
    sampling parameters a request leaves out; OpenAI's defaults (temperature 1, top_p 1) fill the rest.
    tool_parser: the format tool calls are read in (default: the one the chat template teaches).
    image_processor: how a vision-language model's image parts are preprocessed (default: transformers'
    Qwen2-VL defaults). grammar_timeout: seconds a request's schema or tool grammar may take to compile,
    then a 400 (default: 5)."""
    metrics = Metrics()
    metrics.registry.register(EngineCollector(engine))
    served = ServedModel(engine, tokenizer, model_name, max_seq_len, dict(sampling_defaults or {}), metrics, tool_parser,
                         image_processor or ImageProcessor(), grammar_timeout)
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
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": served.created, "owned_by": "decoderlm",
                                            "max_model_len": max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_request(await request.body(), CompletionRequest)
        served.check_model(req.model)
        streams = served.submit(req, [served.encode_prompt(p) for p in req.prompts], arrival)
        fmt = CompletionFormat(tokenizer, model_name, logprobs=req.logprobs is not None)
        return await respond(request, streams, fmt, req.stream, req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_request(await request.body(), ChatCompletionRequest)
        served.check_model(req.model)
        images = await off_thread(lambda: served.read_images(req)) if any(m.image_urls for m in req.messages) else None
        await served.compile_grammar(req)
        streams = served.submit(req, [served.encode_chat(req, images)], arrival, images)
        fmt = ChatFormat(tokenizer, model_name, logprobs=req.logprobs, tool_parser=served.tool_parser if req.calls_tools else None,
                         max_calls=None if req.parallel_tool_calls else 1)
        return await respond(request, streams, fmt, req.stream, req.include_usage)

    app.add_middleware(KeyAndSizeCheck, api_key=api_key, max_body=max_body_bytes, on_reject=rejected)
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


def server_config(app: FastAPI) -> uvicorn.Config:
    """uvicorn's settings. "auto" takes uvloop's event loop and httptools' HTTP parser (both dependencies, in C;
    they cost the loop's thread a third less CPU per streamed token than asyncio's loop and h11, and that thread
    takes its CPU from the decode step's), or asyncio and h11 where they are missing."""
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, loop="auto", http="auto")


def serve(app: FastAPI, engine, sock: socket.socket) -> None:
    """Serve on a bound socket until SIGINT or SIGTERM, then shut down gracefully and return."""
    # uvicorn re-raises the signal it caught to the handler that was there before it started;
    # a no-op one lets the caller stop the engine and exit normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Uvicorn(server_config(app), engine).run(sockets=[sock])
