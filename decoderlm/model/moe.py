"""Sparse mixture of experts (Mixtral, Qwen-MoE, DeepSeek): a router picks k of E expert MLPs for each token.

The router scores every expert, keeps the top k, and mixes their outputs with those scores as weights
(renormalized over the chosen k, as Mixtral does). Only k experts run per token, so the active
parameters per token are far fewer than the total.

DeepSeek's options: shared experts that every token passes through besides the routed ones;
expert groups, where a token first keeps its best `moe_topk_groups` of `moe_groups` groups (V2: ranked
by their best expert; V3: by the sum of their best two) and picks its k experts inside them (routing
limited to a few devices, when each group lives on one); V3's sigmoid scores, with a bias
(`e_score_correction_bias`, tuned during training to balance the load) added for choosing experts but
not for weighting them; and a scale on the routed experts' sum (`moe_routed_scale`).
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
        self.sigmoid, self.groups, self.topk_groups, self.scale = (config.moe_router == "sigmoid", config.moe_groups, config.moe_topk_groups,
                                                                   config.moe_routed_scale)
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=config.router_bias)  # the router (gpt-oss: with a bias)
        self.gate.router = True  # kept in full precision by decoderlm.quantize: tiny, and it decides everything
        if self.sigmoid:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(config.n_experts))
            self.gate.keep_fp32 = True  # loaded in fp32 into a bf16 model too (decoderlm.formats.build), as transformers keeps it
        hidden = config.moe_hidden or config.ffn_hidden
        self.experts = nn.ModuleList(MLP(config, hidden) for _ in range(config.n_experts))
        self.shared_experts = MLP(config, hidden * config.n_shared_experts) if config.n_shared_experts else None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (N, k) and expert ids (N, k) for the tokens flat (N, D)."""
        logits = self.gate(flat.to(self.gate.weight.dtype)).float()  # (N, E)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias.float() if self.sigmoid else scores  # what selection ranks
        if self.groups > 1:
            grouped = choice.view(choice.shape[0], self.groups, -1)  # (N, G, E/G)
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1) if self.sigmoid else grouped.amax(dim=-1)  # (N, G)
            kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        chosen = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale if self.scale != 1.0 else weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        weights, chosen = self.route(flat)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        if torch.compiler.is_exporting():  # the compiled decode step (decoderlm.compiled); torch.compile in training breaks the graph here
            return self.compiled_experts(flat, weights, chosen, out).view(B, T, D)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to expert e
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(B, T, D)

    def compiled_experts(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum without data-dependent shapes, for an exported graph: each expert runs
        on all N tokens (a decode step's one) under torch.cond, only when some token chose it, its output
        scaled by that token's weight for it (0 for the others). The same sum, in the same expert order."""
        for e, expert in enumerate(self.experts):
            picked = chosen == e  # (N, k)
            weight = (weights * picked).sum(dim=-1, keepdim=True)  # (N, 1)
            out = torch.cond(picked.any(), lambda o, f, w, expert=expert: o + expert(f) * w, lambda o, f, w: o.clone(), (out, flat, weight))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out
