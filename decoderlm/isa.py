"""CPU dispatch levels: the instruction sets torch's kernels run at, and how to make a process use one.

torch picks its ATen kernels (the packed int4/int8 matmuls among them) and inductor's vector width by
`ATEN_CPU_CAPABILITY`, oneDNN (bf16 matmuls) by `ONEDNN_MAX_CPU_ISA` and MKL (fp32 matmuls) by
`MKL_ENABLE_INSTRUCTIONS`. Setting all three for a child process makes an AVX-512 machine compute as an
AVX2 (or a plain x86-64) machine would, so every level decoderlm ships for is tested on one machine.
The variables are read once, when torch loads: a level is chosen per process, never switched inside one.
"""

from __future__ import annotations

import os
import getpass
import platform
import subprocess
import sys
import tempfile
from functools import cache

import torch

LEVELS = ("default", "avx2", "avx512")  # ATen's names, lowest first
_ONEDNN = {"default": "SSE41", "avx2": "AVX2"}  # avx512: no cap (the CPU's best, AMX and BF16 included)
_MKL = {"default": "SSE4_2", "avx2": "AVX2"}
# /proc/cpuinfo flags ATen checks before it runs a level's kernels
_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}}

X86 = platform.machine() in ("x86_64", "AMD64")


@cache
def cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (the machine's name and no flags without it)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's entries (every core has the same)
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name") or platform.processor() or platform.machine(), frozenset(fields.get("flags", "").split())


def current() -> str:
    """The level this process's torch kernels run at ("default", "avx2", "avx512"; others as torch names them)."""
    return torch.backends.cpu.get_cpu_capability().lower()


@cache
def supported() -> tuple[str, ...]:
    """The levels this CPU can run, lowest first (x86-64 only; elsewhere just the native one)."""
    if not X86:
        return (native(),)
    flags = cpuinfo()[1]
    if not flags:  # no /proc: ask a child torch that has no level forced
        top = native()
        return LEVELS[: LEVELS.index(top) + 1] if top in LEVELS else (top,)
    return ("default", *(level for level in ("avx2", "avx512") if _FLAGS[level] <= flags))


@cache
def native() -> str:
    """The level torch picks on this machine when nothing forces one."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def native_bf16() -> bool:
    """Whether this process's bf16 matmuls run on bf16 instructions: on x86, AVX512-BF16 or AMX at the AVX-512
    level. Elsewhere on x86 oneDNN emulates them, ~100x slower than fp32. Other CPUs: torch's affair (True)."""
    if not X86:
        return True
    return current() == "avx512" and bool({"avx512_bf16", "amx_bf16"} & cpuinfo()[1])


def describe() -> dict[str, object]:
    """The machine facts a benchmark's JSON records: CPU model, cores, the level torch runs at and the native one."""
    model, flags = cpuinfo()
    extras = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"))
    return {"cpu": model, "cpus": os.cpu_count(), "isa": current(), "native_isa": native(), "flags": extras,
            "torch": torch.__version__}


def env(level: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) that makes a child process run at `level`."""
    if level not in LEVELS:
        raise ValueError(f"unknown CPU level {level!r}; use one of {', '.join(LEVELS)}")
    out = dict(os.environ if base is None else base)
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        out.pop(name, None)
    out["ATEN_CPU_CAPABILITY"] = level
    # inductor's caches do not key their generated code by the vector width: code written for AVX2 (8 floats
    # a vector) and run at AVX-512 (16) writes past its buffers, so each level keeps its own cache.
    out["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{level}")
    if level in _ONEDNN:
        out["ONEDNN_MAX_CPU_ISA"] = _ONEDNN[level]
        out["MKL_ENABLE_INSTRUCTIONS"] = _MKL[level]
    return out
