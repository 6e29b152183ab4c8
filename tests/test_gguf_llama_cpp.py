"""The external oracle: llama.cpp's own convert_hf_to_gguf.py turns tiny random HF checkpoints of the
newer families into GGUF (arch gemma2, gemma3, gpt-oss, qwen3moe, deepseek2), llama.cpp
(llama-cpp-python) runs them greedily, and decoderlm on that GGUF gives llama.cpp's tokens and its own
logits on the HF folder; and files llama.cpp quantizes from those (MXFP4, Q5_0, Q5_1, IQ4_NL) give
llama.cpp's greedy tokens too, loaded as float and with --quantize auto.

The converter comes from a llama.cpp source tree: $DECODERLM_LLAMA_CPP_TREE, else the tree inside an
unpacked llama-cpp-python source release in a few default places (`pip download llama-cpp-python
--no-deps --no-binary :all:` and untar it). Without one, or without llama-cpp-python, the tests skip
and say which is missing. Nothing is downloaded.

The cases differ from tests/hf_models.py where llama.cpp cannot express the HF config (so the two
would rightly disagree): Gemma's query_pre_attn_scalar is head_dim (llama.cpp ignores it), Gemma-3
keeps its default 5:1 layer pattern (the converter does not write sliding_window_pattern) and a
vocabulary the size of its tokenizer (the converter cuts the embedding to it), Qwen3-MoE renormalizes
its chosen experts (llama.cpp always does), gpt-oss's YaRN rounds its blended range (truncate, as
llama.cpp does), DeepSeek-V2 has a q latent (llama.cpp reads V2 without one only for V2-Lite's
27 layers) and both say their router's scoring_func (the converter writes the gating from it).
DeepSeek-V2's group-limited routing is left out: llama.cpp ranks expert groups by their best two
scores' sum (V3's rule) for V2 too, where transformers (and decoderlm) rank V2's by the best score.
"""

from __future__ import annotations

import os
import subprocess
import sys
from glob import glob
from pathlib import Path

import pytest
import torch
from hf_models import LLAMA, write_tokenizer

from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams

