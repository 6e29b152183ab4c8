"""The kernels of a decode step's small ops on the CPU (decoderlm/kernels): one-query attention
(attention.c), softmax attention within fp32 rounding of the exact one and, bit for bit, a row's result
whatever shares its batch, however many masked keys follow its own and whether its keys sit in a
contiguous cache or in a paged pool's blocks; with RoPE and the cache write in the same call, those
three steps' bits; RMSNorm (norm.c), within fp32 rounding, a row's result
its own; each row's k largest values (top_k.c), exactly the stable sort's. Marked `isa`: make test runs them again at AVX2 and the plain level."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import kernels
from decoderlm.kv_cache import KVCache, cache_dtype, store_keys_in
from decoderlm.model import attention
from decoderlm.model.cache import aligned
from decoderlm.model.fuse import fuse_projections
from decoderlm.model.rope import apply_rope_
from decoderlm.model.norm import RMSNorm

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not kernels.available(), reason="no C compiler here: SDPA is used")]
MIN = torch.finfo(torch.float32).min


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention in fp64, the K/V heads repeated for their query heads (B, H, 1, Dv)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) * scale + (0 if mask is None else mask.double())
    return s.softmax(-1) @ v


def inputs(B: int, H: int, Hkv: int, L: int, D: int, seed: int, masked: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, Hkv, L, D, generator=g) * 2, torch.randn(B, Hkv, L, D, generator=g)
    hidden = torch.rand(B, 1, 1, L, generator=g) < masked
    hidden[..., 0] = False  # every row sees one key at least
    return q, k, v, torch.zeros(B, 1, 1, L).masked_fill_(hidden, MIN)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), Hkv=st.integers(1, 3), G=st.integers(1, 4), L=st.integers(1, 70), D=st.sampled_from([8, 24, 64, 80, 128]),
       masked=st.booleans(), seed=st.integers(0, 99))
def test_attention_of_one_query_is_softmax_attention(B, Hkv, G, L, D, masked, seed):
    """Any batch, head grouping, key count and head size (not only multiples of a vector): within fp32
    rounding of fp64 softmax attention; masked keys (the mask's minimum) get no weight at all."""
    q, k, v, mask = inputs(B, G * Hkv, Hkv, L, D, seed)
    mask = mask if masked else None
    y = kernels.attend_one(q, k, v, mask, D ** -0.5)
    assert y.shape == (B, G * Hkv, 1, D)
    torch.testing.assert_close(y.double(), reference(q, k, v, mask, D ** -0.5), atol=2e-6, rtol=1e-5)


def test_it_is_what_sdpa_computes_for_a_decode_step():
    q, k, v, mask = inputs(3, 9, 3, 200, 64, seed=1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(kernels.attend_one(q, k, v, mask, 64 ** -0.5), expected, atol=1e-6, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(2, 9), L=st.integers(1, 300), extra=st.integers(1, 40), seed=st.integers(0, 99))
def test_a_row_is_the_same_alone_in_a_batch_and_with_masked_keys_after_its_own(B, L, extra, seed):
    """Bit for bit: a row alone equals the row in the batch (whatever the thread split), and equals it
    with `extra` masked slots after its keys, as a cache rounded up to whole blocks hands them."""
    q, k, v, mask = inputs(B, 6, 2, L, 64, seed)
    whole = kernels.attend_one(q, k, v, mask, 0.125)
    i = seed % B
    assert torch.equal(kernels.attend_one(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask[i : i + 1], 0.125), whole[i : i + 1])
    junk = torch.randn(B, 2, extra, 64)
    longer = kernels.attend_one(q, torch.cat((k, junk), 2), torch.cat((v, junk), 2), F.pad(mask, (0, extra), value=MIN), 0.125)
    assert torch.equal(longer, whole)


@settings(max_examples=10, deadline=None)
@given(L=st.integers(1, 60), D=st.sampled_from([8, 20, 64]), seed=st.integers(0, 99))
def test_a_key_counts_the_same_whichever_keys_share_its_vector(L, D, seed):
    """Bit for bit: with 0-16 masked keys before a row's own, each key's score is summed in a different
    group of keys (the kernel takes a vector's worth at a time, the rest one by one), and the result is
    the same."""
    q, k, v, _ = inputs(2, 6, 2, L, D, seed)
    alone = kernels.attend_one(q, k, v, None, 0.3)
    for shift in range(17):
        junk = torch.randn(2, 2, shift, D)
        mask = torch.zeros(2, 1, 1, shift + L).index_fill_(-1, torch.arange(shift), MIN)
        shifted = kernels.attend_one(q, torch.cat((junk, k), 2), torch.cat((junk, v), 2), mask, 0.3)
        assert torch.equal(shifted, alone), shift


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.integers(1, 3), G=st.integers(1, 3), L=st.integers(1, 70), D=st.sampled_from([8, 24, 64, 128]),
       masked=st.booleans(), seed=st.integers(0, 99))
def test_an_fp16_cache_is_read_as_its_fp32_values(B, Hkv, G, L, D, masked, seed):
    """Keys and values kept in fp16 (`--kv-cache fp16`): the same bits as their fp32 values, whole vectors
    and the channels past them, masked or not."""
    q, k, v, mask = inputs(B, G * Hkv, Hkv, L, D, seed)
    k, v = k.half(), v.half()
    mask = mask if masked else None
    assert torch.equal(kernels.attend_one(q, k, v, mask, 0.3), kernels.attend_one(q, k.float(), v.float(), mask, 0.3))


def test_every_fp16_value_is_read_exactly():
    """Each of fp16's 63,488 finite values, as the one value of a row's one key (softmax gives it weight 1):
    read back as its fp32 value, in whole vectors and in the channels past them (D = 70)."""
    finite = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = finite[finite.isfinite()]
    D = 70
    v = torch.cat((finite, finite[: -len(finite) % D])).view(-1, 1, 1, D)  # (B, 1, 1, D)
    q, k = torch.randn(v.shape[0], 1, 1, D), torch.randn(v.shape[0], 1, 1, D).half()
    assert torch.equal(kernels.attend_one(q, k, v, None, 0.1), v.float())


def test_an_fp16_cache_rounds_every_float_as_torch():
    """rope_attend_one's write into an fp16 cache: to nearest, ties to even, as `Tensor.half`, on fp16's
    midpoints (ties), random bit patterns (subnormals, overflow to inf, NaN), ±0 and ±inf; NaN stays NaN."""
    finite = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = finite[finite.isfinite()].double().sort().values
    ties = ((finite[1:] + finite[:-1]) / 2).float()  # exact in fp32: one bit more than fp16's
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504, 65519.99, 65520, -65520, 2**-24, 2**-25, 2**-26, 6e-8])
    bits = torch.randint(-(2**31), 2**31 - 1, (2**16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    x = torch.cat((ties, edges, bits.to(torch.int32).view(torch.float32)))
    D, rot = 70, 2  # the first two channels rotated, the other 68 written as they are
    x = torch.cat((x, x[: -len(x) % (D - rot)])).view(-1, D - rot)
    B = x.shape[0]
    qkv = torch.zeros(B, 3, D)
    qkv[:, 1, rot:], qkv[:, 2, rot:] = x, x.flip(0)  # the key head and the value head
    cos, sin = torch.ones(1, 1, 1, rot), torch.zeros(1, 1, 1, rot)
    k, v = torch.zeros(B, 1, 1, D, dtype=torch.float16), torch.zeros(B, 1, 1, D, dtype=torch.float16)
    kernels.rope_attend_one(qkv, cos, sin, k, v, [0] * B, None, 0.1)
    for got, want in ((k[:, 0, 0, rot:], x.half()), (v[:, 0, 0, rot:], x.flip(0).half())):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4), bs=st.sampled_from([1, 4, 16]), half=st.booleans(),
       seed=st.integers(0, 99))
