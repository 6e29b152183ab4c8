"""The vision tower of Qwen2-VL / Qwen2.5-VL: pixels → patch embeddings at the language model's width.

An image is cut into temporal × patch × patch pixel cubes (a still image is its frame repeated
`temporal_patch_size` times); a Conv3d with kernel = stride = that cube embeds each one (`patch_embed`,
as the checkpoint stores it). ViT blocks attend within one image, with 2-D rotary positions: half of each
head's frequencies turn with the patch's row, half with its column. The merger concatenates each
`merge_size` × `merge_size` block of neighbouring patches and maps it through an MLP to `d_model`: one
language-model token per block. Qwen2.5-VL uses RMSNorm and SwiGLU blocks, and most of its blocks attend
only within windows of `window_size` pixels; the blocks in `full_attention_blocks` see the whole image.

Patches arrive in the processor's order: blocks of merge_size × merge_size patches, row by row of blocks
(`decoderlm.vision_preprocess` makes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.norm import RMSNorm

VISION_KINDS = ("qwen2_vl", "qwen2_5_vl")


@dataclass
class VisionConfig:
    """The vision tower's shape, as `ModelConfig.vision` stores it (a dict of these fields)."""

    kind: str  # "qwen2_vl": LayerNorm, plain MLP, full attention; "qwen2_5_vl": RMSNorm, SwiGLU, windows
    depth: int
    width: int  # the ViT's embedding width
    n_heads: int
    ffn_hidden: int
    act: str = "quick_gelu"  # the MLP's activation: quick_gelu, gelu, silu
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2  # merge_size × merge_size patches become one language-model token
    in_channels: int = 3
    window_size: int = 0  # Qwen2.5-VL: attention windows of this many pixels a side (0: none)
    full_attention_blocks: list[int] = field(default_factory=list)  # blocks that attend over the whole image despite windows
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.kind not in VISION_KINDS:
            raise DecoderLMError(f"vision kind {self.kind!r} is not supported; use one of {', '.join(VISION_KINDS)}")
        if self.act not in VISION_ACTS:
            raise DecoderLMError(f"vision hidden_act {self.act!r} is not supported; supported: {', '.join(VISION_ACTS)}")
        if self.width % self.n_heads or (self.width // self.n_heads) % 4:
            raise DecoderLMError(f"vision width {self.width} must split into {self.n_heads} heads of a multiple of 4 channels")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        try:
            return cls(**d)
        except TypeError as e:  # a missing or unknown field
            raise DecoderLMError(f"config vision={d!r} is not a vision tower's shape ({e}); compare it with VisionConfig's fields") from None

    @property
    def patch_pixels(self) -> int:
        """Numbers per patch: channels × temporal × patch × patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


VISION_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "silu": F.silu,
               "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class Images:
    """Preprocessed images: pixel_values (N patches, patch_pixels) and grid_thw (n images, 3), the
    temporal, height and width patch counts of each, in the order their placeholders appear."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def tokens(self, merge_size: int) -> list[int]:
        """Language-model tokens each image becomes."""
        return (self.grid_thw.prod(-1) // merge_size**2).tolist()


@dataclass
class ImageEmbeds:
    """The vision tower's output, computed already, for the True entries of `at` (B, T), row by row: what a
    paged engine feeds when a prompt's image tokens are read over several forwards (positions given too)."""

    at: torch.Tensor  # (B, T) bool
    embeds: torch.Tensor  # (n, d_model)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        """x (N, width); attention within each run of `lengths` patches (an image, or a window)."""
        N, W = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.n_heads, -1).unbind(1)  # (N, H, D) each
        q, k = rotate(q, *rope), rotate(k, *rope)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv))  # (H, n, D)
               for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(N, W))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (N, H, D) in fp32, as `rope.apply_rope_` but out of place (unbind's views cannot be rotated in place
    under autograd); cos and signed sin (N, 1, D)."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))) (Qwen2-VL), or down(act(gate(x)) · up(x)) with biases (Qwen2.5-VL)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.act = VISION_ACTS[c.act]
        self.gated = c.kind == "qwen2_5_vl"
        if self.gated:
            self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(c.width, c.ffn_hidden), nn.Linear(c.width, c.ffn_hidden),
                                                            nn.Linear(c.ffn_hidden, c.width))
        else:
            self.fc1, self.fc2 = nn.Linear(c.width, c.ffn_hidden), nn.Linear(c.ffn_hidden, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def vision_norm(c: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if c.kind == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = vision_norm(c, c.width), vision_norm(c, c.width)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.shape = (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.width, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (N, patch_pixels) → (N, width)."""
        return self.proj(pixels.view(-1, *self.shape).to(self.proj.weight.dtype)).flatten(1)


class PatchMerger(nn.Module):
    """Norm each patch, concatenate merge_size² neighbours, MLP to the language model's width."""

    def __init__(self, c: VisionConfig, d_model: int) -> None:
        super().__init__()
        self.merged = c.width * c.merge_size**2
        self.ln_q = vision_norm(c, c.width)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))  # (N / merge², d_model)


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig, d_model: int) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, d_model)
        self.init_rope()

    def init_rope(self) -> None:
        """The 2-D RoPE's inverse frequencies: head_dim/4 of them, each turned by the row and by the column."""
        quarter = self.config.width // self.config.n_heads // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq.to(self.merger.mlp[0].weight.device), persistent=False)

    def forward(self, images: Images) -> torch.Tensor:
        """→ (sum of image tokens, d_model): each image's tokens in its patches' order."""
        c = self.config
        x = self.patch_embed(images.pixel_values)  # (N, width)
        rows, cols = patch_positions(images.grid_thw, c.merge_size)  # (N,) each
        angles = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)  # (N, head_dim/2)
        cos, sin = angles.cos(), angles.sin()
        rope = torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]  # (N, 1, head_dim), fp32
        frames = [int(h * w) for t, h, w in images.grid_thw.tolist() for _ in range(int(t))]
        order = None
        if c.window_size:  # Qwen2.5-VL: regroup the merge blocks window by window, so each window is one run
            order, windows = window_order(images.grid_thw, c.merge_size, c.window_size // c.merge_size // c.patch_size)
            unit = c.merge_size**2
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            rope = tuple(r.view(-1, unit, r.shape[-1])[order].view(-1, 1, r.shape[-1]) for r in rope)
        for i, block in enumerate(self.blocks):
            full = not c.window_size or i in c.full_attention_blocks
            x = block(x, rope, frames if full else windows)
        x = self.merger(x)  # (N / merge², d_model)
        return x if order is None else x[torch.argsort(order)]


def patch_positions(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column (N,) of every patch, in the processor's order: merge × merge blocks, row-major."""
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows.append(r.reshape(blocks).transpose(1, 2).flatten().repeat(t))
        cols.append(c.reshape(blocks).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows).float(), torch.cat(cols).float()


def window_order(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over the merged grid: the order of the merge blocks that puts each window's
    blocks together (window by window, row-major within), and each window's length in patches."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in index:
            for r0 in range(0, gh, window):
                for c0 in range(0, gw, window):
                    part = frame[r0 : r0 + window, c0 : c0 + window].flatten()
                    order.append(part + offset)
                    lengths.append(part.numel() * merge**2)
        offset += t * gh * gw
    return torch.cat(order), lengths
