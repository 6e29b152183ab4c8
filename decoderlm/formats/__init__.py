"""Checkpoint formats, each with its reader (and writer): decoderlm run folders (`runs`), HF safetensors
folders (`hf`), GGUF files (`gguf`) and PEFT LoRA adapter folders (`peft`); `detect` tells them apart.

A family is a `ModelConfig` built from the checkpoint's hyper-parameters plus a weight-name table
mapping the checkpoint's tensor names (with an optional transform) to ours (`families`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from decoderlm.formats.peft import ADAPTER_CONFIG
from decoderlm.formats.runs import CKPT_NAME

Format = Literal["run", "peft", "hf", "gguf", "json"]


def detect(path: Path) -> Format | None:
    """What `path` holds, from its name and the files in it: a run folder (ckpt.pt), a PEFT adapter folder
    (adapter_config.json), an HF folder (config.json), a .gguf file, or a .json config file alone; None
    if none of these. `load` and `inspect` each take the formats they can read."""
    if path.is_dir():
        if (path / CKPT_NAME).is_file():
            return "run"
        if (path / ADAPTER_CONFIG).is_file():
            return "peft"
        if (path / "config.json").exists():  # read_json explains a config.json that is not a file
            return "hf"
    elif path.is_file() and path.suffix in (".gguf", ".json"):
        return "gguf" if path.suffix == ".gguf" else "json"
    return None