CASES = {
    "gemma2": ("gemma2", LLAMA | dict(num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", LLAMA | dict(vocab_size=301, num_hidden_layers=6, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gpt_oss": ("gpt_oss", LLAMA | dict(num_hidden_layers=3, head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                                        max_position_embeddings=128,
                                        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                         "truncate": True, "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    "qwen3_moe": ("qwen3_moe", LLAMA | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}
DEEPSEEK = dict(vocab_size=320, hidden_size=96, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=3,
                num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=256,
                bos_token_id=0, eos_token_id=1, pad_token_id=0, q_lora_rank=24, first_k_dense_replace=1)
CASES |= {
    # softmax routing (ungrouped: see the module's docstring); two shared experts; no renormalization
    "deepseek_v2": ("deepseek_v2", DEEPSEEK | dict(n_routed_experts=4, num_experts_per_tok=2, topk_method="greedy", n_group=1,
                                                   topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5, scoring_func="softmax")),
    # sigmoid scores with the selection bias, 8 experts in 4 groups, 2 kept, 3 per token; scaled, renormalized
    "deepseek_v3": ("deepseek_v3", DEEPSEEK | dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                                                   routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid")),
}
PROMPT = [5, 17, 200, 33, 91, 250, 7, 64, 130, 12, 45, 99, 3, 150]  # longer than the windows (6)
NEW_TOKENS = 12
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TREES = ["/tmp/lcp/llama_cpp_python-*/vendor/llama.cpp", "/tmp/llama_cpp_python-*/vendor/llama.cpp",
                 str(ROOT / ".cache/llama_cpp_python-*/vendor/llama.cpp"), "~/src/llama.cpp"]
# Run the converter with our tiny tokenizer, whose pre-tokenizer hash it does not know: its vocabulary is
# written as plain GPT-2 BPE (llama.cpp's "gpt-2" pre-tokenizer) in place of a hash lookup or SentencePiece.
CONVERT = """
import runpy, sys
tree, folder, out = sys.argv[1:4]
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
base.TextModel._set_vocab_sentencepiece = base.TextModel._set_vocab_gpt2
sys.argv = [tree + "/convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_tree() -> Path | None:
    env = os.environ.get("DECODERLM_LLAMA_CPP_TREE")
    candidates = [env] if env else [p for pattern in DEFAULT_TREES for p in sorted(glob(os.path.expanduser(pattern)))]
    for c in candidates:
        if (Path(c) / "convert_hf_to_gguf.py").is_file():
            return Path(c)
    return None


def skip_reason() -> str | None:
    if llama_cpp_tree() is None:
        return ("llama.cpp's convert_hf_to_gguf.py not found: set DECODERLM_LLAMA_CPP_TREE to a llama.cpp source tree "
                "(e.g. vendor/llama.cpp of an unpacked llama-cpp-python source release)")
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return "llama-cpp-python is not installed or does not load (the runner of the converted GGUF)"
    return None


pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder / "hf", convert(request.param, folder)


def convert(name: str, folder: Path) -> Path:
    """A random HF checkpoint for case `name` in folder/hf, and folder/name.gguf converted from it by llama.cpp."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = CASES[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder / "hf")
    write_tokenizer(folder / "hf")
    gguf = folder / f"{name}.gguf"
    done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_tree()), str(folder / "hf"), str(gguf)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"convert_hf_to_gguf.py failed on {name}:\n{done.stderr[-3000:]}"
    return gguf


def llama_cpp_greedy(gguf: Path, prompt: list[int], n: int) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=64, n_threads=1, n_batch=64, verbose=False)
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def test_greedy_tokens_equal_llama_cpp(case):
    name, _, gguf = case
    ours, _ = load(gguf)
    got = generate(ours, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert got == llama_cpp_greedy(gguf, PROMPT, NEW_TOKENS), name


def test_logits_on_gguf_equal_logits_on_hf_folder(case):
    name, folder, gguf = case
    from_gguf, _ = load(gguf)
    from_hf, _ = load(folder)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        a, b = from_gguf(ids), from_hf(ids)
    a, b = (x if torch.is_tensor(x) else x.logits for x in (a, b))
    assert a.shape == b.shape, name
    assert (a - b).abs().max().item() < TOL, name


# Files llama.cpp itself quantizes (llama_model_quantize) from the converted ones, in the types the newer
# families ship with. The tiny matrices' rows (64, 96) are not multiples of 256, so llama.cpp writes no
# K-quant or IQ4_XS here (it falls back to Q4_0 / IQ4_NL); those types are checked block by block in
# test_gguf_quants.py. llama.cpp rounds activations to 8 bits for its quantized products, so logits differ
# by a few hundredths; the greedy tokens must not.
QUANTIZED = [("gpt_oss", "MXFP4_MOE", "MXFP4"), ("qwen3_moe", "Q5_0", "Q5_0"), ("qwen3_moe", "Q5_1", "Q5_1"),
             ("qwen3_moe", "IQ4_NL", "IQ4_NL"), ("gemma3", "Q5_0", "Q5_0"), ("deepseek_v3", "Q5_0", "Q5_0")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case name → its converted f32 GGUF (made once per name)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = convert(name, tmp_path_factory.mktemp(name))
        return made[name]
    return get


@pytest.mark.parametrize("name, ftype, qtype", QUANTIZED, ids=[f"{n}-{f}" for n, f, _ in QUANTIZED])
def test_llama_cpp_quantized_files_give_llama_cpp_greedy_tokens(converted, tmp_path, name, ftype, qtype):
    import ctypes

    import llama_cpp
    from gguf import GGUFReader

    from decoderlm.quantize import BlockLinear, Int8GroupLinear, Int8Linear

    out = tmp_path / f"{name}-{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(converted(name)).encode(), str(out).encode(), ctypes.byref(params)) == 0
    assert qtype in {t.tensor_type.name for t in GGUFReader(out).tensors}
    want = llama_cpp_greedy(out, PROMPT, NEW_TOKENS)
    for mode in (None, "auto"):
        ours, _ = load(out, quantize=mode)
        assert generate(ours, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)) == want, mode
    assert any(isinstance(m, (Int8Linear, Int8GroupLinear, BlockLinear)) for m in ours.modules())  # auto: on the int8 grid
