"""generate_speed.py's memory account: every stage of a quantized `chat` on a tiny GGUF, in order, each
with its own peak and what it leaves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_benchmarks import benchmark

STAGES = ["imports", "GGUF header read", "tokenizer", "weights read and quantized", "projections fused",
          "KV cache allocated", "first forward", "generation done"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the account reads /proc/self/status")
def test_memory_account_covers_every_stage_of_a_chat(tmp_path: Path) -> None:
    gguf = benchmark("quality").tiny_gguf(tmp_path / "tiny.gguf")
    account = benchmark("generate_speed").memory_account(["chat", "--model", str(gguf), "--quantize", "int4", "--message", "hi",
                                                          "--max-new-tokens", "3", "--temperature", "0"])
    assert list(account) == STAGES
    imports = account["imports"]["rss_mb"]
    assert 50 < imports < 2000
    for stage, a in account.items():
        assert a["peak_mb"] >= a["rss_mb"] > 0, stage
    assert account["weights read and quantized"]["peak_mb"] > imports  # the model came in after the imports
