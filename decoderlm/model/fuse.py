"""Fused projections for inference: q/k/v as one matrix, gate/up as one.

A decode step of a small model is bound by the number of ops, not by the bytes of weights read: one
matmul with (H + 2·Hkv)·D output rows costs about a third of three separate ones. `fuse_projections(model)` stacks
the rows of q_proj, k_proj, v_proj into `qkv_proj` and of gate_proj, up_proj into `gate_up_proj`
(plain Linear layers, or the quantized layers of `decoderlm.quantize`), in place; the numbers stay the
same, since each output row is still computed from the same weights.

Where: `decoderlm.load` fuses every model it returns; `load(..., fuse=False)` keeps one module per
checkpoint matrix, for what wraps those modules by name (LoRA fine-tuning, merging an adapter).
Models built for training are never fused.

Names: the checkpoint's names stay the model's names on the way in and out. A fused module's
`state_dict()` splits the stacked rows back into q_proj/k_proj/v_proj (gate_proj/up_proj), in the
unfused order, and `load_state_dict()` takes those names and stacks them, so saving, `convert`,
`--init-from` and checkpoints see the same keys as before fusion.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from decoderlm.model.attention import Attention
from decoderlm.model.mlp import MLP

# Which dimension of a layer's tensor runs over its output rows (the quantized layers' entries come
# from decoderlm.quantize).
ROW_DIM = {"weight": 0, "bias": 0}


def fuse_projections(model: nn.Module) -> nn.Module:
    """Stack q/k/v and gate/up projections of every attention and gated MLP (MoE experts too), in place."""
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.qkv_proj is None:
            fuse_rows(module, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        elif isinstance(module, MLP) and module.gated and module.gate_up_proj is None:
            fuse_rows(module, ("gate_proj", "up_proj"), "gate_up_proj")
    return model


def fuse_rows(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Replace parent's layers `names` by one layer `fused_name` whose output rows are theirs, in order.
    Returns False (and changes nothing) when the layers cannot be stacked (mixed quantization kinds)."""
    layers = [getattr(parent, n) for n in names]
    fused = stack_rows(layers)
    if fused is None:
        return False
    sizes = tuple(out_rows(layer) for layer in layers)
    setattr(parent, fused_name, fused)
    for n in names:
        setattr(parent, n, None)
    parent.register_state_dict_post_hook(partial(_split_state, fused_name=fused_name, names=names, sizes=sizes))
    parent.register_load_state_dict_pre_hook(partial(_join_state, fused_name=fused_name, names=names))
    return True


def stack_rows(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing what `layers` compute, side by side on the last dim; None if they differ in kind."""
    kind = type(layers[0])
    if any(type(layer) is not kind for layer in layers):
        return None
    if kind is not nn.Linear:
        from decoderlm.quantize import concat

        return concat(layers)
    first = layers[0]
    fused = nn.Linear(first.in_features, sum(out_rows(layer) for layer in layers), bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=first.weight.requires_grad)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=first.bias.requires_grad)
    return fused


def out_rows(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.qweight.shape[0]


def row_dim(name: str) -> int:
    from decoderlm.quantize import ROW_DIM as QUANTIZED

    return {**ROW_DIM, **QUANTIZED}[name]


def _split_state(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, *,
                 fused_name: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    """state_dict post-hook: the `fused_name.*` entries become those of `names`, where they stood.
    This module's entries are the tail of `state` when its hook runs, so the tail is rebuilt in order."""
    tail = {key: state.pop(key) for key in [key for key in state if key.startswith(prefix)]}
    head = f"{prefix}{fused_name}."
    fused = {key.removeprefix(head): value for key, value in tail.items() if key.startswith(head)}
    placed = False
    for key, value in tail.items():
        if not key.startswith(head):
            state[key] = value
        elif not placed:  # the fused entries are adjacent: every part's entries go where the first one was
            placed = True
            for i, name in enumerate(names):
                for suffix, tensor in fused.items():  # clone: its own storage (safetensors refuses shared ones)
                    state[f"{prefix}{name}.{suffix}"] = tensor.split(sizes, dim=row_dim(suffix))[i].clone()


def _join_state(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str], *,
                fused_name: str, names: tuple[str, ...]) -> None:
    """load_state_dict pre-hook: the entries of `names` are stacked into the `fused_name.*` ones.
    An incomplete set is left alone, for load_state_dict to report by name."""
    for suffix in module.get_submodule(fused_name).state_dict(keep_vars=True):
        keys = [f"{prefix}{name}.{suffix}" for name in names]
        if all(key in state for key in keys):
            state[f"{prefix}{fused_name}.{suffix}"] = torch.cat([state.pop(key) for key in keys], dim=row_dim(suffix))
