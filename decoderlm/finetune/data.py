"""JSONL records for fine-tuning: one JSON object per line, each checked before any model is loaded.

A bad line is named by its line number; the user chooses whether it stops the run (the default) or is
skipped with a warning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer.chat import Message

ROLES = ("system", "user", "assistant")


def read_jsonl(path: str | Path, check: Callable[[Any], str | None], skip_bad: bool = False) -> list[tuple[int, Any]]:
    """(line number, record) for each non-blank line; `check` returns what is wrong with a record, or None."""
    path = Path(path)
    if not path.is_file():
        raise DecoderLMError(f"data file {path} does not exist (or is a folder); pass --data with a JSONL file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DecoderLMError(f"data file {path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from None
    records, skipped = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = check(record)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg} at column {e.colno})"
        if problem is None:
            records.append((number, record))
        elif skip_bad:
            skipped += 1
            print(f"warning: skipping {path} line {number}: {problem}", file=sys.stderr)
        else:
            raise DecoderLMError(f"{path} line {number}: {problem}; fix the line, or pass --skip-bad-lines to skip such lines")
    if not records:
        raise DecoderLMError(f"{path} has no usable records ({skipped} skipped); see the expected format in `decoderlm sft --help`")
    return records


def check_chat(record: Any) -> str | None:
    """An SFT record: {"messages": [{"role", "content"}, ...]} with an assistant reply, or {"prompt", "completion"}."""
    if not isinstance(record, dict):
        return "expected a JSON object with \"messages\", or \"prompt\" and \"completion\""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return "\"messages\" must be a non-empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return f"message {i} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}"
        if not any(m["role"] == "assistant" for m in messages):
            return "the conversation has no assistant message to learn from"
        return None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return None
    return "expected \"messages\", or \"prompt\" and \"completion\" strings"


def check_pair(record: Any) -> str | None:
    """A DPO record: {"prompt", "chosen", "rejected"}, all strings."""
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "chosen", "rejected")):
        return "expected a JSON object with \"prompt\", \"chosen\" and \"rejected\" strings"
    return None


def as_messages(record: dict[str, Any]) -> list[Message]:
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
