"""Image preprocessing against transformers' Qwen2-VL image processor (Pillow backend), value for value."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from decoderlm import image as image_module
from decoderlm.errors import DecoderLMError
from decoderlm.image import ImageProcessor

SHAPES = [(50, 70, 3), (123, 301, 4), (10, 12, 3), (400, 300, 3), (61, 45, 1)]  # RGB, RGBA, below min_pixels, above max_pixels, grey


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, c), dtype=np.uint8).squeeze(-1) if c == 1 else
                            rng.integers(0, 256, (h, w, c), dtype=np.uint8)) for h, w, c in SHAPES]


@pytest.mark.parametrize("sizes", [{}, dict(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 64)])
def test_pixels_match_transformers_exactly(sizes):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(**sizes)(images(), return_tensors="pt")
    ours = ImageProcessor(**sizes)(images())
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(ours.pixel_values, ref["pixel_values"])


def test_token_count_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf, ours = Qwen2VLImageProcessorPil(), ImageProcessor()
    for h, w in [(480, 640), (1080, 1920), (20, 20), (4000, 3000)]:
        assert ours.tokens(h, w) == hf.get_number_of_image_patches(h, w) // 4


def test_preprocessor_config_is_read(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 6272, "max_pixels": 50176, "merge_size": 2, "patch_size": 14}')
    p = ImageProcessor.from_folder(tmp_path)
    assert (p.min_pixels, p.max_pixels) == (6272, 50176)
    assert ImageProcessor.from_folder(tmp_path / "none") == ImageProcessor()


def test_files_and_bytes_decode(tmp_path):
    buf = io.BytesIO()
    images()[0].save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    a, b = ImageProcessor()([tmp_path / "a.png"]), ImageProcessor()([buf.getvalue()])
    assert torch.equal(a.pixel_values, b.pixel_values) and a.grid_thw.tolist() == [[1, 4, 4]]


def test_unreadable_oversized_and_elongated_images_are_refused(tmp_path, monkeypatch):
    (tmp_path / "x.png").write_bytes(b"not an image")
    with pytest.raises(DecoderLMError, match="x.png is not an image Pillow can read"):
        ImageProcessor()([tmp_path / "x.png"])
    with pytest.raises(DecoderLMError, match="is not an image Pillow can read"):
        ImageProcessor()([b"\x89PNG\r\n\x1a\n truncated"])
    monkeypatch.setattr(image_module, "MAX_SOURCE_PIXELS", 1000)
    with pytest.raises(DecoderLMError, match="has 70×50 pixels, more than the 1,000 decoderlm reads; downscale it"):
        buf = io.BytesIO()
        images()[0].save(buf, format="PNG")
        ImageProcessor()([buf.getvalue()])
    with pytest.raises(DecoderLMError, match="too elongated"):
        ImageProcessor()([Image.new("RGB", (2010, 10))])
