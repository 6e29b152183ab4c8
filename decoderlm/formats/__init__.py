"""Checkpoint formats: HF safetensors folders (`hf`) and GGUF files (`gguf`).

A family is a `ModelConfig` built from the checkpoint's hyper-parameters plus a weight-name table
mapping the checkpoint's tensor names (with an optional transform) to ours.
"""

from __future__ import annotations

import torch

from decoderlm.config import ModelConfig
from decoderlm.model import Transformer


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> Transformer:
    """A model whose parameters are allocated once, in `dtype` on `device`, with no values yet: built on
    the meta device, so no time goes to a random init (or a CPU copy) that the weights overwrite."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives each module its own storage
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()  # a computed buffer: the meta build held no values
    return model
