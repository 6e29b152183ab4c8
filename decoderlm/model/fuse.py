"""Fused projections for inference: q/k/v as one matrix, gate/up as one.

A decode step of a small model is bound by the number of ops more than by the bytes of weights read:
one matmul over the stacked rows reads what three read, in a third of the calls. `fuse_projections`
stacks the rows of q_proj, k_proj, v_proj into `qkv_proj` and of gate_proj, up_proj into
`gate_up_proj` (plain Linear layers, or the quantized layers of `decoderlm.quantize`), in place. The
numbers stay the same: each output row is computed from the same weights as before.

Where: `decoderlm.load` fuses every model it returns, before quantizing (quantization is per row, so
a stacked matrix quantizes to the same numbers); `load(..., fuse=False)` keeps one module per
checkpoint matrix, as fine-tuning wants. `unfuse_projections` undoes it (LoRA calls it before wrapping
q_proj, v_proj, ... by name). Models built for training are never fused.

Names: the checkpoint's names stay the model's names on the way in and out. A fused module's
`state_dict()` splits the stacked rows back into q_proj/k_proj/v_proj (gate_proj/up_proj), in the
unfused order, and `load_state_dict()` takes those names and stacks them, so saving, `convert`,
`--init-from` and checkpoints see the keys of the unfused model. (Packed int4 bytes split back into a
part's own packing only at the kernel's 64-row tiles; a quantized state_dict is read by nothing.)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from decoderlm import quantize
from decoderlm.heap import trim_heap
from decoderlm.model.attention import Attention
from decoderlm.model.mlp import MLP

ROW_DIM = {"weight": 0, "bias": 0, **quantize.ROW_DIM}  # which dimension of a layer's tensor runs over output rows
STACKS = {Attention: (("q_proj", "k_proj", "v_proj"), "qkv_proj"), MLP: (("gate_proj", "up_proj"), "gate_up_proj")}


def fuse_projections(model: nn.Module) -> nn.Module:
    """Stack q/k/v and gate/up projections of every attention and gated MLP (MoE experts too), in place."""
    parents = [m for m in model.modules() if type(m) in STACKS]  # not every module: the parts must be free to go
    for module in parents:
        if not hasattr(module, "_stacked") and (not isinstance(module, MLP) or module.gated):
            stack(module, *STACKS[type(module)])
            trim_heap()  # the parts' memory, freed, would otherwise stay with the process (SmolLM2 int4: 40 MB)
    return model


def unfuse_projections(model: nn.Module) -> nn.Module:
    """Undo `fuse_projections` for plain Linear layers, in place: one module per checkpoint matrix again,
    for what wraps them by name (LoRA). Quantized stacks stay as they are."""
    for module in list(model.modules()):
        if hasattr(module, "_stacked") and isinstance(getattr(module, module._stacked[1]), nn.Linear):
            names, fused_name, sizes, hooks = module.__dict__.pop("_stacked")
            fused = getattr(module, fused_name)
            biases = fused.bias.split(sizes) if fused.bias is not None else (None,) * len(sizes)
            for name, weight, bias in zip(names, fused.weight.split(sizes), biases):
                setattr(module, name, _linear(weight.clone(), None if bias is None else bias.clone(), fused.weight.requires_grad))
            setattr(module, fused_name, None)
            for hook in hooks:
                hook.remove()
    return model


def stack(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Replace parent's layers `names` by one layer `fused_name` whose output rows are theirs, in order.
    Returns False (and changes nothing) where they cannot be stacked (see `stack_rows`)."""
    layers = [getattr(parent, n) for n in names]
    fused = stack_rows(layers)
    if fused is None:
        return False
    sizes = tuple(out_rows(layer) for layer in layers)
    setattr(parent, fused_name, fused)
    for n in names:
        setattr(parent, n, None)
    hooks = (parent.register_state_dict_post_hook(partial(_split_state, fused_name=fused_name, names=names, sizes=sizes)),
             parent.register_load_state_dict_pre_hook(partial(_join_state, fused_name=fused_name, names=names)))
    parent._stacked = (names, fused_name, sizes, hooks)  # what `unfuse_projections` undoes
    return True


def stack_rows(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing what `layers` compute, side by side on the last dim. None for layers of
    different kinds (a part int8 where int4 did not fit), other kinds (LoRA wrappers), or packed int4
    rows that do not stack."""
    kind = type(layers[0])
    if any(type(layer) is not kind for layer in layers) or kind not in (nn.Linear, quantize.Int8Linear, quantize.Int4Linear, quantize.Int8GroupLinear, quantize.BlockLinear):
        return None
    if kind is not nn.Linear:
        return quantize.concat(layers)
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return _linear(torch.cat([layer.weight for layer in layers]), bias, layers[0].weight.requires_grad)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An nn.Linear holding these tensors (built on meta: no init work for weights about to be replaced)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return layer


def out_rows(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, (nn.Linear, quantize.BlockLinear)) else layer.qweight.shape[0]


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
                    state[f"{prefix}{name}.{suffix}"] = tensor.split(sizes, dim=ROW_DIM[suffix])[i].clone()


def _join_state(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str], *,
                fused_name: str, names: tuple[str, ...]) -> None:
    """load_state_dict pre-hook: the entries of `names` are stacked into the `fused_name.*` ones.
    An incomplete set is left alone, for load_state_dict to report by name."""
    for suffix in module.get_submodule(fused_name).state_dict(keep_vars=True):
        keys = [f"{prefix}{name}.{suffix}" for name in names]
        if all(key in state for key in keys):
            state[f"{prefix}{fused_name}.{suffix}"] = torch.cat([state.pop(key) for key in keys], dim=ROW_DIM[suffix])
