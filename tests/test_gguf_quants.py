"""The GGUF block types newer files ship with (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4): our torch
dequantization (decoderlm.formats.gguf_quants) equals the `gguf` package's own `gguf.quants.dequantize`
exactly, on random data quantized by that package where it can quantize the type, else on random
blocks with sane fp16 scales; through the file reader both ways (small tensors and the tensor-by-tensor
load path); `--quantize auto` puts them on Q8_0's grid (int8), as it does K-quants."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf import read_tensor, write_gguf
from test_quantize_auto import CPU, tensor

from decoderlm.formats import gguf_quants
from decoderlm.formats.gguf import dequantize_tensor, native_mode
from decoderlm.formats.gguf import read_tensor as read_for_load

QUANTIZABLE = (Q.Q5_0, Q.Q5_1, Q.MXFP4)  # the gguf package quantizes these; the others it only dequantizes
FP16_AT = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0]}  # byte offsets of each block's fp16 scales


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / block · bytes) uint8: `qtype` blocks, random data, quantized by gguf or random bytes."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 3, qtype)
    n, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // n * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in FP16_AT[qtype]:
        blocks[:, at : at + 2] = rng.uniform(-0.1, 0.1, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", list(gguf_quants.BLOCKS), ids=lambda q: q.name)
def test_dequantize_equals_the_gguf_package(qtype):
    raw = random_blocks(qtype, 4, 512)
    ours = gguf_quants.dequantize_blocks(torch.from_numpy(raw.reshape(-1).copy()), qtype).numpy()
    want = dequantize(raw, qtype).reshape(-1)
    assert np.isfinite(want).all() and ours.shape == want.shape
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("qtype", list(gguf_quants.BLOCKS), ids=lambda q: q.name)
def test_files_of_each_type_read_both_ways(tmp_path, qtype):
    raw = random_blocks(qtype, 3, 256, seed=1)
    write_gguf(tmp_path / "q.gguf", "llama", {}, [("t", raw, qtype)])
    t = read_tensor(tmp_path / "q.gguf")
    want = torch.from_numpy(dequantize(raw, qtype))
    assert t.tensor_type == qtype
    assert torch.equal(dequantize_tensor(t), want)
    with open(tmp_path / "q.gguf", "rb") as f:
        assert torch.equal(read_for_load(f, t), want)


def test_gguf_quantizes_what_it_says():
    """The premise of QUANTIZABLE: the package quantizes those and refuses the others (if it learns to,
    move the type over so the test uses real quantized data)."""
    x = np.zeros((1, 256), dtype=np.float32)
    for qtype in gguf_quants.BLOCKS:
        try:
            quantize(x, qtype)
            can = True
        except NotImplementedError:
            can = False
        assert can == (qtype in QUANTIZABLE), qtype.name


@pytest.mark.parametrize("qtype", list(gguf_quants.BLOCKS), ids=lambda q: q.name)
def test_auto_puts_each_type_on_the_int8_grid(monkeypatch, qtype):
    import decoderlm.formats.gguf as gguf_module

    monkeypatch.setattr(gguf_module, "kernels_vectorized", lambda: True)
    assert native_mode([tensor("blk.0.ffn_up.weight", qtype, (256, 512))], CPU) == "int8"
