"""The optimizer a run trains with: AdamW for everything, or Muon for the hidden matrices plus AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D update with a few Newton-Schulz steps, so every
direction of a weight matrix moves at the same rate; that is only meaningful for the matrices inside
the blocks (attention and MLP projections). Embeddings and the LM head (a lookup table and a
classifier, tied or not), norm weights and biases stay on AdamW. `MuonAdamW` holds the two behind the
few methods the training loop calls, and saves and restores both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from decoderlm.train.config import TrainConfig


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer | MuonAdamW:
    if cfg.optimizer == "muon":
        hidden = hidden_matrices(model)
        return MuonAdamW(muon_for(hidden, cfg), adamw_for(model, cfg, device, exclude=hidden), cfg.lr)
    return adamw_for(model, cfg, device)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the linear layers inside the blocks: what Muon trains."""
    layers = getattr(model, "layers", [])
    return [m.weight for block in layers for m in block.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]


def adamw_for(model: nn.Module, cfg: TrainConfig, device: torch.device, exclude: list[nn.Parameter] | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices of linear layers only: biases, norm weights and embeddings
    (token and position tables, and a head tied to them) are not decayed. Fused (one kernel for every
    parameter) on CUDA and CPU, foreach elsewhere.
    `exclude`: parameters another optimizer trains."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    skip = {id(p) for p in exclude or []}
    params = [p for p in {id(p): p for p in model.parameters() if p.requires_grad}.values() if id(p) not in skip]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    decay_ids = {id(p) for p in decay}
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) not in decay_ids], "weight_decay": 0.0},
    ]
    fast = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **fast)


def muon_for(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Muon:
    """Muon at --muon-lr. Its weight decay shrinks weights by lr × wd per step, as AdamW's does, so wd is
    rescaled to shrink them as much per step as AdamW would at --lr: changing the optimizer changes
    the update's direction and size, not how strongly weights are pulled towards zero."""
    return torch.optim.Muon(params, lr=cfg.muon_lr, weight_decay=cfg.weight_decay * cfg.lr / cfg.muon_lr)


class MuonAdamW:
    """Muon and AdamW stepped together. The schedule sets the learning rate of `param_groups` (AdamW's,
    peak `peak_lr`); Muon follows at the same fraction of its own peak, applied at each `step`."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW, peak_lr: float) -> None:
        self.muon, self.adamw, self.peak_lr = muon, adamw, peak_lr
        self.muon_peaks = [group["lr"] for group in muon.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups

    def step(self) -> None:
        fraction = self.adamw.param_groups[0]["lr"] / self.peak_lr
        for group, peak in zip(self.muon.param_groups, self.muon_peaks):
            group["lr"] = peak * fraction
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
