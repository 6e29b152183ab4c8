"""Tool-call parsers: a model's text → content and tool calls, incrementally.

A model writes a call as text in the format its chat template taught it. Each format here is one
configuration of one character-level state machine, so the same parser serves a stream (text pushed
token by token) and a whole answer (pushed at once), and the result never depends on where the text
was split. A call opens with a trigger (a tag, or a bare `{`/`[` at the very start of the answer),
then a JSON object whose header `{"name": "...", "arguments": ` commits it: the name is emitted, the
arguments stream out as their raw JSON text. Text that merely mentions a tag (`<tool_call> is a tag`)
fails the header and stays content.

| format  | what the model writes                                                    |
|---------|--------------------------------------------------------------------------|
| hermes  | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call  (Hermes, Qwen) |
| llama3  | `<|python_tag|>{"name": ..., "parameters": {...}}` or that JSON alone, `;` between calls |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (or the list alone), or the newer  |
|         | `[TOOL_CALLS]name[ARGS]{...}`, the tag again before each further call       |
| generic | hermes' tags: what the generic prompt (`decoderlm.tools.prompt`) asks for  |
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from decoderlm.errors import DecoderLMError


@dataclass
class CallDelta:
    """A piece of tool call `index`: its first piece carries the id and the name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`

    def parsed_arguments(self) -> dict | str:
        """The arguments as JSON reads them; their text where it is not whole JSON (a call cut short)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFormat:
    """How one model family writes tool calls."""

    open_tags: tuple[str, ...]  # any of these starts a call (or, for `array`, a list of calls)
    close_tag: str | None = None  # hermes: each call ends with it
    bare_start: str | None = None  # the answer may start with this instead of a tag (array formats: `[` + the first call's `{`)
    separator: str | None = None  # between calls of one group (llama3 ";", mistral ",")
    array: bool = False  # the calls are a JSON list: `[` opens the group, `]` closes it
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    args_tag: str | None = None  # mistral's newer calls: the open tag, the name, this tag, the arguments object


FORMATS = {
    "hermes": CallFormat(("<tool_call>",), close_tag="</tool_call>"),
    "generic": CallFormat(("<tool_call>",), close_tag="</tool_call>"),
    "llama3": CallFormat(("<|python_tag|>",), bare_start="{", separator=";"),
    "mistral": CallFormat(("[TOOL_CALLS]",), bare_start="[{", separator=",", array=True, args_tag="[ARGS]"),
}


def parser_name_for(template: str | None) -> str:
    """The format a chat template teaches: by the markers its tool section writes."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return "generic"


def get_parser(name: str, new_id: Callable[[], str] | None = None) -> ToolParser:
    if name not in FORMATS:
        raise DecoderLMError(f"unknown tool parser {name!r}; use one of {', '.join(FORMATS)}")
    return ToolParser(FORMATS[name], new_id)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_WS = " \t\r\n"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class _Header:
    """Matches `{"name": "<name>", "<argument key>":` char by char: 'more', 'fail', or done with the name."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.steps: list[tuple[str, ...] | None] = [("{",), ('"name"',), (":",), None, (",",), tuple(f'"{k}"' for k in keys), (":",)]

    def check(self, text: str) -> str | tuple[str]:
        i = 0
        name = None
        for step in self.steps:
            while i < len(text) and text[i] in _WS:
                i += 1
            rest = text[i:]
            if not rest:
                return "more"
            if step is None:  # the name: a JSON string
                if rest[0] != '"':
                    return "fail"
                j, escaped = 1, False
                while j < len(rest) and (escaped or rest[j] != '"'):
                    escaped = not escaped and rest[j] == "\\"
                    j += 1
                if j == len(rest):
                    return "more"
                try:
                    name = json.loads(rest[: j + 1])
                except json.JSONDecodeError:
                    return "fail"
                i += j + 1
                continue
            lit = next((s for s in step if rest.startswith(s)), None)
            if lit is None:
                return "more" if any(s.startswith(rest) for s in step) else "fail"
            i += len(lit)
        return (name,)


class _Value:
    """Tracks one JSON value char by char: where it ends (depth back to 0, or a scalar's terminator)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False

    def feed(self, ch: str) -> str:
        """'skip' (whitespace before the value), 'in' (part of it), 'done' (its last char), 'after' (ch is past its end)."""
        if not self.started:
            if ch in _WS:
                return "skip"
            self.started = True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return "done" if self.depth == 0 else "in"
            return "in"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            if self.depth == 0:
                return "after"
            self.depth -= 1
            return "done" if self.depth == 0 else "in"
        elif ch == "," and self.depth == 0:
            return "after"
        return "in"


class ToolParser:
    """One answer's text → content and tool calls, pushed in pieces (see the module docstring).

    Whitespace next to a call is held and dropped, so `"Sure.\\n<tool_call>..."` has content `"Sure."`."""

    def __init__(self, fmt: CallFormat, new_id: Callable[[], str] | None = None) -> None:
        self.fmt, self.new_id = fmt, new_id or _call_id
        self.header = _Header(fmt.argument_keys)
        self.state = "text"
        self.held = ""  # text that may still turn out to be a trigger, a tag or a call
        self.body_start = 0  # where the call object starts in `held`
        self.space = ""  # whitespace held in text: dropped next to a call
        self.started = False  # any non-whitespace seen (a bare trigger only counts at the start)
        self.content = ""
        self.calls: list[ToolCall] = []
        self.out = ParsedDelta()
        self.value = _Value()  # the arguments' JSON value, then the rest of the call object
        self.named = False  # the call in progress is `name[ARGS]{...}`: it ends with its arguments
        self.unfinished = ""  # the answer ended in a call before its name was read: that call's text (also content)

    def push(self, text: str) -> ParsedDelta:
        for ch in text:
            getattr(self, f"_{self.state}")(ch)
        out, self.out = self.out, ParsedDelta()
        return out

    def finish(self) -> ParsedDelta:
        """The end of the answer: a call in progress ends; held text that never became a call is content."""
        if self.state in ("list", "header", "raw", "named"):
            if not (self.fmt.close_tag and self._whole_call(self.held[self.body_start :])):
                self.unfinished = self.held
                self._revert()
        elif self.state == "text":
            self.unfinished = self.held  # the start of a trigger, if anything
            self._release(self.held)
        if not self.calls:
            self._emit(self.space)
        self.held, self.space, self.state = "", "", "done"
        out, self.out = self.out, ParsedDelta()
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer at once: (content, calls)."""
        self.push(text)
        self.finish()
        return self.content, self.calls

    # --- the states, one method each: what one character does --------------------------------

    def _emit(self, text: str) -> None:
        self.out.content += text
        self.content += text

    def _release(self, text: str) -> None:
        for c in text:
            if c in _WS:
                self.space += c
            else:
                self._emit(self.space + c)
                self.space, self.started = "", True

    def _text(self, ch: str) -> None:
        self.held += ch
        tags = self.fmt.open_tags + ((self.fmt.bare_start,) if self.fmt.bare_start and not self.started else ())
        tag = next((t for t in tags if self.held.endswith(t)), None)
        if tag is not None:
            self._release(self.held[: -len(tag)])
            self.started, self.held = True, tag
            bare = tag == self.fmt.bare_start
            self.body_start = (1 if self.fmt.array else 0) if bare else len(tag)
            self.state = "list" if self.fmt.array and not bare else "header"
            if len(self.held) > self.body_start:
                self._header("")
            return
        keep = max((k for t in tags for k in range(1, min(len(t), len(self.held)) + 1) if self.held.endswith(t[:k])), default=0)
        release, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self._release(release)

    def _list(self, ch: str) -> None:
        """Array formats after their tag: the list's `[` (or, with an `args_tag`, a call's name)."""
        self.held += ch
        if ch == "[":
            self.state, self.body_start = "header", len(self.held)
        elif ch not in _WS and self.fmt.args_tag:
            self.state = "named"
            self._named("")
        elif ch not in _WS:
            self._revert()

    def _named(self, ch: str) -> None:
        """Mistral's newer calls after their tag: a name, `[ARGS]`, then the arguments object commits the call."""
        self.held += ch
        body = self.held[self.body_start :].lstrip(_WS)
        name = _NAME.match(body)
        rest = body[name.end() :] if name else body
        tag = self.fmt.args_tag
        after = rest[len(tag) :].lstrip(_WS)
        if name is None or not (tag.startswith(rest) or rest.startswith(tag)) or after not in ("", "{"):
            self._revert()
            return
        if not after:
            return
        call = ToolCall(self.new_id(), name.group(), "")
        self.out.calls.append(CallDelta(len(self.calls), call.id, call.name))
        self.calls.append(call)
        self.held, self.space, self.state, self.value, self.named = "", "", "arguments", _Value(), True
        self._arguments("{")

    def _header(self, ch: str) -> None:
        self.held += ch
        result = self.header.check(self.held[self.body_start :])
        if result == "more":
            return
        if result == "fail":
            body = self.held[self.body_start :].lstrip(_WS)
            if self.fmt.close_tag and body.startswith("{") and body[1:].lstrip(_WS)[:1] == '"':
                self.state = "raw"  # a JSON object with its keys in another order: read it whole at the close tag
            else:
                self._revert()
            return
        call = ToolCall(self.new_id(), result[0], "")
        self.out.calls.append(CallDelta(len(self.calls), call.id, call.name))
        self.calls.append(call)
        self.held, self.space, self.state, self.value = "", "", "arguments", _Value()

    def _revert(self) -> None:
        """Not a call after all: the held text is content, and no trigger is looked for inside it."""
        self._emit(self.space + self.held)
        self.space, self.held, self.state = "", "", "text"

    def _raw(self, ch: str) -> None:
        self.held += ch
        if self.held.endswith(self.fmt.close_tag):
            if self._whole_call(self.held[self.body_start : -len(self.fmt.close_tag)]):
                self.held, self.state = "", "text"
            else:
                self._revert()

    def _whole_call(self, body: str) -> bool:
        """A whole call object, its keys in any order; False if the body is not one."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = next((obj[k] for k in self.fmt.argument_keys if k in obj), {})
        call = ToolCall(self.new_id(), obj["name"], json.dumps(args, ensure_ascii=False))
        self.out.calls.append(CallDelta(len(self.calls), call.id, call.name, call.arguments))
        self.calls.append(call)
        self.space = ""
        return True

    def _arguments(self, ch: str) -> None:
        kind = self.value.feed(ch)
        if kind in ("in", "done"):
            self.calls[-1].arguments += ch
            last = self.out.calls[-1] if self.out.calls else None
            if last is not None and last.index == len(self.calls) - 1:
                last.arguments += ch
            else:
                self.out.calls.append(CallDelta(len(self.calls) - 1, arguments=ch))
        if kind == "done" and self.named:  # no object around the arguments: the call ends here
            self.state, self.named = "text", False
        elif kind in ("done", "after"):
            self.state, self.value = "tail", _Value()
            self.value.started, self.value.depth = True, 1  # inside the call object
            if kind == "after":  # a scalar ended at the object's `,` or `}`
                self._tail(ch)

    def _tail(self, ch: str) -> None:
        """The rest of the call object up to its `}` (keys after the arguments are ignored)."""
        if self.value.feed(ch) == "done":
            self.state = "close"

    def _close(self, ch: str) -> None:
        """After a call object: its close tag, the next call of the group, or the end of the group."""
        fmt = self.fmt
        if fmt.close_tag:
            self.held += ch  # anything before the close tag is dropped
            if self.held.endswith(fmt.close_tag):
                self.held, self.state = "", "text"
        elif ch == fmt.separator:
            self.held, self.body_start, self.state = "", 0, "header"
        elif fmt.array and ch == "]":
            self.state = "text"
        elif ch not in _WS:
            self.state = "text"
            self._text(ch)

    def _done(self, ch: str) -> None:
        raise DecoderLMError("text pushed after finish(); use one parser per answer")
