"""Sparse mixture of experts (Mixtral): a router picks k of E expert MLPs for each token.

The router scores every expert, keeps the top k, and mixes their outputs with softmax weights
(renormalized over the chosen k, as Mixtral does). Only k experts run per token, so the active
parameters per token are far fewer than the total.
"""

from __future__ import annotations

import torch
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.model.mlp import MLP


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.n_experts_per_tok, config.moe_renormalize
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=config.router_bias)  # the router
        self.gate.router = True  # kept in full precision by decoderlm.quantize: tiny, and it decides everything
        hidden = config.moe_hidden or config.ffn_hidden
        self.experts = nn.ModuleList(MLP(config, hidden) for _ in range(config.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        probs = self.gate(flat).float().softmax(dim=-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to expert e
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view(B, T, D)
