"""Shared helpers: tiny random models, a small corpus, and hypothesis strategies for configs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

import decoderlm.cli as cli
from decoderlm.config import ModelConfig
from decoderlm.model import Transformer

# Compiled decode steps built by the tests go to a fresh folder, and none built by the user's own runs
# (~/.cache/decoderlm, which chat and generate use by default) can change what a test decodes.
# The folder goes when the session ends (child pytest processes make and remove their own).
os.environ["DECODERLM_CACHE"] = tempfile.mkdtemp(prefix="decoderlm-test-cache-")
os.environ["DECODERLM_BACKGROUND_COMPILE"] = "off"  # tests that want it turn it on (test_compiled_packages)
atexit.register(shutil.rmtree, os.environ["DECODERLM_CACHE"], ignore_errors=True)

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

# Used when ../shared is absent, so the suite runs anywhere.
FALLBACK_TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.

All:
We know't, we know't.

First Citizen:
Let us kill him, and we'll have corn at our own price.
Is't a verdict?
"""


def corpus_text(n_chars: int = 20_000) -> str:
    """The first n_chars of tiny Shakespeare, or the built-in fallback repeated to that length."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")[:n_chars]
    return (FALLBACK_TEXT * (n_chars // len(FALLBACK_TEXT) + 1))[:n_chars]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(corpus_text(), encoding="utf-8")
    return path


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=37, n_layers=2, d_model=32, n_heads=4, max_seq_len=64, ffn_hidden=48)
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """A random model in eval mode, in fp32 unless converted by the caller."""
    torch.manual_seed(seed)
    return Transformer(tiny_config(**overrides)).eval()


@st.composite
def configs(draw) -> dict:
    """Overrides for `tiny_config` covering the mechanisms the model can switch on."""
    n_heads = draw(st.sampled_from([1, 2, 4]))
    n_kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if n_heads % k == 0]))  # MQA / GQA / MHA
    position = draw(st.sampled_from(["rope", "learned"]))
    cfg = dict(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_model=8 * n_heads,
        position=position,
        norm=draw(st.sampled_from(["rmsnorm", "layernorm"])),
        mlp=draw(st.sampled_from(["swiglu", "gelu"])),
        sliding_window=draw(st.sampled_from([None, 3, 5])),
        qk_norm=draw(st.booleans()),
        n_layers=draw(st.integers(1, 2)),
    )
    if position == "rope":
        cfg["partial_rotary_factor"] = draw(st.sampled_from([1.0, 0.5]))
    if draw(st.booleans()):
        cfg.update(n_experts=4, n_experts_per_tok=2, moe_hidden=16)
    return cfg


# Tiny models gain nothing from a second thread, and on a busy machine spinning threads slow every
# op down tenfold. The CPUs are shared and timing varies: a property test is judged by its result.
torch.set_num_threads(1)
settings.register_profile("decoderlm", deadline=None)
settings.load_profile("decoderlm")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`decoderlm ARGV` in-process: (exit code, stdout, stderr)."""
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(name="cli")
def cli_main():
    """`decoderlm.cli.main`: `decoderlm ARGV` in-process, returning the exit code."""
    return cli.main
