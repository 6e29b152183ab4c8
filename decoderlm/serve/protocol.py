"""OpenAI request bodies as pydantic models, and the one-line error a bad body gets.

Types are strict (no "0.5" → 0.5 coercion) and ranges follow OpenAI's documentation. A field OpenAI
has but this server cannot honour (logit_bias, echo, best_of > n, ...) is refused
with a 400 rather than silently ignored; so is a field OpenAI does not have, as OpenAI itself answers,
so that a misspelled parameter never passes unnoticed.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decoderlm.errors import DecoderLMError

MAX_N = 16  # choices per request: each is one engine sequence
MAX_LOGPROBS = 20
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_SEED = 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(DecoderLMError):
    """A bad request, with the OpenAI error fields it is reported with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads its chunks against side channels; nothing to pad here


class _GenerationRequest(_Strict):
    """The parameters completions and chat share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off (vLLM's convention)")
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=MAX_SEED - MAX_N)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's and llama-server's extension: run to max_tokens (for benchmarks)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_shared(self) -> _GenerationRequest:
        stops = self.stop_strings
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server; leave it out")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_values(self) -> dict:
        """The SamplingParams fields the client set (the checkpoint's defaults fill the rest)."""
        names = ("temperature", "top_p", "min_p", "repetition_penalty")
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.top_k is not None:
            values["top_k"] = max(self.top_k, 0)
        return values | {"frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}


class CompletionRequest(_GenerationRequest):
    prompt_param: ClassVar[str] = "prompt"  # the field a bad prompt is reported against
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported by this server; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported; leave it out")
        if self.suffix:
            raise ValueError("suffix: not supported by this server; leave it out")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be an empty list")
        if len(self.prompts) * self.n > MAX_N:
            raise ValueError(f"prompt: {len(self.prompts)} prompts × n={self.n} exceeds {MAX_N} sequences per request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs


class ImageUrl(_Strict):
    url: str  # a data: URL (base64); the server fetches nothing
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not read: the processor's pixel budget decides


class ContentPart(BaseModel):
    """One part of a message's content: text, or an image (the others carry their own fields, refused below)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call an earlier assistant turn made, sent back with the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    tool_calls: list[ToolCallIn] | None = None  # before content: an assistant message that calls tools may have none
    function_call: dict | None = None
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None  # sent back with an assistant message the client received; not read
    annotations: list | None = None  # likewise

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role == "function":
            raise ValueError("function messages are OpenAI's deprecated form; send role 'tool' with tool_call_id")
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        return role

    @field_validator("content")
    @classmethod
    def _known_parts(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        for part in content if isinstance(content, list) else []:
            if part.type == "image_url":
                if part.image_url is None or part.text is not None or set(part.model_extra or ()):
                    raise ValueError("an image content part has exactly the fields 'type' and 'image_url' ({'url': 'data:...'})")
                continue
            if part.type != "text":
                raise ValueError(f"{part.type} content parts are not supported; send {{'type': 'text', 'text': ...}} or image_url parts")
            if part.text is None or part.image_url is not None or set(part.model_extra or ()):
                raise ValueError("a text content part has exactly the fields 'type' and 'text'")
        return content

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        return [p.image_url.url for p in self.content if p.image_url is not None] if isinstance(self.content, list) else []

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("function_call is OpenAI's deprecated form; send tool_calls")
        return value

    @model_validator(mode="after")
    def _check_turn(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may leave it out)")
        return self

    def for_template(self, image_text: str = "") -> dict:
        """The dict a chat template expects, as transformers passes it: OpenAI's "developer" role is
        the templates' "system"; a call's arguments are an object (the JSON text parsed); each image
        part becomes image_text (the model's image placeholder)."""
        content = self.content
        text = content if isinstance(content, str) or content is None else "".join(image_text if p.text is None else p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


def _arguments(text: str) -> dict | str:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required exactly when type is 'json_schema'")
        return self


class ChatCompletionRequest(_GenerationRequest):
    prompt_param: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two tools share a name; give each function its own name")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice: needs tools; send tools, or leave tool_choice out")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names {self.tool_choice.function.name!r}, which is not among the tools ({', '.join(names)})")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model is shown the tools and its answer is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[dict] | None:
        """The tools a call must be made to (tool_choice required or named), else None."""
        if not self.calls_tools or self.tool_choice in (None, "auto"):
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.calls_tools else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


GenerationRequest = CompletionRequest | ChatCompletionRequest
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def parse_request(body: bytes, model: type[R]) -> R:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form-encoded)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(*describe(e.errors()[0])) from None


def describe(error: dict) -> tuple[str, str | None]:
    """One pydantic error as (message, param) for OpenAI's error JSON, in the request's words."""
    if error["type"] == "json_invalid":
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')}); send a JSON object", None
    loc = list(error["loc"])
    while loc and isinstance(loc[-1], str) and (loc[-1] in ("str", "int", "float", "bool") or "[" in loc[-1]):
        loc.pop()  # pydantic names the union member it tried last ("prompt.list[int]"); the field is enough
    param = ".".join(str(p) for p in loc) or None
    if error["type"] == "extra_forbidden":
        return f"unrecognized request argument {param!r}; check its spelling, or leave it out", param
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error":
        field = message.split(": ", 1)[0] if ": " in message else ""
        if field.isidentifier() and (not loc or loc[-1] != field):  # a model's check: its message starts with the field's name
            return message, f"{param}.{field}" if param else field
        return message, param  # a field's own check: its message names the field in the user's words
    return (f"{param}: {message}", param) if param else (f"the body: {message}; send a JSON object", None)
