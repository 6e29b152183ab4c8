"""`decoderlm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batching engine.

The port is bound before the model loads, so a port in use is a one-line error at once. SIGTERM and
Ctrl-C stop the server cleanly (see `decoderlm.serve.api.serve`), and the command exits 0.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from decoderlm import compiled, isa
from decoderlm.cli.common import add_model_flags, add_model_source, compile_flags, load_model, model_source
from decoderlm.errors import DecoderLMError
from decoderlm.names import DEFAULT_MODEL
from decoderlm.tools.parsers import FORMATS

T = TypeVar("T")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache)",
                       epilog="Example: decoderlm serve --port 8000, then: curl http://127.0.0.1:8000/v1/models")
    add_model_source(p, default=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, printed at start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--max-batch", type=int, default=16, help="most sequences decoded together in one step")
    p.add_argument("--kv-cache-memory", default=None, help="KV-cache pool size, e.g. 512MiB, 1GiB, 2GB (default: the engine's)")
    p.add_argument("--tool-parser", choices=sorted(FORMATS), default=None,
                   help="the format tool calls are read in (default: the one the chat template teaches; generic without a tool section)")
    p.add_argument("--grammar-timeout", type=float, default=None,
                   help="seconds a request's JSON schema or tool grammar may take to compile before it is refused with a 400 (default: 5)")
    add_model_flags(p, quantize="auto", activations=None)
    add_compile_flag(p)
    p.set_defaults(func=cmd_serve)


def add_compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps through the compiled server step, built now if missing (once per model, pool and machine: "
                        "about a minute; cached in $DECODERLM_CACHE or ~/.cache/decoderlm; eager if compiling fails). Default: a "
                        "step built earlier is used; without one, the server decodes eagerly while `decoderlm compile --server` "
                        "builds it in the background, and switches to it when it is ready; --no-compile: always eager")


def serve_activations(args: argparse.Namespace, level: str | None = None) -> str:
    """--activations as given, or the server's default. Every batch size decodes in one arithmetic (a row's
    result must not depend on its company), so the default is the one fastest over the batch sizes at the
    CPU level torch runs at (`level`, default the process's): auto (int16, `chat`'s arithmetic) at AVX-512,
    where it is 1.1-1.6x faster than fp32 at every batch size (serve_step_avx512.json), and at AVX2, where it
    is 1.46x faster for one row and as fast in batches of 8 and 16 (serve_step_avx2_emulated.json), and with
    --max-batch 1, where every step is one row; fp32 at the plain level, whose batches of 16 run 1.4x faster
    in fp32 (serve_step_default.json)."""
    if args.activations:
        return args.activations
    return "auto" if args.max_batch == 1 or (level or isa.current()) in ("avx2", "avx512") else "fp32"


def server_compile_flags(args: argparse.Namespace) -> list[str]:
    """The flags that make `decoderlm compile --server` build the step this server's engine uses."""
    memory = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory is not None else []
    resolved = argparse.Namespace(**vars(args) | {"activations": serve_activations(args)})
    return [*compile_flags(resolved), "--server", "--max-batch", str(args.max_batch), *memory]


def parse_size(text: str) -> int:
    """'512MiB' → bytes. Decimal (KB, MB, GB) and binary (KiB, MiB, GiB) units; a bare number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or float(m.group(1)) * UNITS[unit] < 1:
        raise DecoderLMError(f"--kv-cache-memory {text!r} is not a size; write e.g. 512MiB, 1GiB or 2GB")
    return int(float(m.group(1)) * UNITS[unit])


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise DecoderLMError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DecoderLMError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    return sock


def in_passing_thread(work: Callable[[], T]) -> T:
    """work() in a thread that ends afterwards. OpenMP (libgomp) keeps a pool of worker threads for each
    thread that has run parallel work, and with more pooled threads than cores its workers stop spinning
    between parallel regions: a model loaded (and its KV pool filled) on the main thread and run on the
    engine's thread decoded at half speed. A thread's pool goes when the thread ends, so all torch work
    before the engine starts runs here and the engine's thread is left with the only pool."""
    with ThreadPoolExecutor(1, thread_name_prefix="decoderlm-load") as pool:
        return pool.submit(work).result()


def cmd_serve(args: argparse.Namespace) -> int:
    from decoderlm import names
    from decoderlm.image import ImageProcessor
    from decoderlm.quantize import BlockLinear
    from decoderlm.serve import Engine
    from decoderlm.serve.api import create_app, serve

    if args.grammar_timeout is not None and not args.grammar_timeout > 0:
        raise DecoderLMError(f"--grammar-timeout must be a positive number of seconds, got {args.grammar_timeout}")
    if args.max_batch < 1:
        raise DecoderLMError(f"--max-batch must be a positive integer, got {args.max_batch}")
    memory = parse_size(args.kv_cache_memory) if args.kv_cache_memory is not None else None
    args.activations = serve_activations(args)
    sock = bind(args.host, args.port)
    try:
        def build() -> tuple[Engine, object]:
            model, tokenizer = load_model(args)
            return Engine(model, max_batch=args.max_batch, kv_cache_memory=memory, compile=args.compile), tokenizer

        engine, tokenizer = in_passing_thread(build)
        step = engine.compiled
        if args.compile is None and step is not None and step.reason is None and not step.ready():
            compiled.build_later(step.path, server_compile_flags(args), "the compiled server step")
        model = engine.model
        folder = names.resolve(model_source(args))
        processor = ImageProcessor.from_folder(folder) if folder.is_dir() else ImageProcessor()
        app = create_app(engine, tokenizer, model_source(args), args.api_key, max_seq_len=model.config.max_seq_len,
                         sampling_defaults=model.generation_defaults, tool_parser=args.tool_parser, image_processor=processor,
                         grammar_timeout=args.grammar_timeout)
        layers = [m for m in model.modules() if isinstance(m, BlockLinear)]  # none: a float model
        if layers:
            decode, prompts = (" and ".join(sorted({getattr(m, name) for m in layers})) for name in ("activations", "prompt_activations"))
            print(f"decode steps in {decode} arithmetic, prompts in {prompts} (--activations)", file=sys.stderr, flush=True)
        pool = engine.pool
        print(f"KV cache: {pool.capacity // len(pool.groups) * pool.block_size:,} tokens, keys and values in {str(pool.dtype)[6:]} "
              "(--kv-cache-memory, --kv-cache)", file=sys.stderr, flush=True)
        host, port = sock.getsockname()[:2]
        print(f"serving {model_source(args)} on http://{host}:{port}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)
        engine.start()
        try:
            serve(app, engine, sock)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    print("server stopped", file=sys.stderr, flush=True)
    return 0
