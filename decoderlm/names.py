"""Known model names → files installed by pip packages (nothing is ever downloaded from a hub)."""

from __future__ import annotations

from pathlib import Path

from decoderlm.errors import DecoderLMError

KNOWN: dict[str, str] = {}


def locate(name: str) -> Path:
    raise DecoderLMError(f"unknown model name {name!r}")
