"""MXFP4, the microscaling format gpt-oss ships its experts in: 4-bit e2m1 values (sign, 2 exponent bits, 1
mantissa bit: ±0, 0.5, 1, 1.5, 2, 3, 4, 6), each block of 32 sharing one e8m0 exponent byte e, so a weight is
value · 2^(e − 127). GGUF stores a block as its byte then 16 bytes of nibbles (`gguf_quants`); an HF checkpoint
stores `*_blocks` (two values a byte, the low nibble first) and `*_scales` (the exponent bytes) apart."""

from __future__ import annotations

import torch

# The values ×2, to be scaled by 2^(e − 128): fp32 holds that power of two for every byte e (2^(e − 127) overflows at 255).
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def values(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """fp32 weights from e2m1 codes (..., 32) in 0..15 and their block's exponent byte (..., 1)."""
    e = exponents.int()
    halved = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)  # 2^(e − 128)'s fp32 bits
    return halved.view(torch.float32) * E2M1_DOUBLED[codes.long()]


def dequantize_hf_experts(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An HF checkpoint's experts tensor, from `_blocks` (E, out, in / 32, 16) uint8 and `_scales` (E, out, in / 32)
    uint8, in the (E, in, out) layout of its float version, fp32: transformers' `convert_moe_packed_tensors`."""
    E, out, G, _ = blocks.shape
    weights = torch.empty(E, G * 32, out, dtype=torch.float32)
    for e in range(E):  # one expert at a time: the lookup's int64 indices take 16× the blocks' bytes
        codes = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), dim=-1).flatten(-2)  # (out, G, 32): the low nibble first
        weights[e] = values(codes, scales[e].unsqueeze(-1)).flatten(-2).t()
    return weights
