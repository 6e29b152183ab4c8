"""Where a model runs or trains: one check, shared by loading and training, so a device the machine
lacks is a one-line error before any work."""

from __future__ import annotations

import torch

from decoderlm.errors import DecoderLMError

DEVICES = ("cpu", "cuda", "mps")
DEVICE_HELP = "cpu, cuda, cuda:N or mps"


def resolve_device(device: str | torch.device) -> torch.device:
    """A device this machine has: cpu, cuda (or cuda:N) or mps; anything else is a one-line error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in DEVICES:
        raise DecoderLMError(f"--device {device!s} is not supported; use one of {DEVICE_HELP}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DecoderLMError(f"--device {device!s}: PyTorch sees no CUDA GPU on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DecoderLMError(f"--device {device!s}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DecoderLMError(f"--device {device!s}: Apple's MPS backend is not available on this machine; use --device cpu")
    return dev
