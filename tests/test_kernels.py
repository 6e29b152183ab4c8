"""decoderlm's own block kernels (decoderlm/kernels): Q4_1 / Q4_0 / Q8_0 blocks times fp32 activations
equal the fp32 product with the exactly dequantized weight up to fp32 rounding, and a row's result
never depends on the rows it shares a call with. Marked `isa`: make test runs them again with the AVX2
and the plain variant (tests/test_cpu_levels.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import isa, kernels
from decoderlm import quantize as q
from decoderlm.errors import DecoderLMError
from decoderlm.formats.gguf import unpack_blocks
from decoderlm.generate import generate
from decoderlm.kv_cache import cache_dtype, store_keys_in
from decoderlm.loader import load
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.sampling import SamplingParams

from conftest import tiny_model

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
@given(rows=st.integers(2, 21), pick=st.data(), kind=st.sampled_from(QTYPES), k_blocks=st.sampled_from([3, 40]))
def test_a_rows_result_does_not_depend_on_the_batch(rows, pick, kind, k_blocks):
    """Bit for bit: each row alone, and any slice of the batch, gives what it gave in the whole batch (40
    blocks: a tile of 5-8 rows runs over x in chunks of 16 blocks, one row in one chunk)."""
    torch.manual_seed(rows)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(37, 32 * k_blocks) * 0.05, kind))
    x = torch.randn(rows, 32 * k_blocks)
    whole = layer(x)
    i = pick.draw(st.integers(0, rows - 1))
    j = pick.draw(st.integers(i + 1, rows))
    assert torch.equal(layer(x[i:j]), whole[i:j])
    assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1])


@pytest.mark.parametrize("kind", QTYPES)
def test_every_batch_size_gives_each_row_its_own_bits(kind):
    """1-25 rows: every tile size (AVX2's go to 12 rows) and every way a batch is split into tiles gives
    each row what it gives alone."""
    torch.manual_seed(0)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(9, 32 * 20) * 0.05, kind))
    x = torch.randn(25, 32 * 20)
    alone = torch.cat([layer(x[r : r + 1]) for r in range(25)])
    for rows in range(1, 26):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"


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


@pytest.mark.parametrize("prompts", ["fp32", "int16"])
def test_smollm2_default_mode_runs_on_the_blocks_and_answers_as_fp32(smollm2, prompts, monkeypatch):
    """The default (`auto`) mode on the embedded Q4_1 file computes with the file's own weights, decode steps
    with 16-bit activations, keys and values in fp16, and gives the float path's greedy tokens on varied
    prompts, with either arithmetic for prompts (`auto` picks int16 on AVX512-VNNI). With fp32 keys, its
    logits are within 1e-3 of the float path's at every position for fp32 prompts; within 0.05 for int16 ones
    (x rounded to 1/65024 of its block's largest value before each of 121 matmuls; llama.cpp's int8 moves them
    by 1.7 on these prompts). Keys rounded to fp16 move them by less than 0.1 more."""
    float_model, quant, tok = smollm2
    assert cache_dtype(quant) == torch.float16 and cache_dtype(float_model) == torch.float32
    assert isinstance(quant.lm_head, q.BlockLinear) and quant.lm_head.exact and quant.lm_head.activations == "int16"
    assert quant.lm_head.prompt_activations == ("int16" if kernels.integer_prompts() else "fp32")
    for layer in (m for m in quant.modules() if isinstance(m, q.BlockLinear)):
        monkeypatch.setattr(layer, "prompt_activations", prompts)
    texts = ["What is the capital of France?", "List three colors:", "Write a haiku about the sea.", "What is 17 times 3?"]
    for text in texts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        with torch.no_grad(), q.reading_prompt():  # as `generate` reads a prompt
            a, b = float_model(torch.tensor([ids])).logits, quant(torch.tensor([ids])).logits
            store_keys_in(quant, None)
            c = quant(torch.tensor([ids])).logits
            store_keys_in(quant, torch.float16)
        assert b.dtype == torch.float32 and (a - c).abs().max() < (1e-3 if prompts == "fp32" else 0.05), text
        assert (a - b).abs().max() < (a - c).abs().max() + 0.1, text
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


@pytest.mark.parametrize("kind", QTYPES)
def test_int16_prompts_give_each_row_the_same_bits_in_chunks_of_any_length(kind):
    """With prompt_activations "int16" a prompt never takes the dense path: a chunk of DENSE_TOKENS tokens
    or more, a shorter one and a decode step all give a row qdot.c's int16 result, so a server may cut a
    prompt anywhere (decoderlm.serve.scheduler's min_chunk is 1)."""
    torch.manual_seed(8)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(40, 96) * 0.05, kind))
    layer.activations = layer.prompt_activations = "int16"
    x = torch.randn(2, q.DENSE_TOKENS + 3, 96)
    want = torch.stack([kernels.matmul(s, layer.blocks, layer.block_scales, layer.block_offsets, "int16") for s in x])
    with q.reading_prompt():
        assert torch.equal(layer(x), want)
        assert torch.equal(layer(x[:, 5:9]), want[:, 5:9])
    assert torch.equal(layer(x), want) and torch.equal(layer(x[:, -1:]), want[:, -1:])
    assert not torch.equal(want, x @ layer.weight_rows(torch.arange(40)).T)  # not the fp32 path's numbers


