"""`--quantize auto`, the default of chat / generate / serve: a quantized GGUF runs on its own blocks
(Q4_0/Q4_1 as int4, Q8_0 and K-quants as int8), a float model stays float, and so does every model on
an x86 CPU below AVX2, whose packed kernels are scalar; `--quantize none` is the float reference path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli
from gguf import GGMLQuantizationType as Q
from hf_models import make_hf_model
from test_gguf import hf_model, tokenizer_meta, write_model
from torch import nn

from decoderlm import isa, kernels
from decoderlm.cli import build_parser
from decoderlm.cli.common import load_model
from decoderlm.errors import DecoderLMError
from decoderlm.formats.gguf import native_mode
from decoderlm.generate import generate
from decoderlm.kv_cache import cache_dtype
from decoderlm.loader import load
from decoderlm.quantize import BlockLinear, Int4Linear, Int8GroupLinear, kernels_vectorized
from decoderlm.sampling import SamplingParams

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

CPU = torch.device("cpu")
PACKED = kernels_vectorized()  # False at the plain x86-64 level without decoderlm's kernels: auto is float there
FOUR, EIGHT = (BlockLinear, BlockLinear) if kernels.available() else (Int4Linear, Int8GroupLinear)


def linear_kinds(model: nn.Module) -> set[type]:
    """The classes of the model's layer matrices (attention and MLP; the LM head is 8-bit in every mode)."""
    return {type(m) for name, m in model.named_modules() if name.endswith("_proj")}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    _, vocab = tokenizer_meta()
    model = hf_model("llama", vocab)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16):
        write_model(root / f"{qtype.name}.gguf", "llama", model, qtype)
    return root


@pytest.mark.parametrize("qtype,mode,kind", [(Q.Q4_0, "int4", FOUR), (Q.Q4_1, "int4", FOUR),
                                             (Q.Q8_0, "int8", EIGHT), (Q.F16, None, nn.Linear)])
def test_auto_keeps_the_files_own_precision(gguf_files, qtype, mode, kind):
    path = gguf_files / f"{qtype.name}.gguf"
    if not PACKED:
        mode, kind = None, nn.Linear
    auto, _ = load(path, quantize="auto")
    explicit, _ = load(path, quantize=mode)
    assert linear_kinds(auto) == {kind}
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, explicit(ids).logits)


def tensor(name: str, qtype: Q, shape: tuple[int, ...]) -> SimpleNamespace:
    n = 1
    for s in shape:
        n *= s
    return SimpleNamespace(name=name, tensor_type=qtype, shape=shape, n_elements=n)


def test_packed_kernels_count_as_vectorized_except_torchs_on_plain_x86():
    """decoderlm's kernels are vectorized at every level (SSE4.1 at the plain one); torch's are not there."""
    assert kernels_vectorized() == (kernels.available() or not isa.X86 or isa.current() != "default")


def test_native_mode_follows_the_layers_bulk(monkeypatch):
    import decoderlm.formats.gguf as gguf_module

    monkeypatch.setattr(gguf_module, "kernels_vectorized", lambda: True)  # as on AVX2 and above
    mixed = [tensor("token_embd.weight", Q.Q8_0, (576, 49152)), tensor("blk.0.attn_q.weight", Q.Q4_1, (576, 576)),
             tensor("blk.0.ffn_down.weight", Q.Q6_K, (1536, 576)), tensor("blk.0.ffn_up.weight", Q.Q4_1, (576, 1536)),
             tensor("blk.0.attn_norm.weight", Q.F32, (576,))]
    assert native_mode(mixed, CPU) == "int4"  # the big embedding and one Q6_K matrix do not outvote the Q4_1 bulk
    assert native_mode([tensor("blk.0.ffn_up.weight", Q.Q4_K, (256, 512))], CPU) == "int8"  # K-quants: Q8_0's grid
    assert native_mode([tensor("blk.0.ffn_up.weight", Q.Q6_K, (256, 512))], CPU) == "int8"
    assert native_mode([tensor("blk.0.ffn_up.weight", Q.BF16, (256, 512))], CPU) is None
    assert native_mode(mixed, torch.device("cuda")) is None  # the packed kernels are CPU kernels


