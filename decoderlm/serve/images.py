"""A prompt's images in the paged engine: encoded once, read chunk by chunk, named by content.

The vision tower runs once per request, on its first prompt chunk; each later forward takes the slice of
its output that falls in the chunk (`ImageEmbeds`). M-RoPE positions of the whole prompt are computed at
admission: prompt tokens take them, every token after the prompt continues at its index + `rope_delta`.
For prefix caching an image token is named by its image's content hash (sha256 of its pixels and
grid), not by the placeholder id every image shares: the same image twice shares KV blocks, two
different images behind the same placeholders never do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.model.mrope import mrope_positions
from decoderlm.model.vision import Images


@dataclass(eq=False)
class PromptImages:
    images: Images
    keys: dict[int, str]  # prompt index of each image token → its image's content hash
    before: list[int]  # before[j]: image tokens among the prompt's first j tokens
    positions: torch.Tensor | None  # (3, prompt_len) M-RoPE positions; None without M-RoPE
    rope_delta: int = 0  # tokens after the prompt sit at index + rope_delta
    embeds: torch.Tensor | None = None  # the vision tower's output (image tokens, d_model), once computed

    @classmethod
    def of(cls, model: Transformer, prompt: list[int], images: Images) -> PromptImages:
        """Check the prompt's placeholders against the images; hash the images; lay out M-RoPE."""
        if model.visual is None:
            raise DecoderLMError("this model reads text only (it has no vision tower); send no images, or serve a vision-language model")
        cfg, merge = model.config, model.visual.config.merge_size
        counts = images.tokens(merge)
        at = [t == cfg.image_token_id for t in prompt]
        if sum(at) != sum(counts):
            raise DecoderLMError(f"the prompt has {sum(at)} image placeholder tokens but the images make {sum(counts)} tokens; "
                                 "put each image's placeholder in the prompt once")
        names, start = [], 0
        for grid, n in zip(images.grid_thw.tolist(), images.grid_thw.prod(-1).tolist()):
            h = hashlib.sha256(str(grid).encode())
            h.update(images.pixel_values[start : start + n].contiguous().float().numpy().tobytes())
            names.extend([f"image:{h.hexdigest()}"] * (n // merge**2))
            start += n
        keys = dict(zip((j for j, a in enumerate(at) if a), names))
        before = [0]
        for a in at:
            before.append(before[-1] + a)
        positions, delta = None, 0
        if cfg.mrope_section:
            pos, d = mrope_positions(torch.tensor([prompt]), images.grid_thw, cfg.image_token_id, merge)
            positions, delta = pos[:, 0], int(d)
        return cls(images, keys, before, positions, delta)

    def chunk_positions(self, start: int, n: int) -> torch.Tensor:
        """(3, n) M-RoPE positions of tokens start .. start + n."""
        out = (torch.arange(start, start + n) + self.rope_delta).expand(3, n).clone()
        end = min(start + n, self.positions.shape[1])
        if start < end:
            out[:, : end - start] = self.positions[:, start:end]
        return out

    def chunk_embeds(self, model: Transformer, start: int, n: int) -> tuple[list[bool], torch.Tensor]:
        """Which of tokens start .. start + n are image tokens, and their embeddings (running the tower the first time)."""
        if self.embeds is None:
            self.embeds = model.visual(Images(self.images.pixel_values.to(model.norm.weight.device), self.images.grid_thw))
        P = len(self.before) - 1
        at = [j in self.keys for j in range(start, start + n)]
        lo, hi = self.before[min(start, P)], self.before[min(start + n, P)]
        return at, self.embeds[lo:hi]


def image_bytes(url: str) -> bytes:
    """The bytes of a data: URL (base64); a remote URL is refused, as this server fetches nothing."""
    if url.startswith(("http://", "https://")):
        raise DecoderLMError("image_url: remote image URLs are not fetched by this server; send the image inline as "
                             "data:image/png;base64,...")
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise DecoderLMError("image_url: expected a base64 data URL (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise DecoderLMError("image_url: the data URL's base64 does not decode; encode the image bytes with base64") from None