@pytest.mark.parametrize("vnni", [True, False])
def test_auto_reads_prompts_in_int16_only_where_the_integer_kernels_beat_blas(vnni, monkeypatch):
    """`round_activations("auto")`: int16 decode steps everywhere; int16 prompts where
    `kernels.integer_prompts()` (AVX512-VNNI), fp32 prompts elsewhere; a named mode rounds decode steps only.
    The serving engine's scheduler then cuts prompts anywhere (one path) or keeps the dense side apart."""
    from decoderlm.serve import Engine

    monkeypatch.setattr(kernels, "integer_prompts", lambda: vnni)
    model = q.quantize(tiny_model(d_model=64, ffn_hidden=96), "int4")
    for mode, decode, prompt in (("auto", "int16", "int16" if vnni else "fp32"), ("int16", "int16", "fp32"), ("int8", "int8", "fp32")):
        assert q.round_activations(model, mode) > 0
        layers = [m for m in model.modules() if isinstance(m, q.BlockLinear)]
        assert {(m.activations, m.prompt_activations) for m in layers} == {(decode, prompt)}, mode
        assert q.one_prompt_path(model) == (prompt == "int16")
        assert Engine(model, max_batch=2, num_blocks=8).scheduler.min_chunk == (1 if prompt == "int16" else q.DENSE_TOKENS)


def test_integer_prompts_need_the_avx512_variant_and_vnni(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    for level, vnni, want in (("avx512", True, True), ("avx512", False, False), ("avx2", True, False), ("default", True, False)):
        monkeypatch.setattr(kernels, "level", lambda level=level: level)
        monkeypatch.setattr(isa, "cpuinfo", lambda vnni=vnni: ("a CPU", frozenset({"avx512f", "avx512_vnni"} if vnni else {"avx512f"})))
        assert kernels.integer_prompts() == want, (level, vnni)


QMAX = {"int8": 127, "int16": 32512}  # the largest |q| of a block's rounded x (qdot.c)
ROUNDED = list(QMAX)


def rounded(x: torch.Tensor, activations: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as qdot.c rounds it: per block of 32, integers q = round(x · QMAX/max|x|) (M, K/32, 32) and
    the scale max|x|/QMAX (M, K/32), in fp32 as qdot.c computes them."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    qmax = torch.full_like(amax, QMAX[activations])
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))  # a division (number / tensor is a reciprocal times the number)
    return torch.round(blocks * inv[..., None]), amax / qmax


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k_blocks=st.integers(1, 9), rows=st.integers(1, 7), kind=st.sampled_from(QTYPES),
       activations=st.sampled_from(ROUNDED), seed=st.integers(0, 99))
