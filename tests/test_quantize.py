"""Weight-only int8/int4 quantization: exact bounds on the weight error, the packed CPU kernels against
the plain dequantized matmul, and closeness of a quantized model to its fp32 self (real SmolLM2 and
tiny random HF families)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hf_models import make_hf_model, prompt_ids
from torch import nn

from conftest import SHAKESPEARE

from decoderlm import kernels
from decoderlm import quantize as q
from decoderlm.errors import DecoderLMError
from decoderlm.formats.build import TensorByTensor
from decoderlm.formats.gguf import unpack_blocks
from decoderlm.formats.hf import load_hf
from decoderlm.generate import generate
from decoderlm.kv_cache import store_keys_in
from decoderlm.loader import load
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.sampling import SamplingParams

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

LAYERS = {"int8": q.Int8Linear, "int4": q.Int4Linear}


@pytest.fixture(params=[True, False], ids=["kernel", "fallback"])
def use_kernel(request, monkeypatch):
    """Run each test through PyTorch's packed kernels and through the dequantize-per-call fallback (the
    layers used where decoderlm's own kernels, tests/test_kernels.py, cannot be built)."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    if not request.param:
        monkeypatch.setattr(q, "kernel", lambda name, device: False)
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    """The layers used where decoderlm's own kernels cannot be built (torch's packed kernels)."""
    monkeypatch.setattr(kernels, "available", lambda: False)


def int8_weight(layer: q.Int8Linear) -> torch.Tensor:
    return layer.qweight.float() * layer.scale.float()[:, None]


def int4_weight(layer: q.Int4Linear, shape: tuple[int, int]) -> torch.Tensor:
    """The (out, in) weight a layer computes with; for Int8GroupLinear, in counts the repeated input."""
    if not layer.fast:
        return layer.dense_t().T.float()
    eye = torch.eye(shape[1], dtype=torch.bfloat16)  # the kernel applied to the identity reads its weight back
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, q.GROUP, layer.scales_zeros).float().T


