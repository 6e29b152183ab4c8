"""`decoderlm explain`: mask pictures, attention weights of a real model, the masked-softmax demo, parameter charts."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import torch
from conftest import run_cli

from decoderlm.config import ModelConfig
from decoderlm.inspect.explain import attention_weights, mask_matrices, softmax_rows
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import checkpoint

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"



def assert_png(path: Path, min_width: int) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)  # (H, W, 4)
    assert image.shape[1] >= min_width and image.std() > 0.05  # a picture, not a blank canvas


def test_mask_matrices_match_their_definitions():
    masks = list(mask_matrices(6, prefix=3, window=2).values())
    full, causal, prefix, sliding = masks
    q, k = torch.arange(6)[:, None], torch.arange(6)[None, :]
    assert full.all()
    assert torch.equal(causal, k <= q)
    assert torch.equal(prefix, (k <= q) | (k < 3))
    assert torch.equal(sliding, (k <= q) & (q - k < 2))


def test_masks_png(tmp_path, capsys):
    out = tmp_path / "masks.png"
    code, stdout, _ = run_cli(["explain", "masks", "--text", "the cat sat on the mat", "--window", "3", "--out", str(out)], capsys)
    assert code == 0 and str(out) in stdout
    assert_png(out, min_width=1000)


@pytest.mark.parametrize("overrides", [
    dict(),  # GQA, RoPE, RMSNorm
    dict(qk_norm=True, sliding_window=5, n_kv_heads=1),  # the window makes the model pass an explicit mask
    dict(norm="layernorm", position="learned", mlp="gelu", n_kv_heads=8, attn_bias=True),
])
def test_attention_weights_reproduce_the_layer_output(overrides):
    """weights @ V through o_proj must give exactly what the attention layer returned in the forward pass."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("llama-tiny", n_layers=2, vocab_size=100, **overrides)).eval()
    ids = torch.randint(100, (1, 12))
    attn = model.layers[1].self_attn
    seen = {}
    handle = attn.register_forward_hook(lambda module, args, output: seen.update(x=args[0], out=output))
    weights = attention_weights(model, ids, layer=1)  # (1, H, T, T)
    handle.remove()
    B, T, _ = seen["x"].shape
    assert weights.shape == (1, attn.n_heads, T, T)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, attn.n_heads, T))
    assert weights.triu(1).abs().max() == 0  # causal
    with torch.inference_mode():
        v = attn.v_proj(seen["x"]).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # (B, H, T, D)
        rebuilt = attn.o_proj((weights @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(rebuilt, seen["out"], atol=1e-5, rtol=1e-5)
    if window := model.config.sliding_window:
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        assert weights[..., q - k >= window].abs().max() == 0


def test_attention_png_of_a_trained_run(tmp_path, capsys):
    text = "the cat sat on the mat"
    tok = CharTokenizer.from_text(text)
    config = ModelConfig.from_preset("llama-tiny", n_layers=2, vocab_size=tok.vocab_size)
    checkpoint.save(tmp_path, {"model": Transformer(config).state_dict(), "config": config.to_dict(), "tokenizer": tok.to_dict(), "step": 0})
    out = tmp_path / "attention.png"
    code, _, _ = run_cli(["explain", "attention", "--model", str(tmp_path), "--prompt", text, "--layer", "-1", "--out", str(out)], capsys)
    assert code == 0
    assert_png(out, min_width=1200)
    code, _, err = run_cli(["explain", "attention", "--model", str(tmp_path), "--prompt", text, "--layer", "7", "--out", str(out)], capsys)
    assert code == 2 and "out of range" in err and err.count("\n") == 1


def test_softmax_demo(capsys):
    rows = softmax_rows()
    expected = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    for name in ("future masked with -inf", "future masked with finfo.min"):
        torch.testing.assert_close(rows[name], torch.cat([expected, torch.zeros(2)]))
    assert rows["fp16, whole row -inf"].isnan().all()
    assert torch.equal(rows["fp16, whole row finfo.min"], torch.full((4,), 0.25, dtype=torch.float16))
    assert rows["fp16, scores + finfo.min"].isinf().any()  # no headroom below finfo.min
    code, out, _ = run_cli(["explain", "softmax"], capsys)
    assert code == 0 and "nan" in out and "0.25, 0.25, 0.25, 0.25" in out and "finfo.min" in out


def test_params_png(tmp_path, capsys):
    out = tmp_path / "params.png"
    sources = [str(CONFIGS / f"{n}.json") for n in ("llama-3.1-8b", "gpt2", "mixtral-8x7b-v0.1")] + ["llama-tiny"]
    code, _, _ = run_cli(["explain", "params", *sources, "--out", str(out)], capsys)
    assert code == 0
    assert_png(out, min_width=800)
    code, _, err = run_cli(["explain", "params", "missing.json", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
