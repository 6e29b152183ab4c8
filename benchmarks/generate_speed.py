"""Generation speed on this machine: decoderlm vs HF transformers vs llama.cpp, same model, same run.

The model is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF). decoderlm runs it in every mode
of benchmarks/modes.py (fp32; bf16; int8 / int4 weights; auto, the default: this Q4_1 file's blocks with
16-bit activations in decode steps; fp32-act: the same blocks in fp32 arithmetic; int8-act: with
llama.cpp's int8 activations; on a CPU with AMX, "auto no-amx" is the default with its batches off the tiles);
transformers dequantizes it and runs in fp32 and in bf16; llama.cpp (llama-cpp-python, optional) runs
the Q4_1 weights as they are. Each engine decodes greedy tokens for the same prompt ids, the torch
engines all on this one thread (see transformers_engine); time to the first token measures prefill,
the rest measures decode. Engines are interleaved within each repeat and the median over repeats is
reported, so a slow moment of the machine hits every engine alike.

A second pass starts each decoderlm mode cold, as a user would: `decoderlm chat --message ...` in a
fresh process, timed from the process's start to its first streamed byte, with the process's peak
RSS (its ru_maxrss); the imports alone and llama.cpp's own cold start are measured beside them. The
first of these runs is reported apart from the median, so a one-off cost (a compile cached on disk)
shows there instead of in every run. Each mode's memory is then accounted stage by stage (imports,
GGUF header, tokenizer, weights, fusing, KV cache, first forward): each stage's peak and what it leaves.

    python benchmarks/generate_speed.py [--repeats 5] [--new-tokens 128] [--prompt-tokens 128] [--threads N] [--cold-runs 3]
        [--isa native|avx2|avx512|default]

`--isa avx2` measures as an AVX2 machine would (`decoderlm.isa.env`: torch's kernels, oneDNN and MKL held
to AVX2, in this process and every one it starts) and writes generate_speed_avx2.json; llama.cpp keeps
the instruction set it was built for (the JSON's `llama.cpp_build`): LLAMA_CPP_LIB_PATH=<a folder with an
AVX2-only libllama.so> gives it the same level (cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF).

--repeats 0 skips the speed pass, --cold-runs 0 the cold-start pass. Run benchmarks/quality.py first:
its results mark which modes are faithful (perplexity within 1 % of fp32 and as many correct answers as
fp32 wherever its answers part ran them), and the fastest of those
is named, since the issue's targets are set for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from decoderlm import compiled, isa, kernels
from decoderlm import SamplingParams, load, stream
from decoderlm.names import DEFAULT_MODEL, locate

sys.path.insert(0, str(Path(__file__).parent))
from modes import MODES, cli_flags  # a sibling file: benchmarks/ is not a package

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "generate_speed.json"
QUALITY = Path(__file__).parent / "results" / "quality.json"  # written by quality.py
TEXT = ("The history of the decoder-only Transformer begins with language modelling: predict the next token "
        "from the tokens before it. Stacking causal self-attention and feed-forward blocks, ") * 20
Engine = Callable[[list[int], int], Iterable[int] | Iterable[tuple[float, int]]]  # see timed()
DECODERLM = {f"decoderlm {mode}": kwargs for mode, kwargs in MODES.items()}
COMPILED = "decoderlm auto compiled"  # the default mode through the compiled step: chat's decode from its second run
COMPILED_INT8_ACT = "decoderlm int8-act compiled"  # --activations int8 through its compiled step
NO_AMX = "decoderlm auto no-amx"  # the default with its batches off AMX's tiles (DECODERLM_AMX=off), where the CPU has them
TRANSFORMERS = {"transformers": torch.float32, "transformers bf16": torch.bfloat16}
BASES = ("transformers bf16", "llama.cpp")  # the ratio columns: the targets are set against these
COLD_MESSAGE = "What is the capital of France?"
IMPORTS_ONLY = "python + torch + decoderlm"
SPAWN = """import os, sys
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""  # argv: the file for the child's peak RSS, then the command
STAGES = """import json, sys
import importlib
def status():
    return {k: int(v.split()[0]) * 1024 / 1e6 for k, _, v in (line.partition(":") for line in open("/proc/self/status")) if k in ("VmRSS", "VmHWM")}
account = {}
def mark(stage):
    s = status()
    account[stage] = {"peak_mb": s["VmHWM"], "rss_mb": s["VmRSS"]}
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts: the next stage's peak is its own
import torch, decoderlm.cli, decoderlm.loader, decoderlm.formats.gguf as gguf
from decoderlm.model import Transformer
generate = importlib.import_module("decoderlm.generate")
mark("imports")
def after(module, name, stage):
    f = getattr(module, name)
    def wrapped(*args, **kwargs):
        out = f(*args, **kwargs)
        if stage not in account:  # the first call ends the stage
            mark(stage)
        return out
    setattr(module, name, wrapped)
for module, name, stage in ((gguf, "open_gguf", "GGUF header read"), (gguf, "gguf_tokenizer", "tokenizer"),
                            (gguf, "load_gguf", "weights read and quantized"), (decoderlm.loader, "fuse_projections", "projections fused"),
                            (generate, "cache_for", "KV cache allocated"), (Transformer, "forward", "first forward")):
    after(module, name, stage)
decoderlm.cli.main(sys.argv[2:])
mark("generation done")
json.dump(account, open(sys.argv[1], "w"))
"""  # argv: the file for the account, then `decoderlm` CLI arguments; stages in the order they are reached
LLAMA_CPP_COLD = """import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), verbose=False)
for chunk in llm.create_chat_completion([{"role": "user", "content": sys.argv[3]}], max_tokens=4, temperature=0, stream=True):
    print(chunk["choices"][0]["delta"].get("content", ""), end="", flush=True)
"""


