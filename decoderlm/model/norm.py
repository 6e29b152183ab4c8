"""Normalization layers: LayerNorm (GPT-2) and RMSNorm (Llama and most later families)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import kernels
from decoderlm.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) · (offset + w), computed in fp32 for stability (offset is 1 for Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.on_kernel(x, w):  # inference on the CPU in fp32: decoderlm's kernel, a fraction of torch's dispatch
            return kernels.rms_norm(x, w, self.eps)
        if self.offset:  # offset + w would round in bf16: add in fp32
            return F.rms_norm(x.float(), (x.shape[-1],), w.float() + self.offset, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)  # computes in fp32 for bf16/fp16 x, rounds once

    def on_kernel(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """fp32 inference on the CPU outside compiled graphs, without Gemma's offset."""
        return (x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and not self.offset
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                and not torch.compiler.is_compiling() and kernels.available())


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or config.d_model
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)
    return RMSNorm(dim, config.norm_eps, config.norm_offset)
