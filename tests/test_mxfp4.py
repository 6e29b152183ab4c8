"""gpt-oss folders as published: the experts' matrices stored as MXFP4 `_blocks` (two e2m1 values a byte) and
`_scales` (an e8m0 exponent per 32 values), config.json's quantization_config saying so. decoderlm dequantizes
them exactly as transformers does, and the folder runs like its float twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import make_hf_model, prompt_ids
from safetensors.torch import load_file, save_file

from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import loadable_config
from decoderlm.formats.mxfp4 import dequantize_hf_experts
from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7; code + 8 is the negative


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An (E, in, out) float experts tensor → its _blocks (E, out, in / 32, 16) and _scales (E, out, in / 32): per
    block of 32 inputs the power of two that brings the largest |value| to 6 or under, each value rounded to the
    nearest e2m1 level, two codes a byte with the first in the low nibble."""
    t = w.transpose(1, 2).unflatten(-1, (-1, 32))  # (E, out, G, 32)
    exp = torch.ceil(torch.log2(t.abs().amax(-1, keepdim=True) / 6)).clamp(-127, 127)
    scaled = t / 2**exp
    codes = ((scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) + 8 * (scaled < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp.squeeze(-1) + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the MXFP4 folder, its float twin holding transformers' dequantization of the same blocks): 3 layers of 4
    experts, hidden 64 and expert hidden 96 (2 and 3 blocks of 32). The MXFP4 folder keeps the scales in a second
    shard, apart from their blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    plain, packed = root / "float", root / "mxfp4"
    make_hf_model("gpt_oss", plain)
    shutil.copytree(plain, packed, ignore=shutil.ignore_patterns("*.safetensors"))  # tokenizer, generation_config
    tensors, shards = load_file(plain / "model.safetensors"), ({}, {})
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t)
            shards[0][name + "_blocks"], shards[1][name + "_scales"] = blocks, scales
            tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            shards[0][name] = t
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard, file in zip(shards, names):
        save_file(shard, packed / file, metadata={"format": "pt"})
    weight_map = {name: file for shard, file in zip(shards, names) for name in shard}
    (packed / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((plain / "config.json").read_text())
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    return packed, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_equals_transformers(dtype):
    """Every byte value and exponents from tiny (subnormal in fp32) to large, against transformers' own function."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 200, (3, 10, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 2, 127], dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_hf_experts(blocks, scales)
    assert got.shape == want.shape == (3, 4 * 32, 10) and torch.equal(got.to(dtype), want)


def test_packing_round_trips_through_transformers_dequantization():
    """The test's own packer, checked: values already on the grid come back exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (2, 64, 6), generator=g) * 2 - 1
    w = E2M1[torch.randint(0, 8, (2, 64, 6), generator=g)] * signs * 2.0 ** torch.randint(-3, 3, (2, 1, 6), generator=g)  # (E, in, out)
    assert torch.equal(convert_moe_packed_tensors(*pack_mxfp4(w), dtype=torch.float32), w)


def test_mxfp4_folder_loads_transformers_dequantized_weights(folders):
    packed, plain = folders
    got, want = load(packed, fuse=False)[0].state_dict(), load(plain, fuse=False)[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_mxfp4_folder_gives_transformers_logits_and_greedy_tokens(folders):
    """transformers reads the same folder, dequantizing on load (Mxfp4Config(dequantize=True); no kernels on CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    packed, _ = folders
    hf = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    model, _ = load(packed)
    ids = prompt_ids(24)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-4
        prompt = ids[:1, :12]  # it holds token 0, the pad id: the explicit mask keeps transformers from masking it
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16)[0, 12:].tolist()
    assert len(want) == 16 and generate(model, prompt[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=16)) == want


def test_bfloat16_load_dequantizes_to_transformers_bfloat16(folders):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed, _ = folders
    model, _ = load(packed, dtype="bfloat16", fuse=False)
    shard = load_file(packed / "model-00001-of-00002.safetensors") | load_file(packed / "model-00002-of-00002.safetensors")
    down = convert_moe_packed_tensors(shard["model.layers.1.mlp.experts.down_proj_blocks"],
                                      shard["model.layers.1.mlp.experts.down_proj_scales"], dtype=torch.bfloat16)  # (E, in, out)
    assert torch.equal(model.layers[1].mlp.experts[2].down_proj.weight, down[2].t())


@pytest.mark.parametrize("model_type, method", [("gpt_oss", "fp8"), ("llama", "mxfp4")])
def test_other_pre_quantized_weights_are_refused_in_one_line(model_type, method):
    """MXFP4 is read for gpt-oss's experts only; other layouts (GPTQ, AWQ, FP8, ...) stay refused."""
    d = json.loads((Path(__file__).parent / "fixtures" / "configs" / "gpt-oss-20b.json").read_text())
    with pytest.raises(DecoderLMError, match=f"holds {method} weights .* dequantize it with transformers and save_pretrained"):
        loadable_config(d | {"model_type": model_type, "quantization_config": {"quant_method": method}})
