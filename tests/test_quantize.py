"""Weight-only int8/int4 quantization: exact bounds on the weight error, the packed CPU kernels against
the plain dequantized matmul, and closeness of a quantized model to its fp32 self (real SmolLM2 and
tiny random HF families)."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_hf_model, prompt_ids
from torch import nn

from decoderlm import quantize as q
from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import load_hf
from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.sampling import SamplingParams

LAYERS = {"int8": q.Int8Linear, "int4": q.Int4Linear}


@pytest.fixture(params=[True, False], ids=["kernel", "fallback"])
def use_kernel(request, monkeypatch):
    """Run each test through PyTorch's packed kernels and through the dequantize-per-call fallback."""
    if not request.param:
        monkeypatch.setattr(q, "kernel", lambda name, device: False)
    return request.param


def int8_weight(layer: q.Int8Linear) -> torch.Tensor:
    return layer.qweight.float() * layer.scale.float()[:, None]


def int4_weight(layer: q.Int4Linear, shape: tuple[int, int]) -> torch.Tensor:
    if not layer.fast:
        return layer.dequantize().float()
    eye = torch.eye(shape[1], dtype=torch.bfloat16)  # the kernel applied to the identity reads its weight back
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, q.GROUP, layer.scales_zeros).float().T


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_error_is_within_half_a_step(mode, use_kernel):
    torch.manual_seed(0)
    linear = nn.Linear(96, 64, bias=True)
    layer = LAYERS[mode](linear)
    assert layer.fast is use_kernel
    w = linear.weight.detach()
    if mode == "int8":
        step = w.abs().amax(1, keepdim=True) / 127  # (out, 1)
        err = (int8_weight(layer) - w).abs()
    else:
        groups = w.view(64, -1, q.GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(q.GROUP, 1)  # (out, in)
        err = (int4_weight(layer, (64, 96)) - w).abs()
    # half a quantization step, plus bf16 rounding of the scale (and zero point): 2^-8 relative
    assert (err <= step * (0.5 + 8 * 2**-8) + w.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_layer_computes_x_times_its_dequantized_weight(mode, use_kernel):
    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=True)
    layer = LAYERS[mode](linear)
    w = int8_weight(layer) if mode == "int8" else int4_weight(layer, (48, 64))
    x = torch.randn(2, 5, 64)  # (B, T, in)
    y = layer(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    expected = x.bfloat16().float() @ w.T + linear.bias.detach()
    assert torch.allclose(y, expected, atol=0.02 * expected.abs().max().item())  # bf16 accumulation/output
    with torch.no_grad():
        assert (y - linear(x)).abs().max() < 0.1 * linear(x).abs().max()


def test_int4_keeps_int8_for_shapes_it_cannot_pack():
    model = nn.Module()
    model.a, model.b, model.c = nn.Linear(64, 48), nn.Linear(40, 48), nn.Linear(64, 40)
    q.quantize(model, "int4")
    assert isinstance(model.a, q.Int4Linear) and isinstance(model.b, q.Int8Linear) and isinstance(model.c, q.Int8Linear)


def test_unknown_mode_is_a_user_error():
    with pytest.raises(DecoderLMError, match="int8, int4"):
        q.quantize(nn.Linear(4, 4), "int3")


@pytest.mark.parametrize("case", ["llama", "qwen2-bias-tied", "mixtral", "gpt2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_tiny_families_stay_close_to_fp32(tmp_path, case, mode):
    make_hf_model(case, tmp_path)
    model, _ = load_hf(tmp_path, torch.float32)
    ids = prompt_ids(24)
    with torch.no_grad():
        ref = model(ids).logits
        q.quantize(model, mode)
        out = model(ids).logits
    assert not any(isinstance(m, nn.Linear) for name, m in model.named_modules() if not name.endswith("mlp.gate"))
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert all(isinstance(m, nn.Linear) for m in routers) and (case != "mixtral" or routers)  # the MoE router stays exact
    # Random weights: int4 noise is ~10% of a weight's spread per matmul (15 levels over ~5σ), int8's
    # ~16x less; two layers and the head stack ~5 matmuls, so ~√5·10% ≈ 22% for int4. Bounds: twice that.
    rel = (out - ref).norm() / ref.norm()
    assert rel < (0.03 if mode == "int8" else 0.45), rel


@pytest.fixture(scope="module")
def smollm2():
    return load(locate(DEFAULT_MODEL))


def test_quantized_smollm2_logits_and_greedy_reply(smollm2):
    """Stated tolerances: int8 logits within 8% (relative L2) of fp32 and ≥ 95% of next-token argmaxes
    agree; int4 within 15% and ≥ 85% (its groups of 32 match the file's Q4_1 blocks, so re-quantizing
    loses little; int8's one scale per row loses more). The greedy reply starts like fp32's."""
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]))
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    with torch.no_grad():
        reply = generate(model, ids, params)
        seq = torch.tensor([ids + reply])
        ref = model(seq).logits[0]
    for mode, rel_tol, agree_tol in (("int8", 0.08, 0.95), ("int4", 0.15, 0.85)):
        quant = Transformer(model.config).eval()
        quant.load_state_dict(model.state_dict())
        q.quantize(quant, mode)
        with torch.no_grad():
            out = quant(seq).logits[0]
        rel = ((out - ref).norm() / ref.norm()).item()
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert rel < rel_tol and agree >= agree_tol, (mode, rel, agree)
        assert generate(quant, ids, params)[:3] == reply[:3], mode


def test_cli_generate_with_quantize(tmp_path, capsys):
    from decoderlm.cli import main

    make_hf_model("llama", tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "The quick", "--quantize", "int4",
                 "--temperature", "0", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--quantize", "int3"]) == 2
