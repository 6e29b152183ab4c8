"""One assistant turn with tools, in the library: render, decode (under a grammar when a call is
forced), parse the calls — the server's path without HTTP.

    reply = chat(model, tok, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice="required")
    reply.tool_calls[0].name, json.loads(reply.tool_calls[0].arguments)
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from decoderlm.tools.grammar import Grammars, json_schema_grammar, tool_call_grammar
from decoderlm.tools.parsers import ToolCall, get_parser, parser_name_for


@dataclass
class Reply:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop", "length" or "tool_calls"
    unfinished_call: str = ""  # the token limit ended the reply in a call before its name: its text, the end of `content`

    def message(self) -> dict:
        """The assistant message to append to the conversation (a template reads its calls' arguments as
        objects; a call cut short by the token limit keeps its text)."""
        out: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.parsed_arguments()}}
                                 for c in self.tool_calls]
        return out


def chat(model, tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice: str | dict = "auto",
         parallel_tool_calls: bool = True, params: SamplingParams | None = None, parser: str | None = None,
         json_schema: dict | None = None) -> Reply:
    """The model's next turn. tool_choice: "none", "auto", "required" or {"function": {"name": ...}} (the
    last two enforced by a grammar); json_schema: the answer must be JSON valid under it."""
    params = params or SamplingParams(temperature=0.0, max_new_tokens=256)
    parser = parser or parser_name_for(tokenizer.chat_template)
    tools = tools if tool_choice != "none" else None
    forced = None
    if tools and tool_choice != "auto":
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        forced = [t for t in tools if name is None or t["function"]["name"] == name]
        if not forced:
            raise DecoderLMError(f"tool_choice names {name!r}, which is not among the tools")
    grammar = (tool_call_grammar(forced, parser, parallel_tool_calls) if forced
               else json_schema_grammar(json_schema) if json_schema is not None else None)
    processors = list(params.logits_processors) + ([Grammars(tokenizer).processor(grammar)] if grammar else [])
    params = replace(params, stop_token_ids=params.stop_token_ids or list(tokenizer.eos_token_ids), logits_processors=processors)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools), add_special_tokens=False)
    if len(ids) >= model.config.max_seq_len:  # `generate` would slide its window over the template's start
        raise DecoderLMError(f"the conversation is {len(ids)} tokens, but the model's context is {model.config.max_seq_len}; "
                             "drop its oldest turns (as `decoderlm.cli.chat.fit_context` does) or shorten them")
    out = generate(model, ids, params)
    answer = tokenizer.decode(out)
    finish = "length" if len(out) >= params.max_new_tokens else "stop"
    if not tools:
        return Reply(answer, [], finish)
    reader = get_parser(parser)
    content, calls = reader.parse(answer)
    calls = calls if parallel_tool_calls else calls[:1]
    return Reply(content, calls, "tool_calls" if calls and finish == "stop" else finish, reader.unfinished if finish == "length" else "")


def tool_functions(spec: str) -> dict[str, Callable]:
    """The whitelist `module:function,module:function` → {function name: function}, each imported now
    (the module from sys.path: installed, or the current directory)."""
    functions = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        module, _, name = entry.partition(":")
        if not module or not name:
            raise DecoderLMError(f"--run-tools takes module:function entries separated by commas, got {entry!r}")
        try:
            fn = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise DecoderLMError(f"--run-tools {entry}: cannot import {module} ({e}); put it on PYTHONPATH or in the current folder") from None
        except AttributeError:
            raise DecoderLMError(f"--run-tools {entry}: {module} has no {name}") from None
        if not callable(fn):
            raise DecoderLMError(f"--run-tools {entry}: {name} is not a function")
        functions[name] = fn
    return functions


def run_tool(fn: Callable, call: ToolCall) -> str:
    """Call `fn(**arguments)`; its result as the tool message's content (a string as is, else JSON).
    An exception becomes the result (`error: ...`), so the model can see and answer it."""
    try:
        result = fn(**json.loads(call.arguments))
    except Exception as e:  # a tool's failure is the model's to read, not the chat's to crash on
        return f"error: {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result)
