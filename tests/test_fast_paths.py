"""Speed-motivated rewrites must compute exactly what the plain versions do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from decoderlm.formats.gguf import FastReader
from decoderlm.model.norm import RMSNorm
from decoderlm.names import DEFAULT_MODEL, locate


def test_fast_gguf_reader_reads_what_gguf_reader_reads():
    path = locate(DEFAULT_MODEL)
    fast, plain = FastReader(path), GGUFReader(path)
    assert type(fast.data) is np.ndarray  # not np.memmap, whose slicing is slow
    assert list(fast.fields) == list(plain.fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.architecture", "llama.block_count"):
        assert fast.fields[key].contents() == plain.fields[key].contents()
    assert [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors] == [(t.name, t.tensor_type, list(t.shape)) for t in plain.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors[:8], plain.tensors[:8]))


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_its_formula(offset, dtype):
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 48).to(dtype)
    h = x.float()
    expected = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight.float())).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
