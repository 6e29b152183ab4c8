"""The position-wise feed-forward network (FFN) of each block.

Plain MLP (GPT-2): down(act(up(x))). Gated MLP (Llama's SwiGLU, Gemma's GeGLU):
down(act(gate(x)) · up(x)) — a third matrix, which is why its hidden size is ≈ 8/3·d instead of 4·d.
gpt-oss's clamped SwiGLU clips gate and up to ±limit and multiplies by (up + 1):
(up + 1) · gate · sigmoid(alpha · gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.config import GATED_MLPS, ModelConfig

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "swiglu": F.silu,
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, hidden: int | None = None, bias: bool | None = None) -> None:
        super().__init__()
        hidden = hidden or config.ffn_hidden
        bias = config.mlp_bias if bias is None else bias
        self.gated = config.mlp in GATED_MLPS
        self.act = ACTIVATIONS.get(config.mlp)
        self.limit, self.alpha = (config.swiglu_limit, config.swiglu_alpha) if config.mlp == "swiglu_clamped" else (None, None)
        self.register_module("gate_up_proj", None)  # gate and up rows in one matrix: set by decoderlm.model.fuse for inference
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=bias) if self.gated else None
        self.up_proj = nn.Linear(config.d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., hidden) each
            h = self.glu(gate, up)
        elif self.gated:
            h = self.glu(self.gate_proj(x), self.up_proj(x))
        else:
            h = self.act(self.up_proj(x))
        h = self.down_proj(h)
        return self.dropout(h) if self.training else h

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return self.act(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