def test_auto_is_float_on_plain_x86(monkeypatch):
    """At ATen's plain level torch's int4 kernel is scalar (the embedded model decodes ~1 token/s with it
    here against fp32's ~14), so auto keeps every file float there."""
    import decoderlm.formats.gguf as gguf_module

    monkeypatch.setattr(gguf_module, "kernels_vectorized", lambda: False)
    assert native_mode([tensor("blk.0.ffn_up.weight", Q.Q4_1, (256, 512))], CPU) is None


def test_none_is_the_float_path(gguf_files):
    none, _ = load(gguf_files / "Q4_1.gguf", quantize="none")  # the CLI's spelling, as the benchmarks pass it
    plain, _ = load(gguf_files / "Q4_1.gguf")
    assert linear_kinds(none) == {nn.Linear}
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(none(ids).logits, plain(ids).logits)


def test_auto_leaves_float_checkpoints_float(tmp_path):
    make_hf_model("llama", tmp_path / "hf")
    model, _ = load(tmp_path / "hf", quantize="auto")
    assert linear_kinds(model) == {nn.Linear}


def test_bad_quantize_value_is_one_line_error(gguf_files):
    with pytest.raises(Exception, match="quantize 'int3' is not supported; use one of int8, int4, auto, none"):
        load(gguf_files / "Q4_1.gguf", quantize="int3")


def test_cli_default_is_auto_and_none_is_float(gguf_files, capsys):
    path = str(gguf_files / "Q4_1.gguf")
    outs = {}
    for flags in ([], ["--quantize", "auto"], ["--quantize", "int4"], ["--quantize", "none"]):
        code, out, err = run_cli(["generate", "--model", path, "--prompt", "abc", "--temperature", "0",
                                  "--max-new-tokens", "12", *flags], capsys)
        assert code == 0, err
        outs[" ".join(flags)] = out
    assert outs[""] == outs["--quantize auto"] == outs["--quantize int4" if PACKED else "--quantize none"]
    float_model, tok = load(path)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=tok.eos_token_ids)
    assert outs["--quantize none"] == "abc" + tok.decode(generate(float_model, tok.encode("abc"), params)) + "\n"


def test_kv_cache_auto_is_fp16_for_quantized_weights_only(gguf_files):
    """`kv_cache="auto"` (--kv-cache's default): keys and values in fp16 where the weights are quantized (as
    llama.cpp keeps its cache), in the model's dtype where they are float; fp16 and fp32 as asked; another
    value is a one-line error."""
    path = gguf_files / "Q4_1.gguf"
    assert cache_dtype(load(path, quantize="auto")[0]) == (torch.float16 if PACKED else torch.float32)
    assert cache_dtype(load(path, quantize="none")[0]) == torch.float32
    assert cache_dtype(load(path, quantize="none", kv_cache="fp16")[0]) == torch.float16
    assert cache_dtype(load(path, quantize="int4", kv_cache="fp32")[0]) == torch.float32
    with pytest.raises(DecoderLMError, match="^kv_cache 'int8' is not supported; use one of auto, fp16, fp32$"):
        load(path, kv_cache="int8")


def test_cli_kv_cache_flag_reaches_the_model(gguf_files, capsys):
    path = str(gguf_files / "Q4_1.gguf")
    for flags, kv in (([], torch.float16 if PACKED else torch.float32), (["--kv-cache", "fp32"], torch.float32),
                      (["--quantize", "none", "--kv-cache", "fp16"], torch.float16)):
        model, _ = load_model(build_parser().parse_args(["generate", "--model", path, "--prompt", "abc", *flags]))
        assert cache_dtype(model) == kv, flags
    code, _, err = run_cli(["generate", "--model", path, "--prompt", "abc", "--kv-cache", "bf16"], capsys)
    assert code == 2 and "--kv-cache: invalid choice: 'bf16'" in err
