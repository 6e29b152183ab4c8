"""Chat templates: the Jinja2 program a checkpoint ships to turn a list of messages into one prompt.

A template is untrusted code from a model file, so it runs in Jinja2's immutable sandbox. The
environment offers what templates written for HF transformers expect (`raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, the `{% generation %}` tag, loop controls) with
the same whitespace settings, so the rendered prompt is the one the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from decoderlm.errors import DecoderLMError

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`, which would change tool schemas in the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DecoderLMError(f"the chat template does not parse (line {e.lineno}: {e.message}); fix chat_template in the tokenizer config") from None


def render_chat(template: str, messages: list[Message], add_generation_prompt: bool = True, **variables: Any) -> str:
    """The prompt text for `messages`. `variables` reach the template too (bos_token, eos_token, tools, ...)."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise DecoderLMError(f"a chat message must be a dict with 'role' and 'content', got {m!r}")
    context = {"tools": None, "documents": None, **variables}
    try:
        return compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as e:
        raise DecoderLMError(f"the chat template rejected these messages: {e}") from None
