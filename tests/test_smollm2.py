"""The embedded SmolLM2-135M-Instruct GGUF, against transformers loading the same file."""

from __future__ import annotations

import copy
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from decoderlm.formats.gguf import load_gguf
from decoderlm.generate import generate
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import StreamDecoder

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "年假怎么申请？"]
TEXTS = ["Hello world", "年假怎么申请？", "emoji 😀👍🏽 and 🇫🇷", "def f(x):\n    return x ** 2  # 42\n",
         "a   b\t\tc\n\n\nd  ", "abc123 4567 x1y2 3.14159", " leading space", "<|im_start|>user\nhi<|im_end|>\n", ""]



@pytest.fixture(scope="module")
def path():
    return locate(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def ours(path):
    return load_gguf(path, torch.float32)


@pytest.fixture(scope="module")
def ref_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def ref_model(path):
    # transformers' own GGUF reader and dequantizer (from_pretrained(gguf_file=) would also need accelerate).
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.LlamaForCausalLM(config)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_tokenizer_ids_match_transformers(ours, ref_tokenizer):
    tok = ours[1]
    for text in TEXTS:
        assert tok.encode(text) == ref_tokenizer(text)["input_ids"], text
        ids = ref_tokenizer(text)["input_ids"]
        assert tok.decode(ids) == ref_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == 49152 and tok.eos_token_ids == [ref_tokenizer.eos_token_id]


def test_chat_template_renders_like_transformers(ours, ref_tokenizer):
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "年假？"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours[1].apply_chat_template(messages, add_generation_prompt=gen) == ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_logits_match_transformers(ours, ref_model):
    """Our fp32 logits against the exact ones: transformers' model in float64 from the same fp32 weights.
    Within 1e-4, or within twice transformers' own fp32 error where that is larger: this model's hidden
    states reach ~25,000, so fp32 rounding alone moves logits by ~1e-4 (transformers' fp32 logits are
    9e-5 from exact here; ours 8e-5 at AVX-512, 1.3e-4 with torch held to AVX2), and two fp32
    implementations can differ by the sum of two such errors."""
    ids = torch.tensor([chat_ids(ours[1], PROMPTS[0]) + chat_ids(ours[1], PROMPTS[2])])
    exact_model = copy.deepcopy(ref_model).double()
    with torch.no_grad():
        a, b, exact = ours[0](ids).logits, ref_model(ids).logits, exact_model(ids).logits
    theirs = (b.double() - exact).abs().max().item()
    assert (a.double() - exact).abs().max().item() < max(1e-4, 2 * theirs)


def test_greedy_replies_match_transformers(ours, ref_model):
    """transformers' greedy reply is the sequence whose every token is its argmax given what came
    before, so one teacher-forced forward over prompt + our reply checks all 32 steps (HF's generate
    is several times slower on CPU)."""
    model, tok = ours
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=tok.eos_token_ids)
    for prompt in PROMPTS:
        ids = chat_ids(tok, prompt)
        mine = generate(model, ids, params)
        assert mine, prompt
        with torch.no_grad():
            logits = ref_model(torch.tensor([ids + mine])).logits[0]
        theirs = logits[len(ids) - 1 :].argmax(-1).tolist()  # HF's choice at each reply position, and after it
        assert theirs[: len(mine)] == mine, prompt
        if len(mine) < 32:  # we stopped early: HF must pick the end-of-turn token there too
            assert theirs[len(mine)] in tok.eos_token_ids, prompt


def test_streaming_never_prints_replacement_char(ours):
    tok = ours[1]
    for text in ["年假怎么申请？请告诉我流程。", "🎉🇫🇷👍🏽 emoji, ok 😀", "mixed 中文 and English ✓"]:
        ids = tok.encode(text)
        decoder = StreamDecoder(tok)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids) == text
