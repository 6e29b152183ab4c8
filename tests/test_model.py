"""The Transformer forward: causality, loss shift, logits_to_keep, half-precision padding, learning."""

import pytest
import torch
import torch.nn.functional as F
from conftest import configs, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.model.cache import build_mask


@given(configs(), st.integers(1, 11), st.integers(0, 2**16))
@settings(max_examples=40)
def test_no_position_sees_the_future(cfg, j, seed):
    """Changing token j changes no logit before j (and does change logits at j)."""
    model = tiny_model(seed, **cfg)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 37, (2, 12), generator=gen)
    changed = ids.clone()
    changed[:, j] = (ids[:, j] + 1 + torch.randint(0, 36, (2,), generator=gen)) % 37
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits  # (B, T, V)
    # Not bit-exact: an MoE expert multiplies a different set of rows, so rounding may differ (~1e-8).
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, j], b[:, j])


@given(st.sampled_from([1, 2, 3]), st.integers(0, 2**16))
@settings(max_examples=10)
def test_sliding_window_limits_what_one_layer_sees(window, seed):
    """With one layer, position i depends only on tokens i-window+1 .. i."""
    model = tiny_model(seed, n_layers=1, sliding_window=window)
    ids = torch.randint(0, 37, (1, 10), generator=torch.Generator().manual_seed(seed))
    changed = ids.clone()
    changed[0, 2] = (ids[0, 2] + 1) % 37
    with torch.no_grad():
        a, b = model(ids).logits[0], model(changed).logits[0]  # (T, V)
    assert not torch.allclose(a[2 + window - 1], b[2 + window - 1])  # still inside the window
    assert torch.equal(a[2 + window :], b[2 + window :])  # fallen out of it


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_loss_shifts_labels_and_ignores_minus_100(position):
    model = tiny_model(position=position)
    ids = torch.randint(0, 37, (3, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 4:] = -100
    labels[2, 1] = -100
    out = model(ids, labels=labels)
    logits, targets = out.logits[:, :-1], labels[:, 1:]  # logit at t predicts token t+1
    keep = targets != -100
    manual = F.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(out.loss, manual, atol=1e-6)
    unshifted = F.cross_entropy(out.logits[labels != -100], labels[labels != -100])
    assert not torch.allclose(out.loss, unshifted)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_logits_to_keep_returns_the_last_rows(k):
    model = tiny_model()
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=k).logits
    assert last.shape == (2, k, 37)
    torch.testing.assert_close(last, full[:, -k:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fully_masked_rows_stay_finite(dtype):
    """build_mask + SDPA: a query whose every key is padding gives finite output, not NaN."""
    key_valid = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # (B, L)
    slots = torch.arange(6)[None]
    mask = build_mask(slots, slots, None, dtype, key_valid)  # (B, 1, T, L)
    assert not (mask[0, 0, 0] == 0).any()  # row 0, query 0 may see nothing
    assert mask.isfinite().all()  # no -inf: some SDPA kernels turn an all -inf row into NaN
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen).mul(30).to(dtype) for _ in range(3))  # large scores
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert y.isfinite().all()


HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # logits here are ~0.3; rounding alone moves them ~2e-4 / 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_left_padded_rows_in_half_precision_equal_each_row_alone(dtype, position):
    """Padding changes nothing about a row: its logits equal the row run alone and unpadded, in fp32,
    to within half precision's rounding."""
    exact = tiny_model(position=position, sliding_window=4)
    model = tiny_model(position=position, sliding_window=4).to(dtype)
    ids = torch.randint(1, 37, (2, 8), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[0, :5] = 0  # row 0: five pads, then three real tokens
    with torch.no_grad():
        logits = model(ids, attention_mask=attention_mask).logits.float()  # (B, T, V)
        alone = [exact(ids[:1, 5:]).logits[0], exact(ids[1:]).logits[0]]
    assert logits.isfinite().all()
    torch.testing.assert_close(logits[0, 5:], alone[0], rtol=0, atol=HALF_TOL[dtype])
    torch.testing.assert_close(logits[1], alone[1], rtol=0, atol=HALF_TOL[dtype])


def test_overfits_one_sentence():
    """A small model memorizes a sentence: the training loss goes to nearly zero."""
    text = b"the quick brown fox jumps over the lazy dog"
    ids = torch.tensor([list(text)])  # (1, T) byte ids
    model = tiny_model(vocab_size=128, d_model=64, n_heads=4, ffn_hidden=128).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(300):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_init_rope_restores_fp32_frequencies_after_a_dtype_cast():
    model = tiny_model(position="rope")
    exact = model.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.bfloat16 and not torch.equal(model.inv_freq.float(), exact)
    model.init_rope()
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, exact)
