"""The paged KV cache: block bookkeeping (reference counts, prefix names, LRU) and attention through
block tables equal to the contiguous KVCache, for batches of sequences of different lengths."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import configs, tiny_config, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import kernels
from decoderlm.errors import DecoderLMError
from decoderlm.kv_cache import KVCache
from decoderlm.model.fuse import fuse_projections
from decoderlm.serve.paged_cache import NULL_BLOCK, BlockPool, PagedCache, block_hash, layer_groups


def test_allocate_release_and_reference_counts():
    pool = BlockPool(tiny_config(), num_blocks=4, block_size=2)
    assert pool.capacity == 3 and pool.num_available() == 3
    blocks = [pool.allocate() for _ in range(3)]
    assert NULL_BLOCK not in blocks and len(set(blocks)) == 3
    assert pool.num_available() == 0 and pool.num_used() == 3
    with pytest.raises(DecoderLMError):
        pool.allocate()
    pool.release(blocks[:1])
    assert pool.num_available() == 1 and pool.ref_counts[blocks[0]] == 0
    assert pool.allocate() == blocks[0]  # an anonymous freed block is simply reused


def test_prefix_blocks_are_shared_and_evicted_least_recently_used_first():
    pool = BlockPool(tiny_config(), num_blocks=4, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    ha = block_hash(None, [1, 2])
    hb = block_hash(ha, [3, 4])
    pool.register(a, ha)
    pool.register(b, hb)
    assert pool.lookup([ha, hb, block_hash(hb, [5, 6])]) == [a, b]  # stops at the first miss
    assert pool.lookup([block_hash(None, [9, 9]), hb]) == []  # a chain must match from its start
    pool.take(a)
    assert pool.ref_counts[a] == 2  # two tables share it
    pool.release([b, a])
    pool.release([a])
    assert pool.ref_counts[a] == pool.ref_counts[b] == 0
    assert pool.num_available() == 3 and pool.lookup([ha, hb]) == [a, b]  # held by nobody, still cached
    pool.take(a)  # a prefix hit brings a back into use
    assert pool.num_available() == 2
    c = pool.allocate()  # the one never-used block goes first
    d = pool.allocate()  # then the cached tail b, evicted
    assert c not in (a, b) and d == b
    assert pool.lookup([ha, hb]) == [a]


def test_duplicate_content_stays_anonymous():
    pool = BlockPool(tiny_config(), num_blocks=4, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    h = block_hash(None, [1, 2])
    pool.register(a, h)
    pool.register(b, h)
    assert pool.lookup([h]) == [a]
    pool.release([b])
    assert b in pool.free  # not cached: its content is already known as a


def test_block_names_depend_on_the_whole_prefix():
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(block_hash(None, [1]), [2]) != block_hash(block_hash(None, [3]), [2])
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])


def test_pool_size_from_memory():
    cfg = tiny_config()  # 2 layers, 4 K/V heads of 8 dims: 2·2·4·8·4 = 512 bytes a token in fp32
    assert BlockPool.bytes_per_token(cfg, torch.float32) == 512
    assert BlockPool.bytes_per_token(cfg, torch.bfloat16) == 256


def test_a_table_too_short_for_its_tokens_is_refused():
    pool = BlockPool(tiny_config(), num_blocks=4, block_size=2)
    with pytest.raises(DecoderLMError, match="cannot hold"):
        PagedCache(pool, [[[pool.allocate()]]], [1], [2])


@given(configs(), st.integers(1, 4), st.integers(1, 5), st.data())
@settings(max_examples=40)
def test_paged_attention_equals_contiguous_cache(overrides, rows, block_size, data):
    """Rows of different lengths, fed in chunks of random sizes and at different paces, through one
    PagedCache per step give the logits each row gets alone through a KVCache with the same chunks;
    a model mixing sliding and full layers through a block table per layer group; a fused model too."""
    if overrides["sliding_window"] and overrides["n_layers"] == 2 and data.draw(st.booleans()):
        overrides["layer_types"] = ["sliding_attention", "full_attention"]
    model = tiny_model(**overrides)
    if data.draw(st.booleans()):  # as `decoderlm.load` gives it: one-token steps rotate, write and attend in one call
        fuse_projections(model)
    chunks = [data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)) for _ in range(rows)]
    vocab = model.config.vocab_size
    tokens = [torch.randint(0, vocab, (sum(c),), generator=torch.Generator().manual_seed(i)).tolist() for i, c in enumerate(chunks)]
    G = len(layer_groups(model.config))
    pool = BlockPool(model.config, num_blocks=1 + G * sum(-(-sum(c) // block_size) for c in chunks), block_size=block_size)
    random.Random(data.draw(st.integers(0, 99))).shuffle(pool.free)  # tables point anywhere in the pool
    tables: list[list[list[int]]] = [[[] for _ in range(G)] for _ in range(rows)]
    done = [0] * rows
    paged: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    with torch.inference_mode():
        for step in range(max(map(len, chunks))):
            live = [i for i in range(rows) if step < len(chunks[i])]
            for i in live:
                for table in tables[i]:
                    while len(table) * block_size < done[i] + chunks[i][step]:
                        table.append(pool.allocate())
            news = [chunks[i][step] for i in live]
            T = max(news)
            ids = torch.tensor([[0] * (T - n) + tokens[i][done[i] : done[i] + n] for i, n in zip(live, news)])  # left-padded
            cache = PagedCache(pool, [tables[i] for i in live], [done[i] for i in live], news)
            logits = model(ids, cache=cache).logits  # (B, T, V)
            assert cache.lengths == [done[i] + n for i, n in zip(live, news)]
            for row, (i, n) in enumerate(zip(live, news)):
                paged[i].append(logits[row, T - n :])
                done[i] += n
        for i in range(rows):
            kv = KVCache(model.config, 1, sum(chunks[i]))
            start, alone = 0, []
            for n in chunks[i]:
                alone.append(model(torch.tensor([tokens[i][start : start + n]]), cache=kv).logits[0])
                start += n
            torch.testing.assert_close(torch.cat(paged[i]), torch.cat(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler here: SDPA is used")
def test_a_fused_models_paged_decode_step_is_one_call_a_layer_and_the_same_bits(monkeypatch):
    """Rows at different lengths, one token each, over a fused model: `PagedCache.rope_attend_one` (RoPE,
    the write into each row's block and attention in one kernel call a layer) gives the logits and the
    pool that RoPE in torch, `write` and attend_one give, bit for bit."""
    model = fuse_projections(tiny_model(n_kv_heads=2))
    lengths = [5, 12, 3]
    calls = []
    real = kernels.rope_attend_one
    monkeypatch.setattr(kernels, "rope_attend_one", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def step() -> tuple[torch.Tensor, BlockPool]:
        pool = BlockPool(model.config, num_blocks=12, block_size=4)
        random.Random(0).shuffle(pool.free)
        tables = [[[pool.allocate() for _ in range(-(-(n + 1) // 4))]] for n in lengths]
        with torch.inference_mode():
            for i, n in enumerate(lengths):  # each row's context, alone
                model(torch.arange(n)[None] % 7, cache=PagedCache(pool, [tables[i]], [0], [n]))
            ids = torch.tensor([[3], [4], [5]])
            return model(ids, cache=PagedCache(pool, tables, lengths, [1, 1, 1])).logits, pool

    fused, pool = step()
    assert len(calls) == model.config.n_layers
    monkeypatch.delattr(PagedCache, "rope_attend_one")
    apart, apart_pool = step()
    assert len(calls) == model.config.n_layers and torch.equal(fused, apart)
    assert all(torch.equal(a, b) for a, b in zip(pool.k + pool.v, apart_pool.k + apart_pool.v))


def test_layer_groups_cut_each_attention_kind_into_equal_groups():
    sliding, full = "sliding_attention", "full_attention"
    assert layer_groups(tiny_config(n_layers=3)) == [[0, 1, 2]]  # one kind: one group, every block holds all layers
    assert layer_groups(tiny_config(n_layers=4, sliding_window=8)) == [[0, 1, 2, 3]]
    assert layer_groups(tiny_config(n_layers=4, sliding_window=8, layer_types=[sliding, full] * 2)) == [[0, 2], [1, 3]]  # Gemma-2
    gemma3 = tiny_config(n_layers=6, sliding_window=8, layer_types=[sliding] * 5 + [full])
    assert layer_groups(gemma3) == [[0], [1], [2], [3], [4], [5]]
    pool = BlockPool(gemma3, num_blocks=3, block_size=4)
    assert len(pool.k) == 1 and pool.windows == [8] * 5 + [None] and pool.place[5] == (5, 0)
    assert BlockPool.bytes_per_block(gemma3, 4, torch.float32) == BlockPool.bytes_per_token(gemma3, torch.float32) * 4 // 6
