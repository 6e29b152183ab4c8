"""Tools in the prompt: messages as a chat template with a tool section reads them, and the generic
fallback for one without (SmolLM2's plain ChatML).

Templates written for transformers receive `tools` (OpenAI's `[{"type": "function", "function":
{...}}]`), assistant messages with `tool_calls` whose `arguments` are objects, and `role: "tool"`
messages with `tool_call_id`, the way `apply_chat_template(tools=...)` passes them. A template whose
source never mentions `tools` would drop them silently, so the generic fallback rewrites the
conversation into plain turns instead: the tool list and the call format (hermes' `<tool_call>` tags,
which `decoderlm.tools.parsers` reads as "generic") go into the system turn, earlier calls become
`<tool_call>` lines of the assistant's text, and tool results become a user turn of
`<tool_response>` blocks.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]

GENERIC_SYSTEM = """You can call functions. Their signatures, as JSON Schema, are:
{tools}
To call a function, answer with one line per call, and nothing else:
<tool_call>{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}</tool_call>
Function results come back in <tool_response></tool_response> tags. If no function fits, answer in plain text."""


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template has a tool section (it reads the `tools` variable)."""
    return template is not None and "tools" in template


def has_tool_turns(messages: list[Message]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def call_text(call: dict) -> str:
    """One earlier call as the generic format writes it."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>"


def generic_messages(messages: list[Message], tools: list[dict] | None) -> list[Message]:
    """The conversation with its tools written into plain turns (see the module docstring)."""
    out: list[Message] = []
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        system = GENERIC_SYSTEM.format(tools=listing)
        if messages and messages[0].get("role") == "system":
            system = f"{messages[0].get('content') or ''}\n\n{system}".lstrip()
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            lines = [m["content"]] if m.get("content") else []
            out.append({"role": m["role"], "content": "\n".join(lines + [call_text(c) for c in m["tool_calls"]])})
        else:
            out.append(dict(m))
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def template_messages(template: str | None, messages: list[Message], tools: list[dict] | None) -> tuple[list[Message], list[dict] | None]:
    """(messages, tools) for `template`: as they are if it reads tools, else the generic rewrite."""
    if template_reads_tools(template) or not (tools or has_tool_turns(messages)):
        return messages, tools
    return generic_messages(messages, tools), None
