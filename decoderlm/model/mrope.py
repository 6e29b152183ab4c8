"""M-RoPE (Qwen2-VL): rotary positions in three axes, time, height and width.

Each token has a position per axis. `mrope_section` (t, h, w) splits RoPE's rot_dim/2 frequencies into
three consecutive groups, each turned by one axis's position. A text token has the same position on
all three axes (so for text M-RoPE is plain RoPE); an image's tokens take their grid coordinates, offset
by the position the image starts at, and the text after it continues from that start + the image's
larger side (in tokens). The sequence then ends below its length: decoding continues at
cache position + `rope_delta` (negative), which `ShiftedPositions` adds without touching the cache.
"""

from __future__ import annotations

import torch

from decoderlm.model.cache import Cache


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (3, B, T) → cos, signed sin (B, T, 1, rot_dim), laid out as `rope.rope_cos_sin`'s."""
    angles = positions.float().unsqueeze(-1) * inv_freq.float()  # (3, B, T, rot_dim/2)
    axis = torch.repeat_interleave(torch.arange(3, device=angles.device), torch.tensor(section, device=angles.device))  # (rot_dim/2,)
    angles = angles.gather(0, axis.expand_as(angles[:1]))[0]  # (B, T, rot_dim/2): frequency j turned by axis[j]
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def mrope_positions(input_ids: torch.Tensor, grid_thw: torch.Tensor, image_token_id: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (3, B, T), rope_delta (B, 1)) of sequences starting at position 0, whose runs of
    image_token_id stand for the images of grid_thw (n, 3) in order (row by row of the batch)."""
    B, T = input_ids.shape
    out = torch.zeros(3, B, T, dtype=torch.long)
    deltas = []
    grids = iter(grid_thw.tolist())
    ids = input_ids.tolist()
    for b in range(B):
        i, start = 0, 0
        while i < T:
            if ids[b][i] != image_token_id:
                out[:, b, i] = start
                i, start = i + 1, start + 1
                continue
            t, h, w = next(grids)
            h, w = h // merge, w // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            n = t * h * w
            out[:, b, i : i + n] = torch.stack((tt, hh, ww)).view(3, -1)[:, : T - i] + start
            i, start = i + n, start + max(h, w)
        deltas.append(int(out[:, b].max()) + 1 - T)
    return out.to(input_ids.device), torch.tensor(deltas, device=input_ids.device)[:, None]


class ShiftedPositions:
    """A cache whose tokens sit `delta` (B, 1) positions before their slots: M-RoPE's decoding after an
    image. Everything else is the wrapped cache's."""

    def __init__(self, cache: Cache, delta: torch.Tensor) -> None:
        self.cache, self.delta = cache, delta

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return self.cache.positions(T, attention_mask, device) + self.delta.to(device)

    def __getattr__(self, name: str):
        return getattr(self.cache, name)
