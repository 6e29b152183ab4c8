"""From a validated OpenAI request to engine requests, and their token streams back to one route.

A request becomes one `Choice` per prompt and choice index; each is one engine request. What a prompt
must be (not empty, ids inside the vocabulary, shorter than the context and the KV cache) is checked
once, by the engine as it accepts it; this module only says which OpenAI parameter (and code) a
refusal is about, and adds the one check the engine cannot make: that max_tokens fits beside the prompt.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.image import ImageProcessor, expand_image_tokens, image_placeholder
from decoderlm.model.vision import Images
from decoderlm.sampling import SamplingParams
from decoderlm.serve.engine import Engine, EngineClosed
from decoderlm.serve.images import image_bytes
from decoderlm.serve.metrics import Metrics
from decoderlm.serve.protocol import ChatCompletionRequest, GenerationRequest, RequestError
from decoderlm.serve.text import Delta, Timing, text_deltas
from decoderlm.tokenizer import Tokenizer
from decoderlm.tools.grammar import GrammarError, Grammars, json_schema_grammar, tool_call_grammar
from decoderlm.tools.parsers import parser_name_for


GRAMMAR_TIMEOUT = 5.0  # seconds a schema or tool grammar may take to compile before the request is refused


@dataclass
class Choice:
    """One choice of a response: its prompt, sampling parameters and what it has produced so far."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    timing: Timing
    text: list[str] = field(default_factory=list)
    tokens: list[Delta] = field(default_factory=list)
    finish_reason: str | None = None
    images: Images | None = None  # the prompt's images, for its image placeholders
    request_id: str | None = None  # set once the engine has accepted it
    engine_done: bool = False  # the engine sent its final output (nothing to abort)


T = TypeVar("T")


async def off_thread(work: Callable[[], T]) -> T:
    """work() on a thread of its own that ends afterwards, awaited: torch work on a living thread keeps an
    OpenMP pool that slows the engine's (decoderlm.cli.serve.in_passing_thread says why)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result, error = work(), None
        except BaseException as e:  # handed to the awaiting route
            result, error = None, e
        loop.call_soon_threadsafe(settle, result, error)

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the route was cancelled meanwhile
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    threading.Thread(target=run, name="decoderlm-images", daemon=True).start()
    return await done


class ServedModel:
    """The model behind the routes: its engine, tokenizer, name, context length, the checkpoint's
    sampling defaults and the server's metrics."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, name: str, max_seq_len: int, defaults: dict, metrics: Metrics,
                 tool_parser: str | None = None, image_processor: ImageProcessor | None = None,
                 grammar_timeout: float | None = None) -> None:
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.image_processor = image_processor if engine.model.visual is not None else None
        self.max_seq_len, self.defaults, self.metrics = max_seq_len, defaults, metrics
        self.stop_token_ids = list(tokenizer.eos_token_ids)
        self.created = int(time.time())
        self.tool_parser = tool_parser or parser_name_for(tokenizer.chat_template)
        self.grammars = Grammars(tokenizer, compile_timeout=grammar_timeout or GRAMMAR_TIMEOUT)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise RequestError(f"model {name!r} does not exist; this server serves {self.name!r} (see GET /v1/models)",
                               "model", 404, "model_not_found")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Text as token ids; ids as they are (the engine checks them)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def read_images(self, req: ChatCompletionRequest) -> Images | None:
        """The request's image parts decoded and preprocessed, in order (None: it has none). Torch work:
        call it through `off_thread`."""
        parts = [(f"messages.{i}.content", url) for i, m in enumerate(req.messages) for url in m.image_urls]
        if not parts:
            return None
        if self.image_processor is None:
            raise RequestError(f"image content parts need a vision model; {self.name} reads text only, so send text parts", parts[0][0])
        pixels, grids = [], []
        for param, url in parts:
            try:
                one = self.image_processor([image_bytes(url)])
            except DecoderLMError as e:
                raise RequestError(f"{param}: {e}", param) from None
            pixels.append(one.pixel_values)
            grids.append(one.grid_thw)
        return Images(torch.cat(pixels), torch.cat(grids))

    def encode_chat(self, req: ChatCompletionRequest, images: Images | None = None) -> list[int]:
        """The chat template's prompt; each image part's placeholder repeated once per token of its image."""
        model = self.engine.model
        placeholder = image_placeholder(self.tokenizer, model.config.image_token_id) if images is not None else ""
        messages = [m.for_template(placeholder) for m in req.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=req.template_tools())
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        if images is not None:
            ids = expand_image_tokens(ids, model.config.image_token_id, images.tokens(model.visual.config.merge_size))
        return ids

    def grammar(self, req: GenerationRequest) -> str | None:
        """The grammar a chat request's answer must follow: its forced tool calls, or its response_format."""
        if not isinstance(req, ChatCompletionRequest):
            return None
        forced, fmt = req.forced_tools, req.response_format
        param = "tools" if forced else "response_format"
        try:
            if forced:
                return tool_call_grammar(forced, self.tool_parser, req.parallel_tool_calls)
            if fmt is not None and fmt.type == "json_object":
                return json_schema_grammar(None)
            if fmt is not None and fmt.type == "json_schema":
                return json_schema_grammar(fmt.json_schema.schema_ or {})
        except GrammarError as e:
            raise RequestError(f"{param}: {e}", param) from None
        return None

    async def compile_grammar(self, req: GenerationRequest) -> None:
        """Compile the request's grammar (into the cache) off the event loop, so a slow one holds no other
        request up; submit() then finds it compiled. A 400 if it cannot be enforced or is too slow."""
        grammar = self.grammar(req)
        if grammar is not None:
            await asyncio.to_thread(self.processors, req, grammar)

    def processors(self, req: GenerationRequest, grammar: str | None) -> list:
        """A fresh grammar state for one choice (the compiled grammar is shared through the cache)."""
        if grammar is None:
            return []
        try:
            return [self.grammars.processor(grammar)]
        except GrammarError as e:
            param = "tools" if isinstance(req, ChatCompletionRequest) and req.forced_tools else "response_format"
            raise RequestError(f"{param}: {e}", param) from None

    def submit(self, req: GenerationRequest, prompts: list[list[int]], arrival: float, images: Images | None = None) -> ChoiceStreams:
        """Start req.n choices per prompt; seeded requests give choice i the seed seed + i. images: the
        (single) prompt's."""
        values = self.defaults | req.sampling_values()
        stop_ids = [] if req.ignore_eos else self.stop_token_ids
        max_tokens = req.max_new_tokens
        grammar = self.grammar(req)
        choices = []
        for p, ids in enumerate(prompts):
            room = max(self.max_seq_len - len(ids), 0)  # 0: the prompt fills the context, which the engine refuses
            if max_tokens is not None and 0 < room < max_tokens:
                raise RequestError(f"max_tokens is {max_tokens} but the prompt ({len(ids)} tokens) leaves room for {room} in the "
                                   f"model's context of {self.max_seq_len}; lower max_tokens", "max_tokens", code="context_length_exceeded")
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                processors = self.processors(req, grammar)
                try:
                    params = SamplingParams(max_new_tokens=max_tokens or room, seed=seed, stop_token_ids=stop_ids,
                                            logits_processors=processors, **values)
                except DecoderLMError as e:  # a checkpoint default the request did not override
                    raise RequestError(str(e)) from None
                choices.append(Choice(p * req.n + i, p, ids, params, Timing(arrival), images=images))
        return ChoiceStreams(self, choices, req.stop_strings, req.engine_logprobs, req.prompt_param)


