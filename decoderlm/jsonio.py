"""Reading the small JSON files around a model (config.json, generation_config.json, shard indexes,
ModelConfig files): one helper, so a missing file, broken JSON and a wrong top-level type each give
the same one-line `DecoderLMError` wherever they are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from decoderlm.errors import DecoderLMError


def read_json(path: str | Path, what: str = "file", fix: str = "restore or re-create it", missing_ok: bool = False) -> dict[str, Any]:
    """The JSON object in `path`. `what` names the file in messages ("config.json", "ModelConfig file"),
    `fix` says what the user should do. missing_ok: an absent file reads as {} (optional files)."""
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {}
        raise DecoderLMError(f"{what} {path} is missing; {fix}")
    if not path.is_file():
        raise DecoderLMError(f"{what} {path} is a directory, not a file; give the JSON file itself")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DecoderLMError(f"{what} {path} is not valid JSON ({_reason(e)}); {fix}") from None
    if not isinstance(data, dict):
        raise DecoderLMError(f"{what} {path} holds a JSON {type(data).__name__}, not an object {{...}}; {fix}")
    return data


def _reason(e: Exception) -> str:
    """An exception as one line (JSONDecodeError messages already are)."""
    return " ".join(str(e).split()) or type(e).__name__
