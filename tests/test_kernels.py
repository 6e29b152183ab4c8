"""decoderlm's own block kernels (decoderlm/kernels): Q4_1 / Q4_0 / Q8_0 blocks times fp32 activations
equal the fp32 product with the exactly dequantized weight up to fp32 rounding, and a row's result
never depends on the rows it shares a call with. Marked `isa`: make test runs them again with the AVX2
and the plain variant (tests/test_cpu_levels.py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import isa, kernels
from decoderlm import quantize as q
from decoderlm.formats.gguf import unpack_blocks
from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.sampling import SamplingParams

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not kernels.available(), reason="no C compiler here: torch's kernels are used")]
QTYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def file_blocks(w: torch.Tensor, qtype: GGMLQuantizationType) -> q.Blocks:
    """w as a GGUF file stores it in `qtype` (gguf's own quantizer), read back as decoderlm reads files."""
    raw = torch.from_numpy(gguf_quantize(w.numpy(), qtype))
    return unpack_blocks(raw, qtype, tuple(w.shape))


def test_the_variant_is_the_level_torch_runs_at():
    assert kernels.level() == isa.current()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k_blocks=st.integers(1, 6), rows=st.integers(1, 9), kind=st.sampled_from(QTYPES), seed=st.integers(0, 99))
def test_blocks_times_x_is_the_exact_weights_product_in_fp32(n, k_blocks, rows, kind, seed):
    """Against fp64 with the file's exact weights: within a few fp32 roundings of Σ|x·w| (any N, not only
    multiples of the 4 outputs a tile takes; any number of rows, not only multiples of 4)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 32 * k_blocks, generator=g) * 0.05 + 0.01
    b = file_blocks(w, kind)
    layer = q.BlockLinear.from_blocks(b)
    x = torch.randn(rows, 32 * k_blocks, generator=g)
    exact = x.double() @ b.dequantize().double().T
    bound = 1e-6 * (x.abs().double() @ b.dequantize().abs().double().T + exact.abs()) + 1e-30
    assert ((layer(x).double() - exact).abs() <= bound).all()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 21), pick=st.data(), kind=st.sampled_from(QTYPES))
def test_a_rows_result_does_not_depend_on_the_batch(rows, pick, kind):
    """Bit for bit: each row alone, and any slice of the batch, gives what it gave in the whole batch."""
    torch.manual_seed(rows)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(37, 96) * 0.05, kind))
    x = torch.randn(rows, 96)
    whole = layer(x)
    i = pick.draw(st.integers(0, rows - 1))
    j = pick.draw(st.integers(i + 1, rows))
    assert torch.equal(layer(x[i:j]), whole[i:j])
    assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1])


def test_float_weights_take_the_int4_grid_and_q8_blocks():
    """Float weights (an HF checkpoint) go on the 4-bit grid int4_grid picks, or on Q8_0's: the layer
    computes with exactly those values."""
    torch.manual_seed(3)
    w = torch.randn(24, 64) * 0.05
    x = torch.randn(5, 64)
    qv, scale, low = q.int4_grid(w)
    scale, low = scale.half().float(), low.half().float()  # kept in fp16, as llama.cpp keeps them
    w4 = (qv.float().view(24, 2, 32) * scale[..., None] + low[..., None]).view(24, 64)
    assert torch.allclose(q.quantized_linear(w, "int4")(x), x @ w4.T, atol=1e-5, rtol=1e-5)
    b = q.q8_blocks(w)
    w8 = (b.q.float().view(24, 2, 32) * b.d.half().float()[..., None]).view(24, 64)
    assert torch.allclose(q.quantized_linear(w, "int8")(x), x @ w8.T, atol=1e-5, rtol=1e-5)


def test_stacked_layers_compute_as_the_separate_ones():
    torch.manual_seed(4)
    layers = [q.BlockLinear.from_blocks(file_blocks(torch.randn(n, 64) * 0.05, GGMLQuantizationType.Q4_1)) for n in (8, 5, 12)]
    fused = q.concat(layers)
    x = torch.randn(3, 64)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1))


def test_compiled_layer_equals_eager():
    torch.manual_seed(5)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(40, 64) * 0.05, GGMLQuantizationType.Q4_1))
    x = torch.randn(2, 64)
    compiled = torch.compile(lambda t: layer(t).relu(), fullgraph=True)
    assert torch.equal(compiled(x), layer(x).relu())


@pytest.fixture(scope="module")
def smollm2():
    float_model, tok = load(locate(DEFAULT_MODEL))
    quant, _ = load(locate(DEFAULT_MODEL), quantize="auto")
    return float_model, quant, tok


def test_smollm2_default_mode_runs_on_the_blocks_and_answers_as_fp32(smollm2):
    """The default (`auto`) mode on the embedded Q4_1 file computes with the file's own weights in fp32:
    logits within 1e-3 of the float path at every position, and the same greedy tokens on varied prompts."""
    float_model, quant, tok = smollm2
    assert isinstance(quant.lm_head, q.BlockLinear) and quant.lm_head.exact
    prompts = ["What is the capital of France?", "List three colors:", "Write a haiku about the sea.", "What is 17 times 3?"]
    for text in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        with torch.no_grad():
            a, b = float_model(torch.tensor([ids])).logits, quant(torch.tensor([ids])).logits
        assert b.dtype == torch.float32 and (a - b).abs().max() < 1e-3, text
        params = SamplingParams(temperature=0, max_new_tokens=16)
        assert generate(quant, ids, params) == generate(float_model, ids, params), text


def test_tied_embedding_reads_the_heads_blocks(smollm2):
    """SmolLM2's embedding is tied to its LM head: the int8 values are stored once, in the head."""
    _, quant, _ = smollm2
    emb = quant.embed_tokens
    assert emb.tied and emb.tied[0] is quant.lm_head and emb.qweight is None and emb.scales is None
    ids = torch.tensor([0, 5, 49151])
    rows = (quant.lm_head.blocks[ids].float().view(3, -1, 32) * quant.lm_head.block_scales[ids][..., None]).flatten(1)
    assert torch.equal(emb(ids), rows)



@pytest.mark.parametrize("kind", QTYPES)
def test_a_prefill_multiplies_by_the_float_paths_own_weight(kind):
    """From DENSE_TOKENS tokens per sequence the layer dequantizes once (bit for bit the float path's
    weight) and multiplies with BLAS: exactly F.linear with the file's dequantized weight."""
    torch.manual_seed(7)
    b = file_blocks(torch.randn(40, 96) * 0.05, kind)
    layer = q.BlockLinear.from_blocks(b)
    assert torch.equal(kernels.dequantize(layer.blocks, layer.block_scales, layer.block_offsets), b.dequantize())
    x = torch.randn(2, q.DENSE_TOKENS, 96)
    assert torch.equal(layer(x), x @ b.dequantize().T)
    few = x[:, : q.DENSE_TOKENS - 1]
    assert torch.equal(layer(few), torch.stack([kernels.matmul(s, layer.blocks, layer.block_scales, layer.block_offsets) for s in few]))
