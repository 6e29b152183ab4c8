"""Fused projections change no number and no name: for every HF family case, a model loaded fused
(q/k/v and gate/up stacked) gives the logits of the same model loaded unfused, in fp32 and with int8 /
int4 weights, through a full forward and through KV-cache decoding; its state_dict has the unfused
names, order and values, and load_state_dict / save_hf / load round-trip through them."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import CASES, make_hf_model, prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.formats.hf import save_hf
from decoderlm.generate import decode_step, prefill
from decoderlm.kv_cache import KVCache
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.fuse import fuse_projections, unfuse_projections
from decoderlm.model.norm import RMSNorm
from decoderlm.model.rope import apply_rope_, inverse_frequencies, rope_cos_sin
from decoderlm import kernels
from decoderlm.quantize import BlockLinear, Int4Linear, Int8GroupLinear, Int8Linear, concat, kernel, layout, quantize

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

TOL = 1e-5


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    """An HF folder holding a tiny random model of one family case."""
    path = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, path)
    return path


def logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def decoded(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T - 7, V) of a prefill of 8 tokens, then one decode step per token."""
    cache = KVCache(model.config, ids.shape[0], ids.shape[1])
    with torch.no_grad():
        steps = [prefill(model, ids[:, :8], cache)] + [decode_step(model, ids[:, t], cache) for t in range(8, ids.shape[1])]
    return torch.stack(steps, dim=1).float()


def mlps(layer: nn.Module) -> list[nn.Module]:
    return list(getattr(layer.mlp, "experts", [layer.mlp]))


def fused_layers(model: Transformer) -> list[nn.Module]:
    stacked = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, *(e.gate_up_proj for e in mlps(layer)))]
    return [m for m in stacked if m is not None]


def stackable(model: Transformer) -> int:
    """How many layers fusion makes: one qkv per attention, one gate_up per gated MLP (or expert)."""
    return sum(1 + sum(e.gated for e in mlps(layer)) for layer in model.layers)


def assert_same_state(fused: Transformer, plain: Transformer, packed_int4: bool = True) -> None:
    """Same names in the same order, same values. packed_int4=False: int4 weights were packed stacked, and a
    part's share of the packed bytes is its own packing only at tile boundaries, so they are not compared."""
    a, b = fused.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    int4 = {f"{name}.qweight" for name, m in plain.named_modules() if isinstance(m, Int4Linear)}
    assert all(torch.equal(a[k], b[k]) for k in b if packed_int4 or k not in int4)


@pytest.mark.parametrize("quantize_mode", [None, "int8", "int4"])
def test_fused_model_gives_the_unfused_logits(folder, quantize_mode):
    plain, _ = load(folder, quantize=quantize_mode, fuse=False)
    fused, _ = load(folder, quantize=quantize_mode)
    assert len(fused_layers(fused)) == stackable(fused)
    assert all(layer.self_attn.q_proj is None for layer in fused.layers)
    ids = prompt_ids(14)
    torch.testing.assert_close(logits(fused, ids), logits(plain, ids), atol=TOL, rtol=TOL)
    torch.testing.assert_close(decoded(fused, ids), decoded(plain, ids), atol=TOL, rtol=TOL)
    assert_same_state(fused, plain, packed_int4=False)


def test_int8_layers_fuse_after_quantizing(folder):
    """A model whose layers are already quantized (as a quantized GGUF loads) fuses them as they are."""
    plain, _ = load(folder, quantize="int8", fuse=False)
    unfused = load(folder, quantize="int8", fuse=False)[0]
    parts = [[a.q_proj, a.k_proj, a.v_proj] for a in (layer.self_attn for layer in unfused.layers)]
    parts += [[e.gate_proj, e.up_proj] for layer in unfused.layers for e in mlps(layer) if e.gated]
    # Per-row int8 and blocks stack anywhere; group int8 packed as torch's int4 only where each part but the last fills whole tiles.
    expected = sum(all(isinstance(m, (Int8Linear, BlockLinear)) or m.qweight.shape[0] % layout().tile == 0 for m in p[:-1]) for p in parts)
    fused = fuse_projections(unfused)
    assert len(fused_layers(fused)) == expected
    assert all(isinstance(m, (Int8Linear, Int8GroupLinear, BlockLinear)) for m in fused_layers(fused))
    ids = prompt_ids(14)
    torch.testing.assert_close(logits(fused, ids), logits(plain, ids), atol=TOL, rtol=TOL)
    assert_same_state(fused, plain)


