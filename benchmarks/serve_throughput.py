"""Serving throughput over HTTP: `decoderlm serve` vs llama.cpp's `llama-server`, same GGUF, same load.

The model is the embedded SmolLM2-135M-Instruct (Q4_1 GGUF): decoderlm runs it in its default mode
(`--quantize auto`: the Q4_1 blocks, prompts read in fp32 (in int16 on AVX512-VNNI), decode steps in the server's arithmetic for the CPU level
(int16 at AVX2 and AVX-512, fp32 below; `decoderlm serve --help`), through the compiled
server step, built before the measurement where missing; `--no-compile`: eager steps), with each --activations
asked for (int16 is the arithmetic `chat` decodes with) and in each --quantize mode asked for (default: none, the
float32 path, and int8); llama-server runs the Q4_1 weights as they are. For 1, 4, 8 and 16 concurrent clients, each client
streams one chat completion of exactly 128 tokens (greedy, `ignore_eos`) for its own question;
all clients of a level start together. Reported per level: aggregate generated tokens per second
(all tokens / wall time of the level), p50 / p95 time to first token and inter-token latency
(gaps between streamed chunks), and the throughput as a multiple of one stream. All servers get
the same --threads (1 is the fair choice on a machine other jobs share: llama.cpp's threads spin-wait
for each other, which collapses when cores are oversubscribed).

The servers are started together and measured interleaved, level by level: for each level, repeat 1
runs every server in turn (A, B, ...), then repeat 2 (A, B, ...), and so on, so a change in the
machine's load hits every server alike and each ratio comes from runs made side by side. The JSON
records that run order. Per server and level it reports the median over the --repeats runs (throughput
and each latency figure), the min and max throughput and each repeat's figures; against llama-server
the ratio of the medians and the ratio within each repeat.

Each run also records the CPU it cost per generated token (`cpu_ms_per_token`, on Linux: the process's
CPU clock and its main thread's schedstat, both in ns): the server's main thread (decoderlm's HTTP event loop; llama-server's
main thread), the server's other threads (decoderlm's engine and its OpenMP worker) and this client. On a
machine with as many cores as --threads, CPU spent by the first and the last is taken from the step.
serve_step.py measures decoderlm's step without HTTP, for comparison.

llama-server is optional (`--llama-server PATH`). The binary measured for the README was built from
the llama.cpp tree vendored in llama-cpp-python's source release, outside the repo:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp     # llama_cpp_python-0.3.36
    tar xzf /tmp/lcp/llama_cpp_python-*.tar.gz -C /tmp/lcp && cd /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2                              # ~15 min on 2 cores

For `--isa avx2` on a CPU with more, the peer is built for AVX2 alone: `-DGGML_NATIVE=OFF -DGGML_AVX=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF` in place of `-DGGML_NATIVE=ON`.
The JSON keeps llama-server's own `system_info` line, which names the instruction sets it runs.

    python benchmarks/serve_throughput.py [--llama-server PATH] [--quantize none,int8] [--activations int16] [--streams 1,4,8,16] [--threads N]
        [--repeats 3] [--model NAME_OR_PATH] [--isa native|avx2|avx512|default] [--no-compile] [--out JSON]

`--isa avx2` runs decoderlm's servers as an AVX2 machine would (`decoderlm.isa.env`) on a CPU with more.
Writes benchmarks/results/serve_throughput.json (serve_throughput_avx2.json for --isa avx2; or --out) and
prints a table. The JSON records the CPU and the level decoderlm ran at.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable

import httpx

from decoderlm import isa
from decoderlm.names import DEFAULT_MODEL, locate

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "serve_throughput.json"
LLAMA_SERVER_BUILD = "llama.cpp vendored in llama-cpp-python 0.3.36 (sdist), cmake Release; see this file's docstring and llama_server_system_info"
TOPICS = ["the sea", "a lighthouse keeper", "mountains in winter", "a small robot", "the history of bread", "a city at night",
          "learning to swim", "an old library", "the first computer", "a garden in spring", "a train journey", "the moon landing",
          "a chess match", "a forgotten song", "volcanoes", "a friendly dragon"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(client: httpx.AsyncClient, url: str, model: str, topic: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Write a long story about {topic}."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, arrivals, tokens = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals, "tokens": tokens if tokens is not None else len(arrivals)}


async def run_level(url: str, model: str, streams: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(client, url, model, TOPICS[i % len(TOPICS)], max_tokens) for i in range(streams)))
        wall = time.perf_counter() - t0
    ttft = [r["arrivals"][0] - r["start"] for r in runs if r["arrivals"]]
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in runs)
    return {"streams": streams, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "itl_p50": percentile(itl, 0.5), "itl_p95": percentile(itl, 0.95)}


def cpu_seconds(pid: int) -> dict[str, float] | None:
    """CPU seconds so far of process pid's main thread and of its other threads, ended ones included (the
    process's CPU clock and the main thread's schedstat, both counted in ns); None where libc or /proc lack them."""
    try:
        total = time.clock_gettime(process_clock(pid))
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            main = int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return {"server_main_thread": main, "server_other_threads": max(0.0, total - main)}


def process_clock(pid: int) -> int:
    """The id of process pid's CPU-time clock: all its threads, ended ones included (libc's clock_getcpuclockid;
    /proc/PID/stat has the same total only in clock ticks, 10 ms, too coarse for a short run)."""
    clock = ctypes.c_int()  # clockid_t
    if error := ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock)):
        raise OSError(error, os.strerror(error))
    return clock.value


def measured_run(url: str, pid: int, model: str, streams: int, max_tokens: int) -> dict:
    """run_level, with the CPU ms per generated token of the server's threads and of this client."""
    server, client = cpu_seconds(pid), time.process_time()
    run = asyncio.run(run_level(url, model, streams, max_tokens))
    after, client = cpu_seconds(pid), time.process_time() - client
    if server is not None and after is not None:
        run["cpu_ms_per_token"] = {k: 1e3 * (after[k] - server[k]) / run["tokens"] for k in server} | {"client": 1e3 * client / run["tokens"]}
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {timeout} s")


