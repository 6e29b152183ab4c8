"""Tiny random HF checkpoints, built locally with transformers (nothing is downloaded).

One case per family, each switching on the mechanism that family adds (rope scaling, a sliding window
shorter than the test sequences, q/k/v bias with tied embeddings, q/k norm with a head_dim override,
4 experts top-2, fused q/k/v, Conv1D, OLMo-2's post-norms and all-head q/k norms, ...), plus a small byte-level BPE tokenizer trained on the spot.
Every parameter is perturbed after init, so biases and norm weights are not their trivial 0 / 1.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

VOCAB = 320
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0)

CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1)),
    "llama": ("llama", LLAMA),
    # original context 64: head_dim 16's wavelengths fall in all three llama3 bands (scaled, blended, kept)
    "llama-rope-llama3": ("llama", LLAMA | dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64})),
    "llama-rope-linear": ("llama", LLAMA | dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "mistral-window": ("mistral", LLAMA | dict(sliding_window=8)),
    "qwen2-bias-tied": ("qwen2", LLAMA | dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", LLAMA | dict(head_dim=32)),
    "mixtral": ("mixtral", LLAMA | dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", LLAMA | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)),
    "phi3-partial-rotary": ("phi3", LLAMA | dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.5})),
    "gemma": ("gemma", LLAMA | dict(head_dim=32)),
    "olmo2-postnorm": ("olmo2", LLAMA),
    # Qwen2 with sliding layers from max_window_layers on: a per-layer window in a Llama-like family
    "qwen2-mixed-window": ("qwen2", LLAMA | dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    # sliding/full alternating with a window shorter than the prompts, soft-capped scores and logits, an
    # odd query_pre_attn_scalar
    "gemma2": ("gemma2", LLAMA | dict(num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # 2 sliding : 1 full, each kind its RoPE (local 10k plain, global 1M linear ×4), q/k norms
    "gemma3": ("gemma3_text", LLAMA | dict(num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                           sliding_window_pattern=3, rope_parameters={
                                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # sinks, biases, 4 experts top-2 with interleaved gate/up and the clamped SwiGLU, YaRN from a 16-token context
    "gpt_oss": ("gpt_oss", LLAMA | dict(num_hidden_layers=3, head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                                        max_position_embeddings=128,
                                        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                         "truncate": False, "original_max_position_embeddings": 16,
                                                         "rope_theta": 150000.0})),
}

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "Decoder-only transformers predict the next token from the ones before it.",
    "Keys and values of earlier tokens are kept in a cache.",
    "日本語のテキストも少しだけ。 Émigré café naïve façade.",
] * 4


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE (GPT-2 style) with < VOCAB tokens, serialized."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    return tok.to_str()


def write_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer_json())
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hf_config(case: str):
    from transformers import AutoConfig

    model_type, kwargs = CASES[case]
    return AutoConfig.for_model(model_type, **kwargs)


def make_hf_model(case: str, folder: Path, seed: int = 0, max_shard_size: str | None = None):
    """Save a random HF model (and tokenizer) for `case` into folder; return it in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None  # greedy comparisons run the full length
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    write_tokenizer(folder)
    return model


def prompt_ids(n: int = 20, seed: int = 0) -> torch.Tensor:
    """(2, n) random token ids."""
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
