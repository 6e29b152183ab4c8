"""Weight-only quantization for fast CPU decoding: int8 per output row, int4 per group of 32 inputs.

Decoding one token reads every weight once and does two flops with it, so its speed is the memory
bandwidth divided by the bytes of the weights: int8 reads 4x fewer bytes than fp32, int4 8x. Only
the Linear weights are quantized (the MoE router, being tiny and decisive, is kept); embeddings,
norms, attention and the KV cache keep the model's dtype. PyTorch's CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) multiply bf16 activations by the packed
weights directly; where a kernel is missing (another device, an older torch) a layer dequantizes
its weight for each call instead: slower, the same numbers up to bf16 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.moe import MoE

MODES = ("int8", "int4")
GROUP = 32  # int4: one scale and zero point per 32 inputs, like llama.cpp's Q4 blocks
COMPUTE = torch.bfloat16  # the kernels' activation dtype (their fp32 paths are ~10x slower)


def kernel(name: str, device: torch.device) -> bool:
    """Whether PyTorch has the packed-weight CPU kernel `name` for a weight on `device`."""
    return device.type == "cpu" and hasattr(torch.ops.aten, name)


class Int8Linear(nn.Module):
    """y = x · (q · s)ᵀ + b, with q int8 (out, in) and one scale s per output row (symmetric)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(COMPUTE))
        self.bias = linear.bias
        self.fast = kernel("_weight_int8pack_mm", w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(COMPUTE).reshape(-1, x.shape[-1])  # (N, in)
        if self.fast:
            y = torch.ops.aten._weight_int8pack_mm(h, self.qweight, self.scale)
        else:
            y = F.linear(h, self.qweight.to(COMPUTE) * self.scale[:, None])
        y = y.view(*x.shape[:-1], -1).to(x.dtype)  # (..., out)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """4-bit weights: each group of 32 inputs of a row has its own scale and zero point (asymmetric,
    like Q4_1), w ≈ (q - 8) · scale + zero with q in 0..15. Needs in % 32 == 0 and out % 16 == 0."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        N, K = w.shape
        groups = w.reshape(N, K // GROUP, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)  # (N, K/GROUP)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(N, K)
        zero = lo + 8 * scale  # the kernel's (q - 8) · scale + zero is lo + q · scale
        self.register_buffer("scales_zeros", torch.stack((scale, zero), -1).transpose(0, 1).contiguous().to(COMPUTE))  # (K/GROUP, N, 2)
        self.bias = linear.bias
        self.fast = kernel("_weight_int4pack_mm_for_cpu", w.device)
        if self.fast:  # two 4-bit values per byte, in the kernel's tiled layout
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8))
        else:
            self.register_buffer("qweight", q.to(torch.uint8))  # (N, K), one value per byte

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(COMPUTE).reshape(-1, x.shape[-1])  # (N, in)
        if self.fast:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.qweight, GROUP, self.scales_zeros)
        else:
            y = F.linear(h, self.dequantize())
        y = y.view(*x.shape[:-1], -1).to(x.dtype)  # (..., out)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The (out, in) weight these 4-bit values stand for (fallback path only)."""
        N, K = self.qweight.shape
        scale, zero = self.scales_zeros.transpose(0, 1).unbind(-1)  # (N, K/GROUP) each
        q = self.qweight.to(COMPUTE).view(N, K // GROUP, GROUP)
        return ((q - 8) * scale[..., None] + zero[..., None]).view(N, K)


def int4_fits(linear: nn.Linear) -> bool:
    out_features, in_features = linear.weight.shape
    return in_features % GROUP == 0 and out_features % 16 == 0


def quantize(model: nn.Module, mode: str) -> nn.Module:
    """Replace the model's Linear layers (attention, MLP, experts, LM head) by quantized ones, in place.
    int4 keeps int8 for layers whose shape the int4 layout cannot take."""
    if mode not in MODES:
        raise DecoderLMError(f"quantization {mode!r} is not supported; use one of {', '.join(MODES)}")
    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoE)}
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in routers]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        layer = Int4Linear(linear) if mode == "int4" and int4_fits(linear) else Int8Linear(linear)
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    return model


# Stacking quantized layers, for decoderlm.model.fuse: the dimension of each tensor that runs over output rows.
ROW_DIM = {"qweight": 0, "scale": 0, "scales_zeros": 1, "bias": 0}
INT4_TILE = 64  # the CPU kernel packs rows in tiles of up to 64: packed rows stack exactly at tile boundaries


def concat(layers: list[nn.Module]) -> nn.Module | None:
    """One quantized layer whose output rows are those of `layers` (Int8Linear or Int4Linear, one kind,
    one input size), in order. Each row keeps its own values and scales, so the outputs are unchanged.
    None where packed int4 rows cannot be stacked: a part other than the last ends inside a tile."""
    first = layers[0]
    if isinstance(first, Int4Linear) and first.fast and any(layer.qweight.shape[0] % INT4_TILE for layer in layers[:-1]):
        return None
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    vars(fused).update({k: v for k, v in vars(first).items() if not k.startswith("_")})  # plain settings (fast, ...)
    for name, _ in first.named_parameters(recurse=False):
        setattr(fused, name, nn.Parameter(torch.cat([getattr(layer, name) for layer in layers], ROW_DIM[name]), requires_grad=False))
    for name, _ in first.named_buffers(recurse=False):
        fused.register_buffer(name, torch.cat([getattr(layer, name) for layer in layers], ROW_DIM[name]))
    return fused