def timed(tokens: Iterable[int | tuple[float, int]]) -> tuple[float, float, list[int]]:
    """Consume a token stream; return (seconds to first token, seconds from it to the last, ids). An
    engine may yield (time.perf_counter() when the token came, token) instead, when it produces its
    tokens before handing them over (transformers, see transformers_engine)."""
    t0 = time.perf_counter()
    stamps, out = [], []
    for item in tokens:
        stamp, tok = item if isinstance(item, tuple) else (time.perf_counter(), item)
        stamps.append(stamp)
        out.append(int(tok))
    return stamps[0] - t0, stamps[-1] - stamps[0], out


def decoderlm_engine(gguf: Path, load_kwargs: dict, compile: bool = False) -> Engine:
    """decoderlm in one mode; compile=True decodes through the compiled step (built here if this machine has
    none cached), as `chat` and `generate` do by default once their background build has run."""
    model, _ = load(gguf, **load_kwargs)
    step = compiled.CompiledDecoder(model) if compile else None
    return lambda ids, n: stream(model, ids, SamplingParams(temperature=0, max_new_tokens=n), step=step)


def without_amx(engine: Engine) -> Engine:
    """`engine` with decoderlm's batches off AMX's tiles while it runs (the same bits, the vector kernels' speed)."""
    def run(ids: list[int], n: int) -> Iterable[int]:
        kernels.amx(False)
        try:
            yield from engine(ids, n)
        finally:
            kernels.amx(True)
    return run


def transformers_engine(gguf: Path, dtype: torch.dtype) -> Engine:
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF reader and dequantizer; from_pretrained(gguf_file=) would also need accelerate.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"], strict=False)
    model.to(dtype).eval()

    class Streamer:  # transformers calls put() with the prompt first, then with each new token
        def __init__(self) -> None:
            self.stamped: list[tuple[float, int]] = []
            self.first = True

        def put(self, value: torch.Tensor) -> None:
            if self.first:
                self.first = False
                return
            self.stamped.append((time.perf_counter(), int(value.reshape(-1)[0])))

        def end(self) -> None:
            pass

    def run(ids: list[int], n: int) -> Iterable[tuple[float, int]]:
        # generate runs in this thread and the tokens are handed over, stamped, when it returns. Run in
        # a second thread to stream them live, torch would keep a second OpenMP pool, and two pools on
        # this machine's cores halve the speed of both (see decoderlm/cli/serve.py).
        streamer = Streamer()
        model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
        yield from streamer.stamped

    return run


def llamacpp_engine(gguf: Path, threads: int, n_ctx: int = 1024) -> Engine | None:
    try:
        from llama_cpp import Llama
    except (ImportError, OSError):
        return None
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, verbose=False)

    def run(ids: list[int], n: int) -> Iterable[int]:
        llm.reset()  # no prompt reuse between runs
        for i, tok in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i >= n:
                break
            yield tok

    return run