def test_keys_read_through_block_tables_equal_the_contiguous_ones(lengths, bs, half, seed):
    """A paged pool (slots, Hkv, D), fp32 or fp16, each row's blocks anywhere in it: the same bits as the
    row's keys laid out contiguously, each row over its own length only."""
    B, Hkv, D, L = len(lengths), 2, 32, max(lengths)
    W = -(-L // bs)
    blocks = list(range(1, 1 + B * W))
    random.Random(seed).shuffle(blocks)
    table = torch.tensor(blocks).view(B, W)
    q, k, v, _ = inputs(B, 4, Hkv, W * bs, D, seed)
    dtype = torch.float16 if half else torch.float32
    k, v = k.to(dtype), v.to(dtype)
    pool_k, pool_v = torch.randn((1 + B * W) * bs, Hkv, D).to(dtype), torch.randn((1 + B * W) * bs, Hkv, D).to(dtype)
    slots = (table[..., None] * bs + torch.arange(bs)).view(B, W * bs)  # (B, L): slot of key l
    for b in range(B):
        pool_k[slots[b]], pool_v[slots[b]] = k[b].transpose(0, 1), v[b].transpose(0, 1)
    paged = kernels.attend_one(q, pool_k, pool_v, None, 0.2, blocks=(table, bs, lengths))
    for b, n in enumerate(lengths):
        alone = kernels.attend_one(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None, 0.2)
        assert torch.equal(paged[b : b + 1], alone)


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 4), Hkv=st.integers(1, 3), G=st.integers(1, 3), D=st.sampled_from([8, 24, 64, 128]), partial=st.booleans(),
       per_row=st.booleans(), at=st.integers(0, 40), half=st.booleans(), seed=st.integers(0, 99))
