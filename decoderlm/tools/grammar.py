"""Constrained decoding: a grammar's token mask per row per step, through the logits-processor seam.

The grammar engine is llguidance (CPU wheel, no dependencies): a JSON schema or a Lark grammar is
compiled once against the tokenizer's vocabulary, and each request gets its own matcher (its parse
state), which computes the set of tokens that keep the text inside the grammar (SmolLM2's 49k
vocabulary: ~1 ms to compile a schema, ~0.1 ms per token for the mask; benchmarks/structured_output.py). `GrammarProcessor` is the
logits processor: it consumes the tokens generated since its last call (rolling back if there are
fewer, so a recomputed step is safe), then sets every forbidden token's score to -inf. The stop
tokens are allowed exactly when the grammar accepts the text so far.

Tool grammars force the calls in the format the tool parser reads, so `tool_choice: "required"` or a
named function is obeyed, not hoped for, and `parallel_tool_calls: false` admits one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache

import numpy as np
import torch

from decoderlm.errors import DecoderLMError

# Compact JSON with the spacing models are trained on (`{"a": 1, "b": 2}`); no free-running whitespace.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class GrammarError(DecoderLMError):
    """A schema or grammar the engine cannot enforce; the message names the keyword."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise DecoderLMError("constrained decoding needs llguidance; pip install llguidance") from None
    return llguidance


def json_schema_grammar(schema: dict | None) -> str:
    """The grammar for JSON text valid under `schema` (None: any JSON object)."""
    if schema is not None and not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    schema = {"type": "object"} if schema is None else schema
    return _llguidance().LLMatcher.grammar_from_json_schema(dict(schema, **{"x-guidance": JSON_STYLE}))


def lark_grammar(text: str) -> str:
    """The grammar for a Lark grammar's text, as llguidance reads it (checked when compiled)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def call_schema(tool: dict, argument_key: str = "arguments") -> dict:
    """One tool's call as a JSON object: its name, then arguments valid under its parameters."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {"type": "object"}
    if fn.get("strict") and params.get("type") == "object":  # OpenAI's strict mode: no properties beyond the schema's
        params = {"additionalProperties": False} | params
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, argument_key: params},
            "required": ["name", argument_key], "additionalProperties": False}


def tool_call_grammar(tools: list[dict], parser: str, parallel: bool = True) -> str:
    """A Lark grammar admitting one call (or, with `parallel`, one or more) to any of `tools`, written
    as `parser` (hermes, generic, llama3, mistral) reads them."""
    key = "parameters" if parser == "llama3" else "arguments"
    schema = {"anyOf": [call_schema(t, key) for t in tools], "x-guidance": JSON_STYLE}
    call = f"call: %json {json.dumps(schema)}"
    if parser in ("hermes", "generic"):
        shape = 'start: tagged ("\\n" tagged)*' if parallel else "start: tagged"
        rules = [shape, 'tagged: "<tool_call>" call "</tool_call>"', call]
    elif parser == "llama3":
        rules = ['start: call ("; " call)*' if parallel else "start: call", call]
    elif parser == "mistral":
        rules = ['start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"', call]
    else:
        raise DecoderLMError(f"no tool grammar for the {parser!r} format")
    return _llguidance().LLMatcher.grammar_from_lark("\n".join(rules))