def minmax_int4_error(w: torch.Tensor) -> torch.Tensor:
    """Squared error of the plain grid: each group's [min, max] in 15 steps (fp32)."""
    g = w.view(w.shape[0], -1, q.GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    return ((torch.round((g - lo) / step) * step + lo - g) ** 2).sum()


def test_int8_weight_error_is_within_half_a_step(use_kernel):
    torch.manual_seed(0)
    linear = nn.Linear(96, 64, bias=True)
    layer = q.Int8Linear.from_weight(linear.weight.detach(), linear.bias)
    assert layer.fast is use_kernel
    w = linear.weight.detach()
    step = layer.scale.float()[:, None]  # (out, 1), the bf16 scale q was computed against
    assert ((int8_weight(layer) - w).abs() <= step * 0.5 + 1e-7).all()


def test_int4_from_float_is_no_worse_than_the_min_max_grid(use_kernel):
    """The scale search keeps the min/max grid unless a narrower one fits the group better, so the
    squared error is at most the plain grid's (plus bf16 rounding of scale and zero: 2^-8 relative)."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    w[::7, ::13] *= 6  # outliers, where a narrower grid pays
    layer = q.Int4Linear.from_weight(w)
    assert layer.fast is use_kernel
    err = ((int4_weight(layer, (64, 256)) - w) ** 2).sum()
    assert err <= minmax_int4_error(w) * 1.02 + (w.abs() * 2**-8).square().sum() * 4


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_layer_computes_x_times_its_dequantized_weight(mode, use_kernel):
    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=True)
    layer = LAYERS[mode].from_weight(linear.weight.detach(), linear.bias)
    w = int8_weight(layer) if mode == "int8" else int4_weight(layer, (48, 64))
    x = torch.randn(2, 5, 64)  # (B, T, in)
    y = layer(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    expected = x.bfloat16().float() @ w.T + linear.bias.detach()
    assert torch.allclose(y, expected, atol=0.02 * expected.abs().max().item())  # bf16 accumulation/output
    with torch.no_grad():
        assert (y - linear(x)).abs().max() < 0.1 * linear(x).abs().max()


def gguf_blocks(w: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[q.Blocks, torch.Tensor]:
    """(our unpacking of llama.cpp's blocks for w, the gguf package's own dequantization of them)."""
    raw = gguf_quantize(w.numpy(), qtype)
    return unpack_blocks(torch.from_numpy(raw.copy()).flatten(), qtype, tuple(w.shape)), torch.from_numpy(gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("rows", [3, 96], ids=["decode", "prefill"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_layer_from_gguf_blocks_computes_with_the_files_exact_weights(qtype, rows, use_kernel):
    """A layer built from a file's blocks equals F.linear with the exactly dequantized fp32 weight, up to
    bf16: x is given bf16-exact, so what remains is the kernel's rounding of each group's scale and zero
    (2^-9 relative each; Q4_1's zero m + 8d is the group's midpoint, so its rounding is no larger than
    the weights') and of the output (2^-9 relative), the fp32 accumulation being exact enough. Bound:
    2^-8 · (|y| + Σ_k |x_k| · (|w_k| + |zero|)) per output, twice the worst case of those roundings.
    Many rows (a prefill) and the fallback also round each weight to bf16 once: twice the bound."""
    torch.manual_seed(2)
    w = torch.randn(48, 128) * 0.05 + 0.01
    blocks, exact = gguf_blocks(w, qtype)
    assert torch.equal(blocks.dequantize(), exact)  # our unpacking reads the file's values bit for bit
    layer = q.quantized_linear(blocks, "int4")
    assert isinstance(layer, q.Int8GroupLinear if qtype == GGMLQuantizationType.Q8_0 else q.Int4Linear)
    assert (rows >= q.DENSE_TOKENS) == (rows == 96)
    x = torch.randn(rows, 128).bfloat16().float()  # (N, in), exact in bf16
    y, ref = layer(x), F.linear(x, exact)
    zero = 8 * blocks.d.abs().repeat_interleave(q.GROUP, 1) if blocks.m is None else (blocks.m + 8 * blocks.d).abs().repeat_interleave(q.GROUP, 1)
    bound = 2**-8 * (ref.abs() + x.abs() @ (exact.abs() + zero).T)
    slack = 2 if use_kernel and rows < q.DENSE_TOKENS else 4
    assert ((y - ref).abs() <= slack * bound / 2 + 1e-7).all(), ((y - ref).abs() / bound).max()


@pytest.mark.parametrize("out", [16, 64, 80, 208])  # a partial tile alone, whole tiles, and both
def test_dense_weight_is_the_exact_weight_rounded_once(out, use_kernel):
    """What a prefill multiplies by: each weight computed exactly (fp32) from the layer's own values and
    bf16 scales, then rounded to bf16 once, whatever tiles the kernel packed the rows into."""
    torch.manual_seed(5)
    values = torch.randint(0, 16, (out, 128))
    scale, zero = torch.rand(out, 4) * 0.1, torch.randn(out, 4) * 0.05  # (out, in/32)
    int4 = q.Int4Linear(values, scale, zero)
    s, z = (t.bfloat16().float().repeat_interleave(q.GROUP, 1) for t in (scale, zero))
    assert torch.equal(int4.dense_t(), ((values - 8) * s + z).T.bfloat16())
    blocks = q.q8_blocks(torch.randn(out, 128) * torch.logspace(-3, 0, 4).repeat_interleave(q.GROUP))
    d = blocks.d.bfloat16().float().repeat_interleave(q.GROUP, 1)
    assert torch.equal(q.Int8GroupLinear(blocks).dense_t(), (blocks.q * d).T.bfloat16())
    assert torch.equal(int4.dense_t(torch.float32), ((values - 8) * s + z).T)  # fp32: not rounded at all
    assert torch.equal(q.Int8GroupLinear(blocks).dense_t(torch.float32), (blocks.q * d).T)


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("kind", ["int4", "q8"])
def test_prefill_rows_run_dense_and_decode_rows_the_kernel(kind, monkeypatch):
    """From DENSE_TOKENS input rows on a layer multiplies by its dense weight, below that by the packed
    kernel (decoding, the server's batched steps); both give the same outputs up to bf16: the dense
    weight's rounding (2^-9 · Σ_k |x_k w_k|) and each output's (2^-9 · |y| twice). Bound: twice that."""
    torch.manual_seed(6)
    w = torch.randn(192, 576) * 0.05
    layer = q.quantized_linear(w, kind)
    calls, dense_t = [], type(layer).dense_t
    monkeypatch.setattr(type(layer), "dense_t", lambda self, dtype=q.COMPUTE: calls.append(1) or dense_t(self, dtype))
    x = torch.randn(q.DENSE_TOKENS, 576)
    y = layer(x)
    assert len(calls) == 1
    kernel = torch.cat([layer(row) for row in x.split(q.DENSE_TOKENS - 1)])
    assert len(calls) == 1
    assert ((y - kernel).abs() <= 2**-7 * (y.abs() + x.abs() @ w.abs().T)).all()


def test_q8_head_is_exact_where_per_row_int8_is_not():
    """Q8_0 rows whose blocks have different scales: the int4-kernel layer keeps them (to bf16), a
    per-row int8 layer cannot."""
    torch.manual_seed(3)
    w = torch.randn(32, 256) * torch.logspace(-2, 0, 8).repeat_interleave(32)  # blocks 100x apart
    blocks, exact = gguf_blocks(w, GGMLQuantizationType.Q8_0)
    x = torch.randn(4, 256).bfloat16().float()
    ref = F.linear(x, exact)
    grouped = (q.Int8GroupLinear(blocks)(x) - ref).norm() / ref.norm()
    per_row = (q.Int8Linear.from_weight(blocks)(x) - ref).norm() / ref.norm()
    assert grouped < 3e-3 and per_row > 3 * grouped, (grouped, per_row)


def test_int8_embedding_reads_q8_rows_exactly():
    torch.manual_seed(4)
    w = torch.randn(40, 64)
    blocks, exact = gguf_blocks(w, GGMLQuantizationType.Q8_0)
    ids = torch.tensor([[0, 39, 7], [7, 7, 1]])
    assert torch.equal(q.Int8Embedding(blocks, torch.float32)(ids), exact[ids])
    from_float = q.Int8Embedding(w, torch.float32)  # Q8_0's rule on float rows, with fp32 scales
    step = from_float.scales.repeat_interleave(q.GROUP, 1)[ids]  # (B, T, D)
    assert ((from_float(ids) - w[ids]).abs() <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("vocab", [192, 80, 208])  # whole tiles of 64 (and 32), a partial tile, both
def test_tied_embedding_reads_its_rows_from_the_head(vocab, use_kernel):
    """Tied to a Q8 head, the embedding gives the same rows as alone and keeps no int8 values or scales of
    its own, whatever tiles this CPU level packs the head's rows in."""
    torch.manual_seed(7)
    blocks = q.q8_blocks(torch.randn(vocab, 128))
    head = q.quantized_linear(blocks, q.layer_mode("lm_head", "int4"))
    alone, tied = q.Int8Embedding(blocks, torch.float32), q.Int8Embedding(blocks, torch.float32, head)
    ids = torch.tensor([[0, 31, 32, 63], [64, 79, vocab - 2, vocab - 1]])
    assert torch.equal(tied(ids), alone(ids)) and torch.equal(alone(ids), blocks.dequantize()[ids])
    assert tied.qweight is None and tied.scales is None


@pytest.mark.usefixtures("torch_path")
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



@pytest.mark.parametrize("case", ["qwen2-bias-tied", "mixtral"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_a_model_and_loading_it_tensor_by_tensor_make_the_same_layers(tmp_path, case, mode):
    """One rule (`quantize.quantized_layers`) decides what each weight becomes, whether a whole model is quantized or a
    file's tensors arrive one at a time: the same layer everywhere (the tied LM head shared by the embedding, the MoE
    router kept float) and the same logits."""
    make_hf_model(case, tmp_path)
    whole, _ = load_hf(tmp_path, torch.float32)
    fill = TensorByTensor(whole.config, torch.float32, "cpu", mode)
    for name, value in sorted(whole.named_parameters(), key=lambda item: not item[0].endswith(".bias")):  # biases first, as GGUF files order them
        fill.put(name, value.detach())
    one_by_one, missing = fill.finish()
    q.quantize(whole, mode)
    assert not missing
    assert {n: type(m) for n, m in one_by_one.named_modules()} == {n: type(m) for n, m in whole.named_modules()}
    shared = [model.embed_tokens.tied == (model.lm_head,) for model in (whole, one_by_one)]
    assert shared[0] == shared[1]
    with torch.no_grad():
        assert torch.equal(one_by_one(prompt_ids(24)).logits, whole(prompt_ids(24)).logits)

@pytest.fixture(scope="module")
def smollm2_reference():
    """fp32 SmolLM2 (the exact dequantization of its Q4_1 file) and its logits over 512 tokens of real
    text: tiny Shakespeare, where issue 10 measured llama.cpp, or without it a fixed excerpt of this repo's
    README (tests/fixtures/prose.txt, frozen so that editing the README cannot move the test)."""
    model, tok = load(locate(DEFAULT_MODEL))
    text = SHAKESPEARE if SHAKESPEARE.exists() else Path(__file__).resolve().parent / "fixtures" / "prose.txt"
    ids = tok.encode(text.read_text()[:20000])[:513]
    assert len(ids) == 513
    seq = torch.tensor([ids])
    with torch.no_grad():
        logits = model(seq[:, :-1]).logits[0]
    return model, tok, seq, logits


@pytest.mark.heavy  # 512 tokens through the unvectorized kernels take minutes at the plain CPU level
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_smollm2_is_as_faithful_as_llama_cpp(smollm2_reference, mode, monkeypatch):
    """Loaded straight from the GGUF's blocks and teacher-forced over 512 tokens: perplexity within
    +0.64 % of fp32 and ≥ 95.1 % of next-token argmaxes agreeing, llama.cpp's own figures on the same
    Q4_1 weights (issue 10), through decoderlm's kernels and, where they cannot be built, torch's: the
    latter both through the dense prefill path (512 rows) and through the packed kernel that decoding
    uses, which agree with each other at least as well (their weights differ by bf16 rounding).
    decoderlm's kernels in int4 compute with the file's own weights: with fp32 prompts, as the float path
    does, their logits are its own up to the order of the sums (< 1e-3) and every argmax agrees; with
    int16 prompts (`auto` on AVX512-VNNI) within 0.05 and ≥ 99 % of the argmaxes agreeing; in
    int8 they compute with the Q4_1 weights rounded again to Q8_0's grid (a second rounding: within 1 %,
    `--quantize auto`'s bound; measured +0.68 %, 98.6 % agreeing). Those bounds on the logits are the weights'
    and activations' arithmetic alone, with keys and values kept exact; rounded to fp16 as the default keeps
    them, the perplexity and argmax bounds still hold. The greedy reply starts like fp32's."""
    model, tok, seq, ref = smollm2_reference
    targets = seq[0, 1:]

    def check(out: torch.Tensor, path: str, bound: float = 0.0064) -> float:
        ppl_change = torch.exp(F.cross_entropy(out, targets) - F.cross_entropy(ref, targets)).item() - 1
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert ppl_change <= bound and agree >= 0.951, (mode, path, ppl_change, agree)
        return agree

    if kernels.available():
        quant, _ = load(locate(DEFAULT_MODEL), quantize=mode, kv_cache="fp32")
        assert isinstance(quant.lm_head, q.BlockLinear) and isinstance(quant.embed_tokens, q.Int8Embedding)
        for prompts, tolerance in (("fp32", 1e-3), ("int16", 0.05)):  # what `auto` reads prompts with, by CPU
            for layer in (m for m in quant.modules() if isinstance(m, q.BlockLinear)):
                monkeypatch.setattr(layer, "prompt_activations", prompts)
            with torch.no_grad():
                out = quant(seq[:, :-1]).logits[0]
            if check(out, f"blocks, {prompts} prompts", 0.0064 if mode == "int4" else 0.01) and mode == "int4":
                assert (out - ref).abs().max() < tolerance, prompts
                assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= (1 if prompts == "fp32" else 0.99), prompts
        store_keys_in(quant, torch.float16)
        with torch.no_grad():
            check(quant(seq[:, :-1]).logits[0], "blocks, keys in fp16", 0.0064 if mode == "int4" else 0.01)
    monkeypatch.setattr(kernels, "available", lambda: False)
    quant, _ = load(locate(DEFAULT_MODEL), quantize=mode)
    assert isinstance(quant.lm_head, q.Int8GroupLinear) and isinstance(quant.embed_tokens, q.Int8Embedding)
    paths = {}
    for path, rows in (("dense", None), ("kernel", 10**9)):
        if rows:
            monkeypatch.setattr(q, "DENSE_TOKENS", rows)
        with torch.no_grad():
            paths[path] = quant(seq[:, :-1]).logits[0]
        check(paths[path], path, 0.0064 if mode == "int4" else 0.01)  # int8: the 1 % rule (+0.641 % on Shakespeare on an Intel AVX-512 CPU)
    agree = (paths["dense"].argmax(-1) == paths["kernel"].argmax(-1)).float().mean().item()
    assert agree >= 0.951, (mode, agree)
    monkeypatch.undo()
    quant, _ = load(locate(DEFAULT_MODEL), quantize=mode)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert generate(quant, ids, params) == generate(model, ids, params), mode


def test_cli_generate_with_quantize(tmp_path, capsys):
    from decoderlm.cli import main

    make_hf_model("llama", tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "The quick", "--quantize", "int4",
                 "--temperature", "0", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--quantize", "int3"]) == 2


@pytest.mark.parametrize("kind", ["q8-blocks", "q4-blocks", "per-row"])
@pytest.mark.parametrize("rows", [1, 5, q.DENSE_TOKENS], ids=["decode", "batch", "prefill"])
def test_lm_head_logits_are_fp32_and_its_best_are_exact(kind, rows, use_kernel):
    """The LM head's logits are fp32, not the kernel's bf16: each row's best candidates equal the fp32
    product of the fp32 input and the file's exact weight (its fp16 scales too, which bf16 would round);
    the rest stay within bf16 of it. A per-row int8 head has no file weight: its own rows are the reference."""
    torch.manual_seed(8)
    V, D = 208 if kind != "per-row" else 200, 96  # 200 rows do not fit the int4 layout: per-row int8
    w = torch.randn(V, D) * torch.logspace(-2, 0, D // q.GROUP).repeat_interleave(q.GROUP)
    blocks = {"q8-blocks": gguf_blocks(w, GGMLQuantizationType.Q8_0)[0], "q4-blocks": gguf_blocks(w, GGMLQuantizationType.Q4_1)[0], "per-row": w}[kind]
    head = q.quantized_linear(blocks, q.layer_mode("lm_head", "int4"))
    assert head.exact and type(head) is {"q8-blocks": q.Int8GroupLinear, "q4-blocks": q.Int4Linear, "per-row": q.Int8Linear}[kind]
    x = torch.randn(1, rows, D) * 3  # fp32, not bf16-exact
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (1, rows, V)
    weight = head.weight_rows(torch.arange(V)) if kind == "per-row" else blocks.dequantize()  # (V, D)
    exact = x[0] @ weight.T  # (rows, V)
    top = exact.topk(q.EXACT_TOP // 2).indices  # surely among the bf16 scores' best EXACT_TOP
    torch.testing.assert_close(logits[0].gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert not torch.equal(logits[0], exact.bfloat16().float())  # not merely rounded exact values
    assert ((logits[0] - exact).abs() <= 2**-7 * (exact.abs() + x[0].abs() @ weight.abs().T)).all()


def test_weight_rows_read_every_tile_exactly(use_kernel):
    """weight_rows(ids) reads any rows (whole tiles, the partial tile, any order) as the layer computes them."""
    torch.manual_seed(9)
    w = torch.randn(208, 64)
    for layer in (q.Int4Linear.from_weight(w), q.Int8GroupLinear(q.q8_blocks(w))):
        ids = torch.tensor([[207, 0, 63], [64, 95, 192]])
        assert torch.equal(layer.weight_rows(ids), layer.dense_t(torch.float32).T[ids])


def test_smollm2_capital_of_france_has_no_bf16_tie():
    """The default mode on the real model, on the prompt whose first token is a near-tie in float32
    ("The" -1.883 vs "L" -1.965): with bf16 logits both rounded to 25.375 on AVX2 and greedy said
    "L'Étoile...". fp32 logits keep them apart and the answer is Paris, at every CPU level. (With int8
    activations in the prompt too, as llama.cpp computes, "L" leads by 0.1: auto reads prompts in fp32.)"""
    model, tok = load(locate(DEFAULT_MODEL), quantize="auto")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    with torch.no_grad(), q.reading_prompt():  # as generate reads a prompt
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert logits.dtype == torch.float32
    the, l_ = tok.encode("The")[0], tok.encode("L")[0]
    assert logits[the] - logits[l_] > 0.05, (logits[the].item(), logits[l_].item())
    reply = tok.decode(generate(model, ids, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=tok.eos_token_ids)))
    assert reply == "The capital of France is Paris.", reply
