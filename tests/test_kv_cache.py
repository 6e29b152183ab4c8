"""Decoding through the KV caches (contiguous, and rolling for sliding windows) gives the logits of
full recomputation, left-padded rows equal each row alone, and the caches are lean."""

import pytest
import torch
from conftest import configs, tiny_config, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.kv_cache import KVCache, RollingKVCache, cache_dtype, cache_for, store_keys_in
from decoderlm.sampling import SamplingParams

T = 12  # longer than every sliding window drawn by `configs`


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@given(configs(), st.integers(1, T - 1), st.integers(1, 4), st.booleans(), st.integers(0, 2**16))
@settings(max_examples=30)
def test_cached_decoding_equals_full_recomputation(cfg, prefill_len, chunk, half, seed):
    """Prefill a prefix, then feed the rest `chunk` tokens at a time (1 = token by token); keys kept in
    fp32 or in fp16 (`store_keys_in`: the full forward rounds them too)."""
    model = tiny_model(seed, **cfg)
    store_keys_in(model, torch.float16 if half else None)
    ids = torch.randint(0, 37, (2, T), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(model.config, 2, T, dtype=cache_dtype(model))
    with torch.no_grad():
        full = model(ids).logits  # (B, T, V)
        parts = [model(ids[:, :prefill_len], cache=cache).logits]
        for s in range(prefill_len, T, chunk):
            parts.append(model(ids[:, s : s + chunk], cache=cache).logits)
    assert cache.length == T
    assert_close(torch.cat(parts, dim=1), full)


@given(configs(), st.integers(0, 2**16))
@settings(max_examples=20)
def test_left_padded_batch_equals_each_row_alone(cfg, seed):
    """Rows of different lengths, left-padded: prefill and 3 decode steps match each row run unpadded."""
    model = tiny_model(seed, **cfg)
    gen = torch.Generator().manual_seed(seed)
    lengths, steps = [7, 3, 5], 3
    width = max(lengths)
    rows = [torch.randint(0, 37, (n + steps,), generator=gen) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width + steps, dtype=torch.long)  # (B, L): every slot ever used
    for b, n in enumerate(lengths):
        ids[b, width - n :] = rows[b][:n]
        attention_mask[b, width - n :] = 1
    cache = KVCache(model.config, len(rows), width + steps)
    with torch.no_grad():
        prefill = model(ids, cache=cache, attention_mask=attention_mask[:, :width]).logits  # (B, width, V)
        decoded = [model(torch.stack([r[n + s] for r, n in zip(rows, lengths)])[:, None], cache=cache,
                         attention_mask=attention_mask[:, : width + s + 1]).logits for s in range(steps)]
        for b, n in enumerate(lengths):
            alone = model(rows[b][None]).logits[0]  # (n + steps, V)
            assert_close(prefill[b, width - n :], alone[:n])
            for s in range(steps):
                assert_close(decoded[s][b, 0], alone[n + s])


def test_fp16_keys_are_rounded_in_every_path():
    """Keys kept in fp16: the cache stores fp16, and the plain forward rounds k and v as the cache does, so
    its logits move from the fp32 keys' (ten times more than cached decoding differs from them) while
    cached decoding through the contiguous, rolling and hybrid caches still gives them."""
    ids = torch.randint(0, 37, (1, T), generator=torch.Generator().manual_seed(0))
    for cfg in ({}, {"sliding_window": 4}, {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}):
        model = tiny_model(0, **cfg)
        with torch.no_grad():
            exact = model(ids).logits
            store_keys_in(model, torch.float16)
            full = model(ids).logits
            cache = cache_for(model.config, 1, T, dtype=cache_dtype(model))
            steps = torch.cat([model(ids[:, :5], cache=cache).logits] + [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, T)], 1)
        assert cache_dtype(model) == torch.float16 and (full - exact).abs().max() > 10 * (steps - full).abs().max(), cfg
        assert_close(steps, full)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cache_holds_only_the_kv_heads(n_kv_heads):
    config = tiny_config(n_heads=4, n_kv_heads=n_kv_heads)
    mha = KVCache(tiny_config(n_heads=4), batch_size=2, max_len=10)
    cache = KVCache(config, batch_size=2, max_len=10)
    assert cache.k[0].shape == (2, n_kv_heads, 16, config.head_dim)  # (B, Hkv, L, D): 10 slots, rounded up to 16
    assert cache.nbytes() * 4 == mha.nbytes() * n_kv_heads
    assert cache.nbytes() == 2 * config.n_layers * 2 * n_kv_heads * 16 * config.head_dim * 4  # K and V, fp32


