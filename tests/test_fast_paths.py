"""Speed-motivated rewrites must compute exactly what the plain versions do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from decoderlm.formats.gguf import FastReader
from decoderlm.model.norm import RMSNorm
from decoderlm.names import DEFAULT_MODEL, locate


def same_fields(fast: GGUFReader, plain: GGUFReader) -> None:
    """Every field as the library builds it: name, offset, parts (values and dtypes), indices, types."""
    assert list(fast.fields) == list(plain.fields)
    for key, ours in fast.fields.items():
        theirs = plain.fields[key]
        assert (ours.offset, ours.data, ours.types) == (theirs.offset, theirs.data, theirs.types), key
        assert len(ours.parts) == len(theirs.parts), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours.parts, theirs.parts)), key
        assert ours.contents() == theirs.contents(), key


def test_fast_gguf_reader_reads_what_gguf_reader_reads():
    path = locate(DEFAULT_MODEL)
    fast, plain = FastReader(path), GGUFReader(path)
    assert type(fast.data) is np.ndarray  # not np.memmap, whose slicing is slow
    same_fields(fast, plain)
    assert fast.fields["tokenizer.ggml.tokens"].contents(5) == plain.fields["tokenizer.ggml.tokens"].contents(5)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors] == [(t.name, t.tensor_type, list(t.shape)) for t in plain.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors[:8], plain.tensors[:8]))


def test_fast_gguf_reader_cuts_every_kind_of_array_as_the_library(tmp_path):
    w = GGUFWriter(tmp_path / "a.gguf", "llama")
    for t in (GGUFValueType.UINT8, GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.INT64,
              GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL):
        w.add_array(f"a.{t.name}", [1, 0, 1] if t == GGUFValueType.BOOL else [3, 1, 2])
        w.add_key_value(f"v.{t.name}", 1 if t != GGUFValueType.FLOAT32 else 0.5, t)
    w.add_array("a.floats", [0.25, -1.5, 3e9])
    w.add_array("a.strings", ["", "é", "a\x00b", "\U0001F600", "long " * 50])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_string("a.string", "plain")
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast, plain = FastReader(tmp_path / "a.gguf"), GGUFReader(tmp_path / "a.gguf")
    same_fields(fast, plain)
    assert fast.fields["a.strings"].contents() == ["", "é", "a\x00b", "\U0001F600", "long " * 50]
    assert np.array_equal(fast.tensors[0].data, np.arange(8, dtype=np.float32))


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
