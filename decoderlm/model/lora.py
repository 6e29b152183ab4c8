"""LoRA: a frozen linear layer plus a trainable low-rank update, y = W x + (alpha / r) · B A x.

B starts at zero, so training starts from the base model exactly. Parameter names follow HF PEFT
(`base_layer`, `lora_A.default`, `lora_B.default`), so adapters are stored in PEFT's format
(`decoderlm.formats.peft`). `merge_lora` folds B A into W: the merged model is a plain `Transformer`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.fuse import unfuse_projections
from decoderlm.model.transformer import Transformer


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / rank
        self.enabled = True  # off: the base model alone (DPO's reference)
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B["default"].weight)
        self.to(base.weight.device, base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.enabled:
            return y
        return y + self.lora_B["default"](self.lora_A["default"](self.lora_dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """The base layer with W + scaling · B A folded in."""
        delta = self.lora_B["default"].weight @ self.lora_A["default"].weight  # (out, in)
        with torch.no_grad():
            self.base_layer.weight += (delta * self.scaling).to(self.base_layer.weight.dtype)
        return self.base_layer


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: Transformer, rank: int, alpha: float, targets: list[str], dropout: float = 0.0) -> dict[str, LoRALinear]:
    """Wrap every nn.Linear whose last name is in `targets` (q_proj, v_proj, ...); freeze everything else."""
    if rank < 1:
        raise DecoderLMError(f"--lora-rank must be a positive integer, got {rank}")
    unfuse_projections(model)  # a model from `decoderlm.load` has q/k/v (gate/up) stacked: one Linear each again
    found = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    missing = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in found})
    if missing:
        present = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")})
        raise DecoderLMError(f"--lora-targets: this model has no linear layer named {', '.join(missing)}; choose from {', '.join(present)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in found.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRALinear(linear, rank, alpha, dropout))
    return lora_layers(model)


def set_lora_enabled(model: nn.Module, enabled: bool) -> None:
    for layer in lora_layers(model).values():
        layer.enabled = enabled


def merge_lora(model: Transformer) -> Transformer:
    """Fold every adapter into its base weight and unwrap it: a plain Transformer again."""
    for name, layer in lora_layers(model).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer.merged())
    return model
