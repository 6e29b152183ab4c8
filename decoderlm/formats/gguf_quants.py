"""Dequantization of the GGUF block types newer files ship with, vectorised in torch over all blocks
at once: Q5_0 / Q5_1 (5-bit values, the fifth bits packed apart), Q2_K / Q3_K (256-value super-blocks
of 16 sub-blocks with their own small scales), IQ4_NL / IQ4_XS (4-bit indices into a fixed non-uniform
table of 16 levels) and MXFP4 (gpt-oss's experts: e2m1 values with a power-of-two scale per 32, `mxfp4`).
Each follows ggml's block layout (ggml-common.h) byte for byte; tests check each against the `gguf`
package's own `gguf.quants.dequantize`."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from decoderlm.formats import mxfp4

# type → (weights per block, bytes per block)
BLOCKS = {Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q2_K: (256, 84), Q.Q3_K: (256, 110),
          Q.IQ4_NL: (32, 18), Q.IQ4_XS: (256, 136), Q.MXFP4: (32, 17)}
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)


def dequantize_blocks(raw: torch.Tensor, kind: Q) -> torch.Tensor:
    """raw (bytes,) uint8 of whole blocks → fp32 (blocks · weights per block,), in file order."""
    n, size = BLOCKS[kind]
    b = raw.view(-1, size)  # (N, bytes)
    return _DEQUANT[kind](b).reshape(-1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) bytes → (N, 1) fp32 from their little-endian fp16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes → (..., 32): low nibbles are values 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """(N, count / 8) bytes → (N, count) bits, least significant first."""
    return ((b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(b.shape[0], count)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)  # (N, 32) in 0..31
    return _f16(b[:, 0:2]) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 scale bytes (low nibble: sub-block scale, high: its min), 64 bytes of 2-bit values, d, dmin."""
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]).unsqueeze(-1), _f16(b[:, 82:84]).unsqueeze(-1)  # (N, 1, 1)
    q = (qs.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3  # (N, 2, 4, 32)
    q = q.reshape(-1, 16, 16).float()  # (N, sub-block, 16)
    return d * (scales & 0x0F).float().unsqueeze(-1) * q - dmin * (scales >> 4).float().unsqueeze(-1)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes of high bits (a set bit means no -4 offset), 64 of low 2-bit values, 12 of 6-bit scales, d."""
    hmask, qs, sc, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110]).unsqueeze(-1)
    low = torch.cat((sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4), dim=1)  # (N, 16)
    high = (sc[:, 8:12].unsqueeze(1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 4, 1)) & 3  # (N, 4, 4)
    scales = (low | (high.reshape(-1, 16) << 4)).float() - 32  # (N, 16)
    ql = (qs.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3  # (N, 2, 4, 32)
    qh = (hmask.reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # (N, 8, 32)
    q = ql.reshape(-1, 16, 16).float() - 4 * (1 - qh.reshape(-1, 16, 16).float())
    return d * scales.unsqueeze(-1) * q


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * IQ4_LEVELS[_nibbles(b[:, 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d, 8 sub-blocks' 6-bit scales (high 2 bits in a uint16, low 4 in nibbles), 8 × 16 bytes of indices."""
    d = _f16(b[:, 0:2]).unsqueeze(-1)  # (N, 1, 1)
    high = b[:, 2].long() | (b[:, 3].long() << 8)  # (N,)
    high = (high.unsqueeze(-1) >> (2 * torch.arange(8))) & 3  # (N, 8)
    low = torch.stack((b[:, 4:8] & 0x0F, b[:, 4:8] >> 4), dim=-1).reshape(-1, 8).long()  # (N, 8)
    scales = (low | (high << 4)).float() - 32
    q = IQ4_LEVELS[_nibbles(b[:, 8:136].reshape(-1, 8, 16)).long()]  # (N, 8, 32)
    return d * scales.unsqueeze(-1) * q


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """An e8m0 exponent byte, then 16 bytes of e2m1 nibbles."""
    return mxfp4.values(_nibbles(b[:, 1:17]), b[:, 0:1])


_DEQUANT = {Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: _mxfp4}
