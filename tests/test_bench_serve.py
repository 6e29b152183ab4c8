"""benchmarks/serve_throughput.py: servers measured interleaved level by level, with the spread of the repeats and
the CPU a token cost each server's threads; benchmarks/serve_step.py: the server's step without HTTP."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hf_models import make_hf_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serve_throughput", ROOT / "benchmarks" / "serve_throughput.py")
serve_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_throughput)
spec = importlib.util.spec_from_file_location("quality", ROOT / "benchmarks" / "quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


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
            cpu = level["cpu_ms_per_token"]  # the median of the repeats', per thread group
            assert set(cpu) == {"server_main_thread", "server_other_threads", "client"}
            assert cpu["server_other_threads"] == statistics.median(r["cpu_ms_per_token"]["server_other_threads"] for r in level["repeats"])
            assert cpu["server_other_threads"] > 0 and cpu["client"] > 0
        assert levels[0]["ratio_to_1"] == 1.0
    assert "| decoderlm auto tok/s median (min–max), × 1 stream | decoderlm none tok/s median (min–max), × 1 stream |" in proc.stdout
    assert "| decoderlm auto TTFT | decoderlm auto ITL | decoderlm none TTFT | decoderlm none ITL |" in proc.stdout
    assert "decoderlm auto CPU ms a token: server main thread / other threads / client" in proc.stdout


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


def test_serve_step_times_every_batch_size_in_an_engine_built_as_serve_builds_it(tmp_path: Path) -> None:
    gguf = quality.tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "serve_step.json"
    proc = subprocess.run([sys.executable, "benchmarks/serve_step.py", "--model", str(gguf), "--no-compile", "--activations", "fp32,int16",
                           "--batches", "1,3", "--new-tokens", "12", "--context", "40", "--repeats", "2", "--threads", "1",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["step"] == "eager" and result["threads"] == 1 and result["machine"]["isa"]
    assert result["prompt_tokens"] == [40]  # every row's prompt, --context tokens
    assert result["layers_activations"] == {"fp32": ["fp32"], "int16": ["int16"]}  # serve's flag reached every block layer
    for arithmetic in ("fp32", "int16"):
        levels = result["results"][arithmetic]
        assert [level["rows"] for level in levels] == [1, 3]
        for level in levels:
            assert len(level["repeats"]) == 2 and level["step_ms"] == pytest.approx(sorted(level["repeats"])[0] / 2 + sorted(level["repeats"])[1] / 2)
            assert level["tok_s"] == pytest.approx(level["rows"] * 1e3 / level["step_ms"])
    assert "| 3 |" in proc.stdout


@pytest.mark.parametrize("flags, message", [(["--new-tokens", "3"], "--new-tokens must be more than"),
                                            (["--context", "-5"], "--context must be a number of tokens >= 0")])
def test_serve_step_refuses_what_it_cannot_time(flags: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/serve_step.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"), reason="per-thread CPU needs Linux's schedstat")
def test_a_servers_cpu_is_split_between_its_main_thread_and_the_others() -> None:
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    cpu_seconds = serve_throughput.cpu_seconds
    before = cpu_seconds(os.getpid())
    worker = threading.Thread(target=spin, args=(0.5,))
    worker.start()
    worker.join()
    middle = cpu_seconds(os.getpid())
    spin(0.5)
    after = cpu_seconds(os.getpid())
    assert middle["server_other_threads"] - before["server_other_threads"] >= 0.5  # the worker's CPU, the worker gone
    assert middle["server_main_thread"] - before["server_main_thread"] < 0.01  # this thread only waited
    assert after["server_main_thread"] - middle["server_main_thread"] >= 0.5
    assert after["server_other_threads"] - middle["server_other_threads"] < 0.01


def test_the_json_keeps_the_instruction_sets_llama_server_says_it_runs(tmp_path: Path) -> None:
    """A peer built for AVX2 and one built natively look alike from outside: the JSON keeps llama-server's own
    `system_info` line, which a server started for it alone logs at verbosity 4 (then it is stopped)."""
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\necho "main: $*" >&2\n[ "$7 $8" = "-lv 4" ] && '
                    'echo "0.00.002 I cmn common_param: system_info: n_threads = 2 | CPU : AVX2 = 1 | FMA = 1 |" >&2\nexec sleep 60\n')
    fake.chmod(0o755)
    args = argparse.Namespace(llama_server=str(fake), model="smollm2-135m-instruct")
    started = time.perf_counter()
    assert serve_throughput.system_info(args) == "n_threads = 2 | CPU : AVX2 = 1 | FMA = 1 |"
    assert time.perf_counter() - started < 10  # stopped once it has said it, not left to its sleep
    fake.write_text('#!/bin/sh\necho "main: no such line" >&2\n')
    assert serve_throughput.system_info(args) is None