def test_cache_is_preallocated_and_written_in_place():
    model = tiny_model(n_kv_heads=2)
    cache = KVCache(model.config, 1, 8)
    pointers = [t.data_ptr() for t in cache.k + cache.v]
    ids = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(0))
    values = []  # what layer 1 projects to V, step by step
    model.layers[1].self_attn.v_proj.register_forward_hook(lambda module, args, out: values.append(out))
    with torch.no_grad():
        for s, e in ((0, 4), (4, 5), (5, 6)):  # prefill, then two decode steps
            model(ids[:, s:e], cache=cache)
    assert [t.data_ptr() for t in cache.k + cache.v] == pointers
    assert cache.length == 6
    expected = torch.cat(values, dim=1).view(1, 6, 2, -1).transpose(1, 2)  # (B, Hkv, T, D)
    assert torch.equal(cache.v[1][:, :, :6], expected)
    assert cache.k[1][:, :, 6:].eq(0).all() and cache.v[1][:, :, 6:].eq(0).all()  # later slots untouched


def test_cache_overflow_is_an_error():
    model = tiny_model()
    cache = KVCache(model.config, 1, 4)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(DecoderLMError, match="holds 4 tokens"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


# --- the rolling cache of sliding-window models ---------------------------------------------------

window_configs = configs().map(lambda cfg: {k: v for k, v in cfg.items() if k != "sliding_window"})


@given(window_configs, st.integers(1, 6), st.integers(1, 14), st.lists(st.integers(1, 4), max_size=6), st.integers(0, 2**16))
@settings(max_examples=40)
def test_rolling_cache_equals_full_recomputation(cfg, window, prefill_len, chunks, seed):
    """Prefill (longer or shorter than the window), then chunks of 1-4 tokens: the logits of one
    cache-free forward over everything, with the window's mask."""
    model = tiny_model(seed, sliding_window=window, **cfg)
    T = prefill_len + sum(chunks)
    ids = torch.randint(0, 37, (2, T), generator=torch.Generator().manual_seed(seed))
    cache = RollingKVCache(model.config, 2)
    bounds = [0, prefill_len] + [prefill_len + sum(chunks[: i + 1]) for i in range(len(chunks))]
    with torch.no_grad():
        full = model(ids).logits  # (B, T, V)
        parts = [model(ids[:, s:e], cache=cache).logits for s, e in zip(bounds, bounds[1:])]
    assert cache.length == T
    assert_close(torch.cat(parts, dim=1), full)


@given(window_configs, st.integers(2, 5), st.integers(0, 2**16))
@settings(max_examples=15)
def test_rolling_cache_left_padded_batch_equals_each_row_alone(cfg, window, seed):
    model = tiny_model(seed, sliding_window=window, **cfg)
    gen = torch.Generator().manual_seed(seed)
    lengths, steps = [7, 2, 5], 6  # decoding runs well past the window
    width = max(lengths)
    rows = [torch.randint(0, 37, (n + steps,), generator=gen) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width + steps, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = rows[b][:n]
        attention_mask[b, width - n :] = 1
    cache = RollingKVCache(model.config, len(rows))
    with torch.no_grad():
        prefill = model(ids, cache=cache, attention_mask=attention_mask[:, :width]).logits
        decoded = [model(torch.stack([r[n + s] for r, n in zip(rows, lengths)])[:, None], cache=cache,
                         attention_mask=attention_mask[:, : width + s + 1]).logits for s in range(steps)]
        for b, n in enumerate(lengths):
            alone = model(rows[b][None]).logits[0]
            assert_close(prefill[b, width - n :], alone[:n])
            for s in range(steps):
                assert_close(decoded[s][b, 0], alone[n + s])


def test_rolling_cache_memory_stops_growing_at_the_window():
    model = tiny_model(n_kv_heads=2, sliding_window=5)
    cache = RollingKVCache(model.config, 1)
    pointers = [t.data_ptr() for t in cache.k + cache.v]
    cfg = model.config
    window_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * 4 * cfg.head_dim * 4  # K and V of the window - 1 tokens a query needs, fp32
    assert cache.nbytes() == window_bytes
    with torch.no_grad():
        model(torch.randint(0, 37, (1, 12)), cache=cache)  # a prefill longer than the window
        for _ in range(20):
            model(torch.randint(0, 37, (1, 1)), cache=cache)
    assert cache.length == 32 and cache.nbytes() == window_bytes
    assert [t.data_ptr() for t in cache.k + cache.v] == pointers
    assert sorted(cache.slot_pos[0].tolist()) == [28, 29, 30, 31]  # the newest tokens, nothing older


def test_generate_uses_the_rolling_cache_for_sliding_window_models():
    caches = []

    def record(module, args, kwargs):
        caches.append(kwargs.get("cache"))

    for window, kind in ((4, RollingKVCache), (None, KVCache), (100, KVCache)):  # a window past the context is full attention
        model = tiny_model(sliding_window=window)
        caches.clear()
        model.register_forward_pre_hook(record, with_kwargs=True)
        generate(model, [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0))
        assert all(type(c) is kind for c in caches), window
        assert type(cache_for(model.config, 1, 64)) is kind