class Grammars:
    """A tokenizer's grammar compiler: its llguidance vocabulary (built once, ~0.5 s) and a cache of
    compiled grammars, so a schema sent again costs a copy of a matcher, not a compilation.

    With `compile_timeout` (seconds) a compilation runs in a worker thread (llguidance drops the GIL
    while it builds) and a grammar not compiled within the bound is refused (GrammarError), then and
    whenever it is sent again; the abandoned compilation finishes in the background, within
    llguidance's own size and fuel limits."""

    def __init__(self, tokenizer, cache_size: int = 64, compile_timeout: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = list(tokenizer.eos_token_ids)
        self._compile = lru_cache(maxsize=cache_size)(self._compile_uncached)
        self.compile_timeout = compile_timeout
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile") if compile_timeout is not None else None
        self._too_slow: set[str] = set()

    @property
    def vocabulary(self):
        if getattr(self, "_vocabulary", None) is None:
            backend = getattr(self.tokenizer, "tokenizer", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise DecoderLMError("constrained decoding needs a BPE (tokenizers) tokenizer; a character-level model has none")
            eos = self.stop_ids[0] if self.stop_ids else None
            self._vocabulary = _llguidance().LLTokenizer(backend.to_str(), eos_token=eos)
        return self._vocabulary

    def _compile_uncached(self, grammar: str):
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.vocabulary)
        if failed:
            raise GrammarError(describe(messages))
        matcher = llg.LLMatcher(self.vocabulary, grammar)
        if matcher.is_error():
            raise GrammarError(describe([matcher.get_error()]))
        return matcher

    def compile(self, grammar: str):
        """The compiled matcher for `grammar` (cached), within `compile_timeout` when one is set."""
        if self._pool is None:
            return self._compile(grammar)
        if grammar in self._too_slow:
            raise GrammarError(self._slow_message())
        future = self._pool.submit(self._compile, grammar)
        try:
            return future.result(self.compile_timeout)
        except FutureTimeout:
            self._too_slow.add(grammar)
            raise GrammarError(self._slow_message()) from None

    def _slow_message(self) -> str:
        return (f"the schema or grammar takes longer than {self.compile_timeout:g} s to compile; simplify it "
                "(fewer alternatives, properties or patterns)")

    def processor(self, grammar: str) -> GrammarProcessor:
        """A fresh matcher for one request (raises GrammarError for a grammar the engine refuses)."""
        return GrammarProcessor(self.compile(grammar).deep_copy(), self.stop_ids)


def describe(messages: list[str]) -> str:
    """llguidance's complaint as one line, naming the keywords it cannot enforce."""
    text = " ".join(" ".join(messages).split())
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", text)
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return f"JSON schema keyword(s) {names} cannot be enforced; remove them from the schema"
    return f"the schema or grammar cannot be enforced: {text[:300]}"


class GrammarProcessor:
    """A logits processor holding one request's grammar state (see the module docstring)."""

    stateful = True  # its state follows one sequence's tokens: one per request, not shared

    def __init__(self, matcher, stop_ids: Sequence[int]) -> None:
        self.matcher, self.stop_ids = matcher, list(stop_ids)
        self.start: int | None = None  # len(ids) at the first call: the prompt
        self.consumed = 0

    def __call__(self, ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        if self.start is None:
            self.start = len(ids)
        generated = len(ids) - self.start
        if generated < self.consumed:
            self.matcher.rollback(self.consumed - generated)
            self.consumed = generated
        for token in ids[self.start + self.consumed :]:
            self.matcher.consume_token(token)
            self.consumed += 1
        allowed = self.allowed(scores.shape[-1])
        if scores.device.type == "cpu" and scores.dtype == torch.float32:  # numpy: one thread, where torch would wake its pool for 49k elements
            out = scores.detach().numpy().copy()
            out[~allowed] = -np.inf
            return torch.from_numpy(out)
        return scores.masked_fill(~torch.from_numpy(allowed).to(scores.device), float("-inf"))

    def allowed(self, vocab_size: int) -> np.ndarray:
        """(V,) bool: the tokens the grammar admits next (only the stop tokens once it is complete or broken)."""
        allowed = np.zeros(vocab_size, dtype=bool)
        if not self.matcher.is_error():  # little-endian 32-bit words: bit j of byte b is token 8b + j
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(vocab_size, bits.size)
            allowed[:n] = bits[:n]
        if self.matcher.is_error() or self.matcher.is_accepting():
            allowed[[i for i in self.stop_ids if i < vocab_size]] = True
        return allowed