def test_rope_the_write_and_attention_in_one_call_are_the_three_steps(B, Hkv, G, D, partial, per_row, at, half, seed):
    """rope_attend_one, bit for bit: apply_rope_ on the query and key heads (all channels or the first
    half: partial rotary; one row of angles for all or one per row), the cache's `update` at slot `at`
    (an fp16 cache: k and v rounded as `Tensor.half` rounds), and attend_one over the slots up to a
    multiple of 16; slots before `at` and after it are untouched."""
    g = torch.Generator().manual_seed(seed)
    H, rot, S = G * Hkv, D // 2 if partial else D, aligned(at + 1) + 16
    qkv = torch.randn(B, H + 2 * Hkv, D, generator=g)
    angles = torch.rand(B if per_row else 1, 1, 1, rot // 2, generator=g) * 6
    cos, sin = angles.cos().repeat(1, 1, 1, 2), torch.cat((-angles.sin(), angles.sin()), -1)
    dtype = torch.float16 if half else torch.float32
    k_cache, v_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    mask = torch.zeros(B, 1, 1, aligned(at + 1)).masked_fill_(torch.arange(aligned(at + 1)) > at, MIN)

    expected_qkv, k_expected, v_expected = qkv.clone(), k_cache.clone(), v_cache.clone()
    apply_rope_(expected_qkv.narrow(1, 0, H + Hkv)[:, None], cos, sin)  # (B, 1, H + Hkv, D), as the layer calls it
    q, k, v = expected_qkv[:, :, None].split((H, Hkv, Hkv), 1)  # (B, heads, 1, D)
    k_expected[:, :, at : at + 1], v_expected[:, :, at : at + 1] = k.to(dtype), v.to(dtype)
    L = aligned(at + 1)
    expected = kernels.attend_one(q, k_expected[:, :, :L], v_expected[:, :, :L], mask, 0.3)  # (B, H, 1, D)

    y = kernels.rope_attend_one(qkv, cos, sin, k_cache, v_cache, [at] * B, mask, 0.3)
    assert torch.equal(y, expected[:, :, 0]) and torch.equal(qkv, expected_qkv)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4), bs=st.sampled_from([1, 4, 16]), half=st.booleans(),
       seed=st.integers(0, 99))