def measuring_env() -> dict[str, str]:
    """The environment of the `decoderlm` processes this script times: this checkout's decoderlm, and no
    compiled step built in the background while others are timed (a mode whose step the speed pass built,
    auto, uses it, as `chat` does from its second run; the others decode eagerly, as on a first run)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "DECODERLM_BACKGROUND_COMPILE": "off"}


def llamacpp_build() -> str | None:
    """The instruction sets llama.cpp was built for (its system info), or None without llama-cpp-python.
    LLAMA_CPP_LIB_PATH points llama-cpp-python at another build (e.g. an AVX2-only one for --isa avx2)."""
    try:
        import llama_cpp
    except (ImportError, OSError):
        return None
    info = llama_cpp.llama_print_system_info().decode()
    return f"{info.strip()} (from {os.environ.get('LLAMA_CPP_LIB_PATH', 'llama-cpp-python')})"


def faithful_modes() -> dict[str, bool]:
    """decoderlm engine name → whether quality.py found that mode faithful: perplexity within 1 % of fp32 and,
    where its answers part ran the mode, at least fp32's correct answers at every level; empty before
    quality.py has run."""
    if not QUALITY.is_file():
        return {}
    result = json.loads(QUALITY.read_text())
    levels = [level["modes"] for level in result.get("answers", {}).get("levels", {}).values()]

    def answers_as_fp32(mode: str) -> bool:
        return all(rows[mode]["correct"] >= rows["fp32"]["correct"] for rows in levels if mode in rows and "fp32" in rows)

    return {f"decoderlm {mode}": row["faithful"] and answers_as_fp32(mode) for mode, row in result["modes"].items() if row["engine"] == "decoderlm"}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def speed(gguf: Path, names: list[str], args: argparse.Namespace) -> tuple[dict[str, dict], str | None]:
    """The speed pass: every engine streams greedy tokens for the same prompt ids, interleaved within each
    repeat. Returns (a row per engine, the engine whose greedy tokens the others are compared with)."""
    _, tokenizer = load(gguf)
    ids = tokenizer.encode(TEXT)[: args.prompt_tokens]
    builders: dict[str, Callable[[], Engine | None]] = {
        **{name: (lambda kw=kw: decoderlm_engine(gguf, kw)) for name, kw in DECODERLM.items()},
        COMPILED: lambda: decoderlm_engine(gguf, MODES["auto"], compile=True),
        COMPILED_INT8_ACT: lambda: decoderlm_engine(gguf, MODES["int8-act"], compile=True),
        NO_AMX: lambda: without_amx(decoderlm_engine(gguf, MODES["auto"])),
        **{name: (lambda dt=dt: transformers_engine(gguf, dt)) for name, dt in TRANSFORMERS.items()},
        "llama.cpp": lambda: llamacpp_engine(gguf, args.threads),
    }
    engines: dict[str, Engine] = {}
    load_s: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        engine = builders[name]()
        load_s[name] = time.perf_counter() - t0
        if engine is None:
            print(f"{name}: llama-cpp-python is not installed or does not import (pip install llama-cpp-python) — skipped")
        else:
            engines[name] = engine

    for run in engines.values():  # warm-up
        timed(run(ids, 4))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, run in engines.items():
            ttft, rest, out = timed(run(ids, args.new_tokens))
            samples[name].append((len(ids) / ttft, (len(out) - 1) / rest))
            outputs[name] = out

    rows = {}
    for name, s in samples.items():
        rows[name] = {"prefill_tok_s": statistics.median(p for p, _ in s), "decode_tok_s": statistics.median(d for _, d in s),
                      "load_s": load_s[name]}
    ref_name = next((n for n in ("transformers", "decoderlm fp32") if n in outputs), None)
    reference = outputs.get(ref_name)
    print(f"\nSmolLM2-135M-Instruct, {len(ids)} prompt tokens, {args.new_tokens} greedy tokens, "
          f"{args.threads} threads, median of {args.repeats}; ratios are this engine's speed ÷ the other's")
    bases = [b for b in BASES if b in rows]
    header = "".join(f"{'÷ ' + b + ' (pre/dec)':>30}" for b in bases)
    print(f"{'engine':<20}{'load s':>7}{'prefill tok/s':>15}{'decode tok/s':>14}{header}{'same greedy tokens':>20}")
    for name, r in rows.items():
        for b in bases:
            r[f"vs_{b}_prefill"] = r["prefill_tok_s"] / rows[b]["prefill_tok_s"]
            r[f"vs_{b}_decode"] = r["decode_tok_s"] / rows[b]["decode_tok_s"]
        r["greedy_tokens_matching_reference"] = common_prefix(outputs[name], reference) if reference else None
        ratios = "".join(f"{r[f'vs_{b}_prefill']:>21.2f} / {r[f'vs_{b}_decode']:<6.2f}" for b in bases)
        print(f"{name:<20}{r['load_s']:>7.1f}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}{ratios}"
              f"{str(r['greedy_tokens_matching_reference']) + '/' + str(len(reference or [])):>20}")
    if ref_name:
        print(f"same greedy tokens: leading tokens identical to {ref_name}'s")
    return rows, ref_name


@dataclass
class ColdRun:
    first_output_s: float  # from the process's start to the first byte it prints
    peak_rss_mb: float  # the process's peak resident memory (ru_maxrss)


def cold_run(cmd: list[str]) -> ColdRun:
    """Run `cmd` in a fresh process (the worktree's decoderlm on its path); time its first printed byte
    and read its peak RSS from the kernel's account of the finished process. A forked child inherits
    its parent's peak RSS as its own starting point, and this process holds every engine's model, so
    `cmd` is started by a small launcher process (SPAWN) instead, whose peak is a few MB."""
    env = measuring_env()
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as rss:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-S", "-c", SPAWN, rss.name, *cmd], stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=env)
        first = proc.stdout.read(1)
        first_s = time.perf_counter() - t0
        proc.stdout.read()
        if proc.wait() != 0 or not first:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}): {err.read().decode()[-1000:]}")
        return ColdRun(first_s, int(rss.read()) * 1024 / 1e6)  # Linux reports ru_maxrss in KiB


def cold_commands(gguf: Path, names: list[str], threads: int) -> dict[str, list[str]]:
    chat = [sys.executable, "-m", "decoderlm", "chat", "--message", COLD_MESSAGE, "--max-new-tokens", "4", "--temperature", "0",
            "--threads", str(threads)]
    cmds = {IMPORTS_ONLY: [sys.executable, "-c", "import torch, decoderlm.cli; print('imported')"]}
    cmds |= {name: chat + cli_flags(DECODERLM[name]) for name in names if name in DECODERLM}
    if "llama.cpp" in names:
        try:
            import llama_cpp  # noqa: F401
        except (ImportError, OSError):
            print("llama.cpp: llama-cpp-python is not installed or does not import — left out of the cold-start pass")
        else:
            cmds["llama.cpp"] = [sys.executable, "-c", LLAMA_CPP_COLD, str(gguf), str(threads), COLD_MESSAGE]
    return cmds


def memory_account(cli_args: list[str]) -> dict[str, dict[str, float]]:
    """Where a `decoderlm` command's memory goes, stage by stage (imports, GGUF header, tokenizer,
    weights, fusing, KV cache, first forward, the rest of generation), in a fresh process: each stage's
    own peak RSS (VmHWM, reset after each stage) and the RSS it leaves. Linux only (/proc)."""
    env = measuring_env()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-c", STAGES, out.name, *cli_args], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"memory account of `decoderlm {' '.join(cli_args)}` failed: {proc.stderr[-1000:]}")
        return json.loads(out.read())


def print_account(name: str, account: dict[str, dict[str, float]]) -> None:
    print(f"{name}: " + ", ".join(f"{stage} {a['peak_mb']:.0f}/{a['rss_mb']:.0f}" for stage, a in account.items()))


def cold(gguf: Path, names: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """The cold-start pass: each command `cold_runs` times, interleaved; medians, with the first run apart."""
    cmds = cold_commands(gguf, names, args.threads)
    runs: dict[str, list[ColdRun]] = {name: [] for name in cmds}
    for _ in range(args.cold_runs):
        for name, cmd in cmds.items():
            runs[name].append(cold_run(cmd))
    gguf_mb = gguf.stat().st_size / 1e6
    base = statistics.median(r.peak_rss_mb for r in runs[IMPORTS_ONLY])
    print(f"\ncold start: `decoderlm chat --message {COLD_MESSAGE!r} --max-new-tokens 4` in a fresh process, "
          f"median of {args.cold_runs} (first run apart: a one-off cost shows there)")
    print(f"{'engine':<28}{'first token s':>14}{'first run s':>13}{'peak RSS MB':>13}")
    rows = {}
    for name, rs in runs.items():
        rows[name] = {"first_output_s": statistics.median(r.first_output_s for r in rs), "first_output_s_first_run": rs[0].first_output_s,
                      "peak_rss_mb": statistics.median(r.peak_rss_mb for r in rs), "runs": [vars(r) for r in rs],
                      "command": " ".join(cmds[name][:2] + (["<script>"] if name == "llama.cpp" else cmds[name][2:]))}
        r = rows[name]
        print(f"{name:<28}{r['first_output_s']:>14.2f}{r['first_output_s_first_run']:>13.2f}{r['peak_rss_mb']:>13.0f}")
    print(f"memory target (issue 10): {IMPORTS_ONLY} ({base:.0f} MB) + 1.5 × the GGUF ({gguf_mb:.0f} MB) = {base + 1.5 * gguf_mb:.0f} MB, "
          "plus the KV cache")
    print("memory account, stage: peak/left MB (`chat` as above, one fresh process per mode)")
    accounts = {name: memory_account(cmds[name][3:]) for name in cmds if name in DECODERLM}  # past "python -m decoderlm"
    for name, account in accounts.items():
        print_account(name, account)
    return {"gguf_mb": gguf_mb, "rss_target_mb_without_kv": base + 1.5 * gguf_mb, "engines": rows, "memory_account": accounts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="speed-pass repeats (0: skip the speed pass)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--cold-runs", type=int, default=3, help="cold-start runs per engine (0: skip the cold-start pass)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for every engine (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: results/generate_speed[_ISA].json)")
    all_engines = [*DECODERLM, COMPILED, COMPILED_INT8_ACT, *([NO_AMX] if kernels.amx() else []), *TRANSFORMERS, "llama.cpp"]
    ap.add_argument("--engines", nargs="*", default=None, help=f"subset of: {', '.join(all_engines)}")
    ap.add_argument("--isa", choices=("native", *isa.LEVELS), default="native",
                    help="the CPU level the torch engines run at, as on a CPU that has no more (llama.cpp runs as built)")
    args = ap.parse_args()
    if args.isa != "native" and args.isa != isa.current():  # torch reads its level once: run again under it
        if args.isa not in isa.supported():
            raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
        os.execve(sys.executable, [sys.executable, *sys.argv], isa.env(args.isa))
    args.out = args.out or (RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}"))
    names = args.engines if args.engines is not None else all_engines
    unknown = [n for n in names if n not in all_engines]
    if unknown:
        raise SystemExit(f"unknown engine(s) {', '.join(map(repr, unknown))}; choose from {', '.join(all_engines)}")
    torch.set_num_threads(args.threads)
    gguf = locate(DEFAULT_MODEL)

    rows, reference = speed(gguf, names, args) if args.repeats > 0 else ({}, None)
    faithful = faithful_modes()
    fastest = max((n for n in rows if faithful.get(n)), key=lambda n: rows[n]["decode_tok_s"], default=None)
    if fastest:
        vs = f", {rows[fastest]['vs_llama.cpp_decode']:.2f}× llama.cpp" if "vs_llama.cpp_decode" in rows[fastest] else ""
        print(f"fastest faithful mode (per {QUALITY.name}): {fastest}, {rows[fastest]['decode_tok_s']:.1f} decode tok/s{vs}")
    elif rows:
        print(f"faithful modes unknown: run benchmarks/quality.py first (it writes {QUALITY.name})")
    cold_rows = cold(gguf, names, args) if args.cold_runs > 0 else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": DEFAULT_MODEL, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": args.threads, "machine": isa.describe(), "llama.cpp_build": llamacpp_build(), "torch": torch.__version__,
        "greedy_reference": reference, "engines": rows, "faithful": faithful, "fastest_faithful": fastest, "cold_start": cold_rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
