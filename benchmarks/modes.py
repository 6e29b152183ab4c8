"""The ways decoderlm runs a model, shared by the benchmarks: mode name → `decoderlm.load` keyword
arguments. A mode added here (one line) appears in every table: quality.py's faithfulness and
generate_speed.py's speed, peak memory and cold-start time. Quantization modes that
`decoderlm.quantize.MODES` offers but this table does not name are added on their own.
"""

from __future__ import annotations

from typing import Any

from decoderlm.quantize import MODES as QUANTIZE_MODES

REFERENCE = "fp32"  # what every other mode is compared with: the exact dequantization of the file's weights
DEFAULT = "auto"  # what chat / generate / serve run: on a Q4_1 file, its blocks with 16-bit activations outside prompts
FP32_ACT = "fp32-act"  # the same blocks in fp32 arithmetic (the default until 16-bit activations)
INT8_ACT = "int8-act"  # the same blocks with llama.cpp's arithmetic: int8 activations outside prompts
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "quantize": "none"},
    "auto": {"quantize": "auto"},
    FP32_ACT: {"quantize": "auto", "activations": "fp32"},
    INT8_ACT: {"quantize": "auto", "activations": "int8"},
    "bf16": {"dtype": "bfloat16", "quantize": "none"},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
}
MODES |= {q: {"quantize": q} for q in QUANTIZE_MODES if {"quantize": q} not in MODES.values()}


def cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """The command-line flags that load a model as `load(**kwargs)` does: {"dtype": "bfloat16"} →
    ["--dtype", "bfloat16"]; a True flag stands alone, a False or None one is left out."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, str(value)]
    return flags
