"""Images → the vision tower's input, as transformers' Qwen2-VL image processor makes it (Pillow backend).

Each image is converted to RGB (transparency over white), resized with bicubic filtering so both sides
are multiples of patch_size × merge_size (28) and its area lies within [min_pixels, max_pixels], the
aspect ratio kept as closely as that allows (`smart_resize`); scaled to [0, 1], normalized with CLIP's
mean and std, and cut into patch_size² patches, each repeated temporal_patch_size times (a still image
is a clip of identical frames), in blocks of merge_size × merge_size patches.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.jsonio import read_json
from decoderlm.model.vision import Images

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MAX_SOURCE_PIXELS = 8192 * 8192  # a decoded image larger than this is refused before it is resized
MAX_ASPECT = 200


@dataclass
class ImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    std: list[float] = field(default_factory=lambda: list(CLIP_STD))
    rescale_factor: float = 1 / 255

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ImageProcessor":
        """The checkpoint's preprocessor_config.json, where it has one; transformers' defaults otherwise."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        d: dict[str, Any] = read_json(path, "preprocessor_config.json", "restore the checkpoint's original file")
        size = d.get("size") or {}
        default = cls()
        return cls(min_pixels=d.get("min_pixels") or size.get("shortest_edge") or default.min_pixels,
                   max_pixels=d.get("max_pixels") or size.get("longest_edge") or default.max_pixels,
                   patch_size=d.get("patch_size", 14), temporal_patch_size=d.get("temporal_patch_size", 2), merge_size=d.get("merge_size", 2),
                   mean=list(d.get("image_mean") or CLIP_MEAN), std=list(d.get("image_std") or CLIP_STD),
                   rescale_factor=d.get("rescale_factor", 1 / 255))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """smart_resize: (height, width) multiples of patch × merge, area within [min_pixels, max_pixels]."""
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise DecoderLMError(f"an image of {width}×{height} pixels is too elongated (aspect ratio above {MAX_ASPECT}); crop it")
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def tokens(self, height: int, width: int) -> int:
        """Language-model tokens an image of this size becomes."""
        h, w = self.resized_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def __call__(self, images: list[Any]) -> Images:
        """Images (paths, bytes or PIL images) → pixel_values (N, C·t·p·p) and grid_thw (n, 3)."""
        return self.pixels([self.resized(open_image(image)) for image in images])

    def pixels(self, resized: list[torch.Tensor]) -> Images:
        """Resized images (3, H, W) uint8 → pixel_values and grid_thw (training data keeps images resized, as bytes)."""
        patches, grids = [], []
        for x in resized:
            x, grid = self.patchify(self.normalize(x))
            patches.append(x)
            grids.append(grid)
        return Images(torch.cat(patches), torch.tensor(grids))

    def resized(self, image: Any) -> torch.Tensor:
        """RGB (transparency over white, as transformers does), resized: (3, H, W) uint8."""
        from PIL import Image

        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        image = image.convert("RGB")
        h, w = self.resized_size(image.height, image.width)
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """(3, H, W) uint8 → scaled and normalized float32."""
        x = (x.double() * self.rescale_factor).float()  # float64 then float32, as transformers rounds
        return (x - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(C, H, W) → patches (gh·gw, C·t·p·p) in merge blocks, and the grid [1, gh, gw]."""
        C, H, W = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = H // p, W // p
        x = x.view(C, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)  # each patch as t identical frames
        return x.reshape(gh * gw, C * t * p * p), [1, gh, gw]


def open_image(source: Any) -> Any:
    """A PIL image from a path, bytes or a PIL image; one clear line for what Pillow cannot read or a too large image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image, name = source, "the image"
    else:
        name = "the image data" if isinstance(source, (bytes, bytearray)) else str(source)
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
            if image.width * image.height > MAX_SOURCE_PIXELS:
                raise DecoderLMError(f"{name} has {image.width}×{image.height} pixels, more than the {MAX_SOURCE_PIXELS:,} "
                                     "decoderlm reads; downscale it first")
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise DecoderLMError(f"{name} is not an image Pillow can read ({e}); give a PNG, JPEG, WebP or GIF file") from None
    return image


def image_placeholder(tokenizer: Any, image_token_id: int) -> str:
    """The text one image stands as in a prompt: Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>
    (the image token's own text, between the vision markers where the vocabulary has them)."""
    vocab = tokenizer.get_vocab()
    names = {i: t for t, i in vocab.items()}
    if image_token_id not in names:
        raise DecoderLMError(f"the tokenizer has no token {image_token_id} (the config's image_token_id); copy the checkpoint's tokenizer files")
    pad = names[image_token_id]
    return f"<|vision_start|>{pad}<|vision_end|>" if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab else pad


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Each image's single placeholder token repeated as many times as the image has tokens."""
    if ids.count(image_token_id) != len(counts):
        raise DecoderLMError(f"the prompt has {ids.count(image_token_id)} image placeholders for {len(counts)} images; "
                             "give one placeholder per image")
    out, n = [], iter(counts)
    for t in ids:
        out.extend([t] * next(n) if t == image_token_id else [t])
    return out