def test_rounded_activations_are_the_exact_product_of_the_rounded_x(n, k_blocks, rows, kind, activations, seed):
    """x rounded per block of 32 (int8: llama.cpp's scale max|x|/127; int16: max|x|/32512), then the exact
    product with the file's weights, up to a few fp32 roundings (row ends inside a quad of blocks
    included: 1 to 9 blocks); int16's x is within 1/65024 of each block's largest value."""
    g = torch.Generator().manual_seed(seed)
    b = file_blocks(torch.randn(n, 32 * k_blocks, generator=g) * 0.05 + 0.01, kind)
    x = torch.randn(rows, 32 * k_blocks, generator=g) * torch.rand(1, 32 * k_blocks, generator=g) * 3
    layer = q.BlockLinear.from_blocks(b)
    y = kernels.matmul(x, layer.blocks, layer.block_scales, layer.block_offsets, activations)
    qx, dx = rounded(x, activations)
    xq, w = (qx.double() * dx.double()[..., None]).view_as(x), b.dequantize().double()
    half_step = x.view(rows, -1, 32).abs().amax(-1, keepdim=True).double() / (2 * QMAX[activations])
    assert ((xq - x.double()).view(rows, -1, 32).abs() <= half_step * 1.01).all()  # 1 %: x·inv and dx are rounded to fp32
    exact = xq @ w.T
    bound = 2e-6 * (xq.abs() @ w.abs().T + exact.abs()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()
    assert (y.double() - x.double() @ w.T).abs().max() > 0  # x was rounded: not the fp32 path's product


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a·b + c for fp32 tensors, rounded once to fp32, as an FMA instruction does. a·b is exact in fp64;
    the sum is rounded to fp64 "to odd" (a result that was rounded gets an odd last bit), which makes
    its rounding to fp32 the single rounding of the exact value (fp64 has more than 24 + 1 bits)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    back = s - p
    err = (p - (s - back)) + (c - back)  # s + err == p + c exactly (TwoSum)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def qdot_reference(x: torch.Tensor, b: q.Blocks, fma: bool, activations: str) -> torch.Tensor:
    """qdot.c's arithmetic written out, fp32 rounding step by step: per (row, output) and block, the exact
    integer sum S = Σ qw·qx; block b's terms in chain b mod 4, in block order, A = A + (dw·dx)·S and then
    (Q4) A = A + m·sx (sx = dx·Σqx); y = (A0 + A2) + (A1 + A3). fma: each a·b + c rounded once (AVX2,
    AVX-512), else a·b rounded first (the plain level)."""
    M, K = x.shape
    N, B = b.q.shape[0], K // 32

    def madd(p: torch.Tensor, v: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        return fma32(p, v, acc) if fma else (p * v + acc)

    qx, dx = rounded(x, activations)  # (M, B, 32) integers, (M, B) fp32
    sx = dx * qx.sum(-1)  # (M, B) fp32
    S = torch.einsum("mbk,nbk->mnb", qx.double(), b.q.double().view(N, B, 32)).float()  # exact, then rounded as cvtdq2ps
    d, m = b.d.half().float(), None if b.m is None else b.m.half().float()
    A = torch.zeros(4, M, N)
    for blk in range(B):
        j = blk % 4
        A[j] = madd(dx[:, None, blk] * d[None, :, blk], S[..., blk], A[j])
        if m is not None:
            A[j] = madd(m[None, :, blk].expand(M, N), sx[:, None, blk].expand(M, N), A[j])
    return (A[0] + A[2]) + (A[1] + A[3])


@pytest.mark.parametrize("rows, blocks, outputs", [(1, 18, 45), (2, 19, 3000), (5, 19, 45), (11, 50, 3000), (11, 18, 6),
                                                   (16, 18, 45), (16, 50, 6), (20, 19, 3000), (3, 17, 45)])
@pytest.mark.parametrize("activations", ROUNDED)
@pytest.mark.parametrize("kind", QTYPES)
def test_rounded_activations_are_qdots_arithmetic_at_every_level_this_cpu_runs(kind, activations, rows, blocks, outputs):
    """Every variant of qdot.c this CPU runs (AVX-512, AVX2, the plain level), bit for bit against its
    arithmetic written out in torch (`qdot_reference`): AVX2 and AVX-512 are the same computation, so on
    a CPU with both they give the same bits. One or two rows: the one-row tiles (int8's way for any
    rows); 5 and 11: int16's batches (8 rows at a time, sums of 4 or 2 rows together; 50 blocks: in
    passes); 16 and 20: AVX-512's rows in lanes (a group of 16 rows; one of 16 and one of 4 in 8 lanes).
    18 blocks: four whole quads and two blocks; 19: three; 6 and 45 outputs: a partial tile; 3000: many
    tiles a thread; 17 blocks: a last quad of one block (its other vectors skipped below AVX-512)."""
    torch.manual_seed(8)
    b = file_blocks(torch.randn(outputs, 32 * blocks) * 0.05, kind)
    layer = q.BlockLinear.from_blocks(b)
    x = torch.randn(rows, 32 * blocks)
    name = ("q8" if layer.block_offsets is None else "q4") + kernels.ROUNDED[activations] + "_matmul"
    levels = [lv for lv in kernels.VARIANTS if lv in isa.supported()]
    assert levels
    for lv in levels:
        y = torch.empty(rows, outputs)
        getattr(kernels.library(), f"{name}_{lv}")(x.data_ptr(), rows, x.shape[1], layer.blocks.data_ptr(), layer.block_scales.data_ptr(),
                                                     None if layer.block_offsets is None else layer.block_offsets.data_ptr(), outputs, y.data_ptr())
        assert torch.equal(y, qdot_reference(x, b, lv != "default", activations)), lv


AMX = pytest.mark.skipif(not kernels.amx(), reason="this CPU has no AMX tiles (or the compiler does not know them)")


@AMX
@pytest.mark.parametrize("rows, blocks, outputs", [(32, 18, 45), (70, 19, 3000), (40, 1, 16), (33, 2, 17), (48, 3, 16), (97, 50, 6), (130, 18, 197)])
@pytest.mark.parametrize("kind", QTYPES)
def test_amx_tiles_give_the_batches_bits(kind, rows, blocks, outputs):
    """Batches of 32 rows or more on AMX tiles, int16 x in two int8 digits (qdot.c's `amx_*`), bit for bit the
    written-out arithmetic and the same call without tiles: partial groups of 16 rows (40, 70, 97, 130), partial
    tiles of 16 outputs (45, 17, 6, 197), one to three blocks (chains with no block), and chains of odd and even
    lengths (18, 19, 50 blocks)."""
    torch.manual_seed(rows)
    b = file_blocks(torch.randn(outputs, 32 * blocks) * 0.05, kind)
    layer = q.BlockLinear.from_blocks(b)
    x = torch.randn(rows, 32 * blocks) * torch.rand(1, 32 * blocks) * 3
    try:
        tiles = kernels.matmul(x, layer.blocks, layer.block_scales, layer.block_offsets, "int16")
        assert kernels.amx(False) is False
        vectors = kernels.matmul(x, layer.blocks, layer.block_scales, layer.block_offsets, "int16")
    finally:
        assert kernels.amx(True)
    assert torch.equal(tiles, vectors)
    assert torch.equal(tiles, qdot_reference(x, b, True, "int16"))


@AMX
def test_amx_is_off_when_asked_and_below_avx512():
    """DECODERLM_AMX=off keeps batches off the tiles; a process held to AVX2 never uses them."""
    code = "from decoderlm import kernels; print(kernels.amx())"
    for env in ({"DECODERLM_AMX": "off"}, isa.env("avx2")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", env


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(2, 21), pick=st.data(), kind=st.sampled_from(QTYPES), activations=st.sampled_from(ROUNDED),
       k_blocks=st.sampled_from([5, 45]))
def test_rounded_activations_keep_a_rows_result_apart_from_the_batch(rows, pick, kind, activations, k_blocks):
    """A decode step of many sequences (B, 1, in), bit for bit each sequence's own step (45 blocks: int16
    takes a batch in passes of at most 5 rows, 8 or fewer a weight row at a time)."""
    torch.manual_seed(rows)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(37, 32 * k_blocks) * 0.05, kind))
    layer.activations = activations
    x = torch.randn(rows, 1, 32 * k_blocks)
    whole = layer(x)
    i = pick.draw(st.integers(0, rows - 1))
    assert torch.equal(layer(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(whole[:, 0], kernels.matmul(x[:, 0], layer.blocks, layer.block_scales, layer.block_offsets, activations))


@pytest.mark.parametrize("activations", ROUNDED)
def test_rounded_activations_are_not_for_prompts_and_the_head_rescores_exactly(activations):
    """A prompt (read inside `reading_prompt`) keeps the fp32 path; other forwards (decode steps, a
    speculative check of several tokens) round x. As the LM head, each row's EXACT_TOP best logits are
    the fp32 products with the exact weights."""
    torch.manual_seed(9)
    b = file_blocks(torch.randn(300, 96) * 0.05, GGMLQuantizationType.Q8_0)
    layer = q.BlockLinear.from_blocks(b)
    layer.activations = activations
    x = torch.randn(1, 5, 96)
    with q.reading_prompt():
        assert torch.equal(layer(x)[0], kernels.matmul(x[0], layer.blocks, layer.block_scales, None))
    assert torch.equal(layer(x)[0], kernels.matmul(x[0], layer.blocks, layer.block_scales, None, activations))
    head = layer
    head.exact = True
    step = torch.randn(3, 1, 96)
    y = head(step)[:, 0]
    exact = step[:, 0].double() @ b.dequantize().double().T
    top = y.topk(q.EXACT_TOP, dim=-1).indices
    assert torch.allclose(y.gather(-1, top).double(), exact.gather(-1, top), atol=1e-5, rtol=0)
    assert torch.equal(top.sort().values, exact.topk(q.EXACT_TOP, dim=-1).indices.sort().values)
    rest = y.double() - exact
    rest.scatter_(-1, top, 0)
    assert rest.abs().max() > 1e-9  # the others keep the rounded step's values


@pytest.mark.parametrize("activations", ROUNDED)
def test_compiled_rounded_step_equals_eager(activations):
    torch.manual_seed(10)
    layer = q.BlockLinear.from_blocks(file_blocks(torch.randn(40, 160) * 0.05, GGMLQuantizationType.Q4_1))
    layer.activations = activations
    x = torch.randn(2, 1, 160)
    compiled = torch.compile(lambda t: layer(t).relu(), fullgraph=True)
    assert torch.equal(compiled(x), layer(x).relu())


@pytest.mark.parametrize("activations", ["auto", *ROUNDED])
def test_activations_are_asked_for_and_rounding_needs_block_layers(activations):
    """`load(..., activations=...)` (`--activations`) sets every block layer (auto: int16); asking a model
    without any for a rounding is refused in one line, as is an unknown value; auto loads it in fp32."""
    model, _ = load(locate(DEFAULT_MODEL), quantize="auto", activations=activations)
    blocks = [m for m in model.modules() if isinstance(m, q.BlockLinear)]
    assert blocks and all(m.activations == ("int16" if activations == "auto" else activations) for m in blocks)
    if activations == "auto":
        return
    with pytest.raises(DecoderLMError, match="needs layers on decoderlm's block kernels"):
        load(locate(DEFAULT_MODEL), activations=activations)  # float weights
    with pytest.raises(DecoderLMError, match="use one of auto, fp32, int16, int8"):
        load(locate(DEFAULT_MODEL), quantize="auto", activations="int4")