def test_rope_the_write_and_attention_in_one_call_through_block_tables(lengths, bs, half, seed):
    """In a paged pool (fp32 or fp16), bit for bit: row b's rotated key and value land in the slot of its
    position lengths[b] - 1 through its table, nothing else in the pool changes, and each row attends over
    its own length as attend_one does after apply_rope_."""
    B, Hkv, G, D = len(lengths), 2, 2, 32
    W = -(-max(lengths) // bs)
    blocks = list(range(1, 1 + B * W))
    random.Random(seed).shuffle(blocks)
    table = torch.tensor(blocks).view(B, W)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, G * Hkv + 2 * Hkv, D, generator=g)
    angles = torch.rand(B, 1, 1, D // 2, generator=g) * 6
    cos, sin = angles.cos().repeat(1, 1, 1, 2), torch.cat((-angles.sin(), angles.sin()), -1)
    dtype = torch.float16 if half else torch.float32
    pool_k, pool_v = (torch.randn((1 + B * W) * bs, Hkv, D, generator=g).to(dtype) for _ in range(2))

    expected_qkv, k_expected, v_expected = qkv.clone(), pool_k.clone(), pool_v.clone()
    apply_rope_(expected_qkv.narrow(1, 0, (G + 1) * Hkv)[:, None], cos, sin)
    q, k, v = expected_qkv[:, :, None].split((G * Hkv, Hkv, Hkv), 1)  # (B, heads, 1, D)
    for b, n in enumerate(lengths):
        slot = table[b, (n - 1) // bs] * bs + (n - 1) % bs
        k_expected[slot], v_expected[slot] = k[b, :, 0].to(dtype), v[b, :, 0].to(dtype)
    expected = kernels.attend_one(q, k_expected, v_expected, None, 0.2, blocks=(table, bs, lengths))

    y = kernels.rope_attend_one(qkv, cos, sin, pool_k, pool_v, [n - 1 for n in lengths], None, 0.2, blocks=(table, bs, lengths))
    assert torch.equal(y, expected[:, :, 0]) and torch.equal(qkv, expected_qkv)
    assert torch.equal(pool_k, k_expected) and torch.equal(pool_v, v_expected)


def test_decode_steps_run_on_the_kernel_and_match_sdpa(monkeypatch):
    """A model's one-token steps in inference go through the kernel (and not a training forward); with
    the kernel switched off (SDPA) the logits agree to fp32 rounding."""
    model = tiny_model(n_kv_heads=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = []
    real = kernels.attend_one
    monkeypatch.setattr(kernels, "attend_one", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def decode(expect_calls: bool) -> torch.Tensor:
        cache, calls[:] = KVCache(model.config, 2, 16), []
        with torch.inference_mode():
            model(ids[:, :6], cache=cache)
            out = torch.cat([model(ids[:, j : j + 1], cache=cache).logits for j in range(6, 9)], 1)
        assert bool(calls) == expect_calls
        return out

    on = decode(True)
    assert len(calls) == 3 * model.config.n_layers
    calls.clear()
    model(ids[:, :1]).logits.sum().backward()  # training: autograd needs SDPA
    assert not calls
    monkeypatch.setattr(attention.Attention, "one_query_kernel", lambda *a: False)
    torch.testing.assert_close(on, decode(False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
def test_a_fused_models_decode_steps_are_one_call_a_layer_and_the_same_bits(monkeypatch, padded, kv):
    """A loaded (fused) model's steps over a KVCache rotate, store and attend in one call a layer
    (`KVCache.rope_attend_one`); without it (RoPE in torch, the rounding to the model's kv_dtype, `write`,
    attend_one) the logits and the cache are bit for bit the same, left-padded rows (their own positions)
    and keys kept in fp16 included."""
    model = fuse_projections(tiny_model(n_kv_heads=2, head_dim=16, partial_rotary_factor=0.5))
    store_keys_in(model, kv)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        attention_mask[1, :3] = 0
    calls = []
    real = kernels.rope_attend_one
    monkeypatch.setattr(kernels, "rope_attend_one", lambda *a: calls.append(1) or real(*a))

    def decode() -> tuple[torch.Tensor, KVCache]:
        cache = KVCache(model.config, 2, 16, dtype=cache_dtype(model))
        with torch.inference_mode():
            model(ids[:, :6], cache=cache, attention_mask=attention_mask[:, :6])
            out = torch.cat([model(ids[:, j : j + 1], cache=cache, attention_mask=attention_mask[:, : j + 1]).logits for j in range(6, 9)], 1)
        return out, cache

    fused, cache = decode()
    assert len(calls) == 3 * model.config.n_layers and cache.k[0].dtype == kv
    monkeypatch.delattr(KVCache, "rope_attend_one")
    apart, apart_cache = decode()
    assert len(calls) == 3 * model.config.n_layers
    assert torch.equal(fused, apart)
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, apart_cache.k + apart_cache.v))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), N=st.integers(1, 300), eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 99))
def test_rms_norm_is_the_exact_norm_and_a_rows_own(rows, N, eps, seed):
    """Any width (not only multiples of a vector): within fp32 rounding of fp64; each row alone gives
    the bits it gives in the batch."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, N, generator=g) * 3, torch.randn(N, generator=g)
    y = kernels.rms_norm(x, w, eps)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(y.double(), exact, atol=1e-6, rtol=1e-5)
    i = seed % rows
    assert torch.equal(kernels.rms_norm(x[i : i + 1], w, eps), y[i : i + 1])


special = st.sampled_from([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), V=st.integers(1, 700), k=st.integers(1, 40), spread=st.sampled_from([2, 1000]),
       marks=st.lists(st.tuples(st.integers(0, 10**6), special), max_size=10), seed=st.integers(0, 99))
def test_top_k_is_the_stable_sorts_first_k(rows, V, k, spread, marks, seed):
    """The k largest of each row, largest first and of equal values the lower index first (a stable sort
    of -y), a NaN as +inf; many ties (spread 2), any width (past and within a vector); the operator too."""
    k = min(k, V)
    y = torch.randint(-spread, spread, (rows, V), generator=torch.Generator().manual_seed(seed)).float()  # (B, V)
    for at, value in marks:
        y.view(-1)[at % y.numel()] = value
    expected = torch.sort(-torch.where(y.isnan(), float("inf"), y), dim=-1, stable=True).indices[:, :k]
    assert torch.equal(kernels.top_k(y, k), expected)
    assert torch.equal(torch.ops.decoderlm.top_k(y, k), expected)


def test_top_k_refuses_what_it_cannot_read():
    for y, k in ((torch.zeros(2, 5), 6), (torch.zeros(2, 5), 0), (torch.zeros(2, 5, dtype=torch.float64), 2), (torch.zeros(5), 2)):
        with pytest.raises(ValueError, match="top_k"):
            kernels.top_k(y, k)


def test_rms_norm_layer_uses_the_kernel_only_in_inference(monkeypatch):
    norm = RMSNorm(48, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 3, 48)
    calls = []
    real = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        fast = norm(x)
    assert calls == [1]
    trained = norm(x)  # autograd: torch's op
    assert calls == [1] and trained.requires_grad
    torch.testing.assert_close(fast, trained.detach(), atol=1e-6, rtol=1e-5)