def start_decoderlm(args: argparse.Namespace, port: int, quantize: str | None = None, activations: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "decoderlm", "serve", "--model", args.model, "--port", str(port), "--max-batch", str(max(args.streams))]
    cmd += ["--quantize", quantize] if quantize else []
    cmd += ["--activations", activations] if activations else []
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += ["--compile" if args.compile else "--no-compile"]
    env = os.environ if args.isa == "native" else isa.env(args.isa)
    return subprocess.Popen(cmd, cwd=REPO, env=env | {"PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def llama_command(args: argparse.Namespace, port: int) -> list[str]:
    """llama-server on --model at 127.0.0.1:port; the callers add its other flags."""
    return [args.llama_server, "-m", str(locate(args.model)), "--host", "127.0.0.1", "--port", str(port)]


def start_llama(args: argparse.Namespace, port: int) -> subprocess.Popen:
    slots = max(args.streams)
    cmd = llama_command(args, port) + ["--parallel", str(slots), "--ctx-size", str(slots * 512), "--cont-batching", "--ignore-eos",
                                       "--no-webui"]
    if args.threads:
        cmd += ["--threads", str(args.threads), "--threads-batch", str(args.threads)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def system_info(args: argparse.Namespace, timeout: float = 30) -> str | None:
    """llama-server's `system_info` line, the CPU features its ggml build uses (`AVX2 = 1 | ...`; a build for AVX2
    and a native one look alike from outside): logged at start-up from verbosity 4, so a server is started for
    it alone and stopped once it has said it. None if it never does."""
    proc = subprocess.Popen(llama_command(args, free_port()) + ["-lv", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        return next((line.split("system_info:", 1)[1].strip() for line in proc.stderr if "system_info:" in line), None)
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()


def summarise(runs: list[dict]) -> dict:
    """One server at one level over its repeats: the median of each figure, the throughput's min and max,
    and every repeat as measured."""
    keys = ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95")
    tok_s = [r["tok_s"] for r in runs]
    out = ({"streams": runs[0]["streams"], "tokens": runs[0]["tokens"]} | {k: statistics.median(r[k] for r in runs) for k in keys}
           | {"tok_s_min": min(tok_s), "tok_s_max": max(tok_s), "repeats": runs})
    if all("cpu_ms_per_token" in r for r in runs):
        out["cpu_ms_per_token"] = {k: statistics.median(r["cpu_ms_per_token"][k] for r in runs) for k in runs[0]["cpu_ms_per_token"]}
    return out


Save = Callable[[dict[str, list[dict]], list[dict]], None]


def measure(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace, save: Save) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every level on every server (its url, its process id), interleaved level by level (repeat r: each server
    in turn); the per-server levels and the run order. `save(results, order)` is called after each level."""
    results: dict[str, list[dict]] = {name: [] for name in urls}
    order: list[dict] = []
    for streams in args.streams:
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for repeat in range(args.repeats):
            for name, url in urls.items():
                run = measured_run(url, pids[name], args.model, streams, args.max_tokens)
                runs[name].append(run)
                order.append({"streams": streams, "repeat": repeat, "server": name, "tok_s": run["tok_s"]})
                print(f"{name:>16} {streams:>2} streams, repeat {repeat}: {run['tok_s']:7.1f} tok/s", flush=True)
        for name in urls:
            results[name].append(summarise(runs[name]))
            results[name][-1]["ratio_to_1"] = results[name][-1]["tok_s"] / results[name][0]["tok_s"]
        save(results, order)
    return results, order


def against_llama(results: dict[str, list[dict]]) -> None:
    """Each decoderlm level's throughput over llama-server's: the ratio of the medians and each repeat's ratio."""
    for name, levels in results.items():
        if name == "llama-server":
            continue
        for ours, ref in zip(levels, results["llama-server"]):
            ours["vs_llama_server"] = ours["tok_s"] / ref["tok_s"]
            ours["vs_llama_server_repeats"] = [a["tok_s"] / b["tok_s"] for a, b in zip(ours["repeats"], ref["repeats"])]


def serving(servers: dict[str, Callable[..., subprocess.Popen]], args: argparse.Namespace, save: Save) -> tuple[dict[str, list[dict]], list[dict]]:
    """Start every server, wait until each answers and is warm, measure them interleaved, stop them."""
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for name, start in servers.items():
            port = free_port()
            procs[name], urls[name] = start(args, port), f"http://127.0.0.1:{port}"
        for name, url in urls.items():
            wait_healthy(url, procs[name])
            asyncio.run(run_level(url, args.model, 1, 8))  # warm-up
        return measure(urls, {name: proc.pid for name, proc in procs.items()}, args, save)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def table(results: dict[str, list[dict]]) -> str:
    """README's tables: throughput per level, median (min–max) and × 1 stream, with decoderlm / llama-server
    (ratio of the medians, then each repeat's); then p50 / p95 latencies in ms (medians over the repeats); then the
    CPU a generated token cost each server's threads and the client, where /proc gave it."""
    names, ours = list(results), [name for name in results if name != "llama-server"]
    versus = ours if "llama-server" in results else []
    lines = ["| streams | " + " | ".join(f"{name} tok/s median (min–max), × 1 stream" for name in names)
             + "".join(f" | {name} / llama-server (each repeat)" for name in versus) + " |", "|---:|" + "---:|" * (len(names) + len(versus))]
    for i, level in enumerate(results[names[0]]):
        cells = [f"{r['tok_s']:.1f} ({r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}), {r['ratio_to_1']:.2f}×" for r in (results[n][i] for n in names)]
        cells += [f"{r['vs_llama_server']:.2f} ({', '.join(f'{x:.2f}' for x in r['vs_llama_server_repeats'])})" for r in (results[n][i] for n in versus)]
        lines.append(f"| {level['streams']} | " + " | ".join(cells) + " |")
    lines += ["", "| streams | " + " | ".join(f"{name} TTFT | {name} ITL" for name in names) + " |", "|---:|" + "---:|---:|" * len(names)]
    for i, level in enumerate(results[names[0]]):
        ms = [f"{round(1e3 * r[f'{k}_p50'])} / {round(1e3 * r[f'{k}_p95'])}" for r in (results[n][i] for n in names) for k in ("ttft", "itl")]
        lines.append(f"| {level['streams']} | " + " | ".join(ms) + " |")
    if all("cpu_ms_per_token" in r for levels in results.values() for r in levels):
        lines += ["", "| streams | " + " | ".join(f"{name} CPU ms a token: server main thread / other threads / client" for name in names)
                  + " |", "|---:|" + "---:|" * len(names)]
        for i, level in enumerate(results[names[0]]):
            cpu = [" / ".join(f"{v:.2f}" for v in results[n][i]["cpu_ms_per_token"].values()) for n in names]
            lines.append(f"| {level['streams']} | " + " | ".join(cpu) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary (optional)")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quantize", type=lambda s: [q for q in s.split(",") if q], default=["none", "int8"],
                   help="also serve with these --quantize modes (default: none,int8; '' for the default mode alone)")
    p.add_argument("--activations", type=lambda s: [a for a in s.split(",") if a], default=[],
                   help="also serve the default mode with these --activations, e.g. int16 or fp32 (serve's own: int16 at AVX2 and AVX-512, fp32 below; "
                        "a model without block layers refuses int16 and int8; default: none)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="what every server serves (default: the embedded model)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="decoderlm's servers decode through their compiled step, built before the measurement where missing "
                        "(default; what a server runs once its step is built); --no-compile: eager steps")
    p.add_argument("--isa", choices=("native", *isa.LEVELS), default="native",
                   help="the CPU level decoderlm's servers run at (llama-server runs as built)")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write (default: results/serve_throughput[_ISA].json)")
    args = p.parse_args()
    if args.isa != "native" and args.isa not in isa.supported():
        raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
    args.out = args.out or (RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}"))
    servers = {"decoderlm auto": start_decoderlm} | {f"decoderlm {q}": partial(start_decoderlm, quantize=q) for q in args.quantize}
    servers |= {f"decoderlm auto --activations {a}": partial(start_decoderlm, activations=a) for a in args.activations}
    servers |= {"llama-server": start_llama} if args.llama_server else {}
    meta = {"machine": isa.describe(), "decoderlm_isa": isa.native() if args.isa == "native" else args.isa, "threads": args.threads,
            "decoderlm_step": "compiled" if args.compile else "eager",
            "max_tokens": args.max_tokens, "repeats": args.repeats, "model": args.model,
            "llama_server": LLAMA_SERVER_BUILD if args.llama_server else None,
            "schedule": "interleaved level by level: for each level, each repeat runs every server in turn (run_order)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(results: dict[str, list[dict]], order: list[dict]) -> None:
        args.out.write_text(json.dumps(meta | {"run_order": order, "results": results}, indent=2) + "\n")

    if args.llama_server:
        meta["llama_server_system_info"] = system_info(args)
    results, order = serving(servers, args, save)
    if "llama-server" in results:
        against_llama(results)
    save(results, order)
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