def test_state_dict_loads_into_a_fused_model_by_checkpoint_names(folder, tmp_path):
    fused, tokenizer = load(folder)
    other, _ = load(folder, fuse=False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    fused.load_state_dict(other.state_dict())  # strict: every checkpoint name has its place
    ids = prompt_ids(10)
    torch.testing.assert_close(logits(fused, ids), logits(other, ids), atol=TOL, rtol=TOL)
    save_hf(fused, tokenizer, tmp_path / "saved")  # as `convert` writes a loaded (fused) model
    again, _ = load(tmp_path / "saved")
    torch.testing.assert_close(logits(again, ids), logits(other, ids), atol=TOL, rtol=TOL)


def test_unfused_load_keeps_the_checkpoint_modules(folder):
    """Fine-tuning loads with fuse=False: LoRA finds q_proj, v_proj, ... as modules."""
    model, _ = load(folder, fuse=False)
    attn = model.layers[0].self_attn
    assert attn.qkv_proj is None and isinstance(attn.v_proj, nn.Linear)


def test_unfusing_restores_the_checkpoint_modules(folder):
    """unfuse_projections (LoRA runs it on a loaded model) gives back one Linear per matrix, hooks gone,
    also on a deep copy (DPO's frozen reference)."""
    plain, _ = load(folder, fuse=False)
    fused, _ = load(folder)
    again = unfuse_projections(copy.deepcopy(fused))
    assert [n for n, _ in again.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert_same_state(again, plain)
    assert_same_state(fused, plain)  # the original is still fused, its names still the checkpoint's
    ids = prompt_ids(10)
    torch.testing.assert_close(logits(again, ids), logits(plain, ids), atol=TOL, rtol=TOL)


def tiled_model() -> Transformer:
    """Every stacked part a whole number of packed int4 tiles (64 rows), so int4 layers stack after quantizing."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, head_dim=64, ffn_hidden=128,
                         max_seq_len=32, mlp="swiglu")
    return Transformer(config).eval()


def test_int4_layers_stack_when_their_rows_fill_tiles(monkeypatch):
    """torch's packed int4 layers (where decoderlm's kernels cannot be built)."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = quantize(tiled_model(), "int4")
    fused = fuse_projections(quantize(tiled_model(), "int4"))
    assert all(isinstance(m, Int4Linear) for m in fused_layers(fused)) and len(fused_layers(fused)) == 4
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(fused, ids), logits(plain, ids), atol=TOL, rtol=TOL)
    torch.testing.assert_close(decoded(fused, ids), decoded(plain, ids), atol=TOL, rtol=TOL)
    assert_same_state(fused, plain)


@settings(max_examples=12, deadline=None)
@given(tiles=st.lists(st.integers(1, 3), min_size=0, max_size=2), last=st.integers(1, 8), groups=st.integers(1, 4),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_packed_rows_concatenate(tiles, last, groups, bias, seed):
    """pack(cat) == cat(pack): stacking layers quantized apart equals quantizing the stacked matrix."""
    torch.manual_seed(seed)
    rows = [t * layout().tile for t in tiles] + [16 * last]
    parts = [nn.Linear(32 * groups, n, bias=bias) for n in rows]
    whole = nn.Linear(32 * groups, sum(rows), bias=bias)
    with torch.no_grad():
        whole.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            whole.bias.copy_(torch.cat([p.bias for p in parts]))
    stacked, direct = concat([Int4Linear.from_weight(p.weight, p.bias) for p in parts]), Int4Linear.from_weight(whole.weight, whole.bias)
    assert stacked.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(stacked.state_dict()[k], direct.state_dict()[k]) for k in direct.state_dict())


def test_int4_rows_inside_a_tile_stack_only_when_unpacked():
    """Packed rows (the CPU kernel's tiles) cannot be split inside a tile; one-per-byte rows always stack."""
    parts = [Int4Linear.from_weight(nn.Linear(32, 16).weight), Int4Linear.from_weight(nn.Linear(32, 16).weight)]  # half a tile each
    stacked = concat(parts)
    if kernel("_weight_int4pack_mm_for_cpu", torch.device("cpu")):
        assert stacked is None
    else:
        assert stacked is not None and stacked.qweight.shape[0] == 32


def test_rms_norm_in_bf16_rounds_once():
    """bf16 activations are normed in fp32 and rounded once, as the fp32 computation rounded to bf16."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64).bfloat16())  # weights a bf16 model can hold
    x = torch.randn(3, 5, 64) * 4
    want = norm(x.bfloat16().float()).bfloat16()
    assert torch.equal(norm.bfloat16()(x.bfloat16()), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # full and partial rotary
def test_in_place_rope_equals_the_rotate_half_formula(dtype, rot_dim):
    """The in-place rotation with one roll gives, bit for bit, x·cos + rotate_half(x)·sin in x's dtype."""
    x = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)  # (B, T, H, D)
    positions = torch.tensor([[0, 1, 2, 7, 30], [3, 4, 5, 6, 100]])
    inv_freq = inverse_frequencies(rot_dim, 10000.0, None)
    angles = positions[..., None].float() * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype)[:, :, None], torch.cat((angles, angles), -1).sin().to(dtype)[:, :, None]
    x1, x2, rest = x[..., : rot_dim // 2], x[..., rot_dim // 2 : rot_dim], x[..., rot_dim:]
    want = torch.cat((x[..., :rot_dim] * cos + torch.cat((-x2, x1), -1) * sin, rest), -1)
    got = apply_rope_(x.clone(), *rope_cos_sin(positions, inv_freq, dtype))
    assert torch.equal(got, want)
