"""OpenAI's response formats: completion and chat bodies and stream chunks (their choices, logprobs
and usage), the error JSON, and the server-sent-event line that carries a chunk."""

from __future__ import annotations

import json
import time
import uuid

from decoderlm.serve.requests import Choice
from decoderlm.serve.text import Delta
from decoderlm.tools.parsers import CallDelta, ToolParser, get_parser

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(choices: list[Choice]) -> dict:
    """Token counts; a prompt shared by n choices counts once."""
    prompt = sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values())
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class CompletionFormat:
    """/v1/completions: `text_completion` bodies and chunks, logprobs as parallel lists."""

    def __init__(self, tokenizer, model_name: str, logprobs: bool) -> None:
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        self.chunk_head = self.head

    def chunk(self, c: Choice, d: Delta) -> dict | None:
        """The chunk choice for one delta; None when it carries nothing to send."""
        if not d.text and d.finish_reason is None and not (self.logprobs and d.token_id is not None):
            return None
        lp = self._logprobs([d] if d.token_id is not None else []) if self.logprobs else None
        return {"index": c.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}

    def choice(self, c: Choice) -> dict:
        lp = self._logprobs(c.tokens) if self.logprobs else None
        return {"index": c.index, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason}

    def _logprobs(self, deltas: list[Delta]) -> dict:
        tokens = [token_text(self.tokenizer, d.token_id) for d in deltas]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        top = [self._top_by_text(d.top_logprobs or []) for d in deltas]
        return {"tokens": tokens, "token_logprobs": [d.logprob for d in deltas], "top_logprobs": top, "text_offset": offsets}

    def _top_by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's {token text: logprob}; where two ids decode alike the likelier one is kept."""
        out: dict[str, float] = {}
        for token_id, logprob in top:
            out.setdefault(token_text(self.tokenizer, token_id), logprob)
        return out


class ChatFormat:
    """/v1/chat/completions: `chat.completion` bodies, `chat.completion.chunk` chunks whose first delta
    per choice names the role, logprobs as a list of entries with their top alternatives.

    With `tool_parser` set, each choice's text goes through its own incremental tool parser
    (`decoderlm.tools.parsers`): the chunks carry what it releases (content, then `tool_calls` deltas:
    id and name first, arguments in pieces), the body what it gives for the whole text, so the two
    agree. `max_calls` 1 (parallel_tool_calls false) keeps the first call only. A choice that made a
    call and stopped finishes with "tool_calls"."""

    def __init__(self, tokenizer, model_name: str, logprobs: bool, tool_parser: str | None = None, max_calls: int | None = None) -> None:
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.tool_parser, self.max_calls = tool_parser, max_calls
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model_name}
        self.chunk_head = self.head | {"object": "chat.completion.chunk"}
        self.started: set[int] = set()  # choices whose first chunk went out
        self.parsers: dict[int, ToolParser] = {}

    def chunk(self, c: Choice, d: Delta) -> dict | None:
        delta = {} if c.index in self.started else {"role": "assistant", "content": ""}
        self.started.add(c.index)
        finish = d.finish_reason
        if self.tool_parser is None:
            if d.text:
                delta["content"] = d.text
        else:
            parser = self.parsers.setdefault(c.index, get_parser(self.tool_parser))
            parsed = parser.push(d.text)
            if finish is not None:
                end = parser.finish()
                parsed.content += end.content
                parsed.calls += end.calls
                finish = self._finish_reason(finish, parser.calls)
            if parsed.content:
                delta["content"] = parsed.content
            calls = [call_delta(cd) for cd in parsed.calls if self.max_calls is None or cd.index < self.max_calls]
            if calls:
                delta["tool_calls"] = calls
        if not delta and finish is None and not (self.logprobs and d.token_id is not None):
            return None
        lp = self._logprobs([d] if d.token_id is not None else []) if self.logprobs else None
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def choice(self, c: Choice) -> dict:
        lp = self._logprobs(c.tokens) if self.logprobs else None
        message, finish = {"role": "assistant", "content": "".join(c.text)}, c.finish_reason
        if self.tool_parser is not None:
            content, calls = get_parser(self.tool_parser).parse("".join(c.text))
            calls = calls[: self.max_calls]
            message["content"] = content or None if calls else content
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            finish = self._finish_reason(finish, calls)
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}

    @staticmethod
    def _finish_reason(reason: str | None, calls: list) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def _logprobs(self, deltas: list[Delta]) -> dict:
        def entry(token_id: int, logprob: float | None) -> dict:
            text = token_text(self.tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [entry(d.token_id, d.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in (d.top_logprobs or [])]}
                            for d in deltas], "refusal": None}


def call_delta(d: CallDelta) -> dict:
    """A streamed tool_calls entry: the first names the call, the rest add to its arguments."""
    if d.name is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


ResponseFormat = CompletionFormat | ChatFormat


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
