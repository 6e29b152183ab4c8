"""benchmarks/serve_throughput.py: servers measured interleaved level by level, with the spread of the repeats."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

from hf_models import make_hf_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serve_throughput", ROOT / "benchmarks" / "serve_throughput.py")
serve_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_throughput)


def test_servers_take_turns_within_each_level_and_every_repeat_is_reported(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    make_hf_model("llama", model)
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "benchmarks/serve_throughput.py", "--model", str(model), "--quantize", "none", "--no-compile", "--streams", "1,2",
                           "--repeats", "2", "--max-tokens", "4", "--threads", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    servers = ["decoderlm auto", "decoderlm none"]
    assert [(r["streams"], r["repeat"], r["server"]) for r in result["run_order"]] == [
        (streams, repeat, server) for streams in (1, 2) for repeat in (0, 1) for server in servers]
    assert list(result["results"]) == servers
    for server, levels in result["results"].items():
        assert [level["streams"] for level in levels] == [1, 2]
        for level in levels:
            ordered = [r["tok_s"] for r in result["run_order"] if r["server"] == server and r["streams"] == level["streams"]]
            assert [r["tok_s"] for r in level["repeats"]] == ordered
            assert level["tok_s"] == statistics.median(ordered)
            assert level["tok_s_min"] == min(ordered) and level["tok_s_max"] == max(ordered)
            assert level["itl_p50"] == statistics.median(r["itl_p50"] for r in level["repeats"])
            assert level["tokens"] == 4 * level["streams"]
        assert levels[0]["ratio_to_1"] == 1.0
    assert "| decoderlm auto tok/s median (min–max), × 1 stream | decoderlm none tok/s median (min–max), × 1 stream |" in proc.stdout
    assert "| decoderlm auto TTFT | decoderlm auto ITL | decoderlm none TTFT | decoderlm none ITL |" in proc.stdout


def test_ratios_to_llama_server_are_given_per_repeat_beside_the_ratio_of_medians() -> None:
    def level(*tok_s: float) -> dict:
        runs = [{"streams": 4, "tokens": 512, "tok_s": t, "ttft_p50": 0.1, "ttft_p95": 0.2, "itl_p50": 0.01, "itl_p95": 0.02} for t in tok_s]
        return serve_throughput.summarise(runs) | {"ratio_to_1": 1.0}

    results = {"decoderlm auto": [level(100, 150, 120)], "llama-server": [level(100, 100, 80)]}
    serve_throughput.against_llama(results)
    ours = results["decoderlm auto"][0]
    assert ours["vs_llama_server"] == 1.2 and ours["vs_llama_server_repeats"] == [1.0, 1.5, 1.5]
    assert "vs_llama_server" not in results["llama-server"][0]
    assert "| 4 | 120.0 (100.0–150.0), 1.00× | 100.0 (80.0–100.0), 1.00× | 1.20 (1.00, 1.50, 1.50) |" in serve_throughput.table(results)