class ChoiceStreams:
    """The engine requests behind one HTTP request, one per choice, merged into one stream of deltas.
    `close()` aborts those still running — after a stop string, a failure, or a client that went away —
    and records the metrics, exactly once."""

    def __init__(self, served: ServedModel, choices: list[Choice], stops: list[str], logprobs: int | None, prompt_param: str) -> None:
        self.served, self.choices, self.closed = served, choices, False
        self.streams = []
        try:  # every request is added before any is awaited, so a refused one is a 400 before streaming
            for c in choices:
                request_id = uuid.uuid4().hex
                outputs = served.engine.add_request(c.prompt_ids, c.params, logprobs=logprobs, request_id=request_id, images=c.images)
                c.request_id = request_id
                self.streams.append(text_deltas(outputs, served.tokenizer, stops, c.timing))
        except EngineClosed:  # not the client's mistake: the server is going away, retry elsewhere
            self.close()
            raise RequestError("the server is shutting down; retry the request", status=503) from None
        except DecoderLMError as e:  # the engine's check of the prompt; OpenAI's code says when it is too long
            self.close()
            too_long = len(c.prompt_ids) >= served.engine.max_len
            raise RequestError(str(e), prompt_param, code="context_length_exceeded" if too_long else None) from None

    async def events(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """(choice, delta) pairs from all choices, in arrival order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(c: Choice, deltas: AsyncIterator[Delta]) -> None:
            try:
                async for delta in deltas:
                    await queue.put((c, delta))
            except Exception as e:  # re-raised by the consumer below
                await queue.put((c, e))
            finally:
                await queue.put((c, None))

        tasks = [asyncio.create_task(drain(c, d)) for c, d in zip(self.choices, self.streams)]
        try:
            left = len(tasks)
            while left:
                c, item = await queue.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                c.text.append(item.text)
                if item.token_id is not None:
                    c.tokens.append(item)
                if item.finish_reason is not None:
                    c.finish_reason, c.engine_done = item.finish_reason, not item.stop_string
                yield c, item
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
        metrics = self.served.metrics
        for c in self.choices:
            if c.request_id is not None and not c.engine_done:
                self.served.engine.abort(c.request_id)
            if c.request_id is not None:
                metrics.observe(c.timing)
                metrics.finished.labels(c.finish_reason or "abort").inc()
                if c.finish_reason is not None:
                    metrics.completion_tokens.inc(len(c.tokens))
