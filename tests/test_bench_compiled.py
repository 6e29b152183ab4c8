"""benchmarks/compiled_decode.py --quick: the script end to end on a tiny random GGUF (one compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compiled_decode_quick_reports_a_greedy_identical_compiled_step(tmp_path: Path) -> None:
    out = tmp_path / "compiled_decode.json"
    env = {**os.environ, "DECODERLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/compiled_decode.py", "--quick", "--modes", "fp32", "--threads", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["model"] == "tiny random (--quick)" and result["new_tokens"] == 8 and result["repeats"] == 2
    row = result["modes"]["fp32"]
    assert row["greedy_identical"] and row["eager_tok_s"] > 0 and row["compiled_tok_s"] > 0 and row["build_or_load_s"] > 0
    assert row["run_order"] == ["eager", "compiled"] * 2  # after the build the engines take turns in every repeat
    assert "llama.cpp_tok_s" not in row
    assert list((tmp_path / "cache" / "compiled").glob("*.pt2"))  # the package went where DECODERLM_CACHE says
    assert "tiny random (--quick)" in proc.stdout
