"""benchmarks/attention_variants.py: its variants keep the parameter budget and change what they name, the
real configs' KV figures are inspect's, and the script runs end to end in --quick mode."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import corpus_text

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("attention_variants", ROOT / "benchmarks" / "attention_variants.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_every_variant_keeps_the_budget_and_caches_what_its_attention_implies() -> None:
    base = bench.accounting(bench.variant_config({})).total
    kv = {}
    for name, changes in bench.VARIANTS:
        acc = bench.accounting(bench.variant_config(changes))
        assert abs(acc.total / base - 1) <= bench.TOLERANCE, name
        kv[name] = bench.kv_per_token(acc, 2048)
    # 4 layers × (K + V) × heads × 32 × 2 bytes; MLA: 4 × (64 + 16) × 2; the mix: 3 layers of 16 tokens + 1 of 2,048
    assert kv["MHA"] == 2048 and kv["GQA 4:2"] == 1024 and kv["MQA 4:1"] == 512 and kv["MLA 64+16"] == 640
    assert kv["sliding 3:1 full"] == kv["sliding 3:1 full + sinks"] == (3 * 16 + 2048) * 256 * 2 / 2048


def test_real_configs_kv_figures_and_whether_they_run() -> None:
    rows = {r["name"]: r for r in bench.real_configs()}
    assert rows["DeepSeek-V3"]["kv_bytes_per_token"] == 61 * 576 * 2 and rows["Llama-3.1-8B"]["kv_bytes_per_token"] == 128 * 1024
    assert rows["Llama-3.1-8B"]["kv_bytes_at_131072"] == 16 * 2**30
    gemma = rows["Gemma-3-27B"]  # 10 full layers hold 128k tokens, 52 sliding ones 1,024; 16 K/V heads of 128
    assert gemma["kv_bytes_at_131072"] == (10 * 131072 + 52 * 1024) * 2 * 16 * 128 * 2 and gemma["uncounted"] == ["vision_config"]
    assert rows["gpt-oss-120b"]["kv_bytes_at_131072"] == (18 * 131072 + 18 * 128) * 2 * 8 * 64 * 2
    assert gemma["runs_in_decoderlm"] == "yes, the language model only; the vision tower (SigLIP) is not loaded"
    assert rows["DeepSeek-V3"]["runs_in_decoderlm"] == rows["Llama-3.1-8B"]["runs_in_decoderlm"] == "yes"
    assert rows["gpt-oss-120b"]["runs_in_decoderlm"] == "yes"  # its MXFP4 experts (quantization_config) are read


def test_attention_variants_runs_end_to_end_in_quick_mode(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text(corpus_text(30_000), encoding="utf-8")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/attention_variants.py", "--quick", "--data", str(data), "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "attention_variants.json").read_text())
    rows = {r["name"]: r for r in result["variants"]}
    assert list(rows) == [name for name, _ in bench.VARIANTS] and result["steps"] == 4 and result["issue_steps"] == 2000
    assert all(r["tokens"] == 4 * 12 * 64 and abs(r["vs_base_parameters"]) <= 0.05 and r["decode_tok_s_at_context"] > 0 for r in rows.values())
    assert "--set n_kv_heads=1" in rows["MQA 4:1"]["command"] and "attn_sinks=true" in rows["sliding 3:1 full + sinks"]["command"]
    assert "single shared, busy 2-core machine" in result["note"] and result["machine"]
    assert (out / "attention_variants.png").stat().st_size > 0
    assert "| DeepSeek-V3 | MLA 128 heads, latent 512+64 | 68.62 KiB | 8.58 GiB | yes |" in proc.stdout
