"""Giving freed memory back to the OS while a model is built."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand the heap's freed pages back to the OS. A tensor's temporaries come and go in blocks of
    a few MB that glibc keeps for reuse, and over hundreds of tensors that slack grew to ~0.8x the
    quantized model (peak memory); trimming after each tensor costs well under a millisecond."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
