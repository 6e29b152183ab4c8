"""A compiled one-token decode step: the model's forward over a `StaticKVCache`, built ahead of time by
AOTInductor into a shared library and cached on disk, so its one-off cost is paid once per model and
machine, not on every run.

Why: on a small model an eager step is bound by PyTorch's per-op overhead (~50 ops per layer), not by
reading the weights. A compiled step runs fused kernels with no Python between them. AOTInductor
rather than torch.compile because a later run only loads the library (~0.05 s); torch.compile traces
the model again in every process even when its kernels are cached on disk (measured: tens of seconds).

At run time the library computes with the model's own weights and cache buffers, handed to it as
user-managed constants (no copy). Only a model on torch's int4 kernel has its weights in the package too,
for the constants inductor derives from them (int4 weights repacked); that is why the key includes them.
One package serves every position (the position is a tensor input); it is built per cache size,
rounded up to a power of two (`bucket`), because its buffers' shapes are fixed. Its attention reads only the
filled slots, through the kernel's operator (`StaticKVCache.attend_one`; with windows, every slot under a
mask). Eager decoding stays the reference and the fallback: if
building or loading fails, `decode_step` is used and one line on stderr says why.

Where no package exists yet, `generate` and `chat` decode eagerly and start `decoderlm compile` for the
same model in a background process at the lowest priority (`lowest_priority`), so later runs find the
package; `--compile` builds it in the foreground instead, `--no-compile` never uses one,
DECODERLM_BACKGROUND_COMPILE=off builds none.
"""

from __future__ import annotations

import copy
import hashlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import decoderlm
from decoderlm import build_cache, kernels
from decoderlm.kv_cache import StaticKVCache
from decoderlm.model import Transformer
from decoderlm.model.moe import MoE
from decoderlm.quantize import Int4Linear

MIN_BUCKET = 256
# Code the compiled graph is made of: editing any of it must not reuse an old package.
SOURCES = ("model", "kv_cache.py", "quantize.py", "compiled.py", "kernels", "serve/compiled_step.py", "serve/paged_cache.py")


def cache_dir() -> Path:
    """Where packages live: under decoderlm's cache ($DECODERLM_CACHE, else ~/.cache/decoderlm)."""
    return kernels.cache_dir() / "compiled"


def bucket(n_tokens: int, max_seq_len: int) -> int:
    """The static cache size for a sequence of up to n_tokens: the next power of two ≥ MIN_BUCKET,
    capped at the model's context."""
    size = MIN_BUCKET
    while size < n_tokens:
        size *= 2
    return min(size, max_seq_len)


class CompileFailed(Exception):
    """A model whose step failed to compile before, on this machine with this code."""


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def not_compilable(model: Transformer) -> str | None:
    """Why the step cannot be compiled, known before trying; None when it can be tried."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if any(not t.is_floating_point() for t in [*moe.experts.parameters(), *moe.experts.buffers()]):  # integer weights: quantized
            # torch 2.13's AOTInductor leaves the constants it derives from quantized weights undeclared inside
            # torch.cond's branches (the wrapper fails to build), and the experts run in such branches (decoderlm.model.moe).
            return "quantized MoE experts do not compile yet; --quantize none compiles them"
    return None


def building(path: Path) -> bool:
    """Whether a background process is building the package `path` now (its pid in `path`.building)."""
    try:
        os.kill(int(path.with_suffix(".building").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def build_package(path: Path, model: Transformer, export: Callable[[], torch.export.ExportedProgram]) -> None:
    """Build the package `path` of the program `export()` gives for `model`: written whole or not at all. A
    failure is recorded in `path`.failed (not tried again on every run) and raised. Either way a background
    build's pid file goes, so that a later process given the same pid never passes for a build in progress;
    a new package sweeps away those no run has used for a month."""
    try:
        with torch.inference_mode(False), torch.no_grad():  # the buffers must be ordinary tensors to be exported
            program = export()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
            # Without the weights where none is derived from them (decoderlm's blocks go to its kernels as
            # they are): the package stays a few MB, and loading it reads no second copy of the model.
            own = not any(isinstance(m, Int4Linear) for m in model.modules())
            # emulate_precision_casts: a value cast to a lower precision inside a fused kernel is rounded as eager
            # rounds it (keys and values to fp16, `Attention.kv_dtype`); inductor would otherwise keep it in fp32.
            with torch._inductor.config.patch({"aot_inductor.package_constants_in_so": not own, "emulate_precision_casts": True}):
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent run never loads half a package
    except Exception as e:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".failed").write_text(one_line(e))
        raise
    finally:
        path.with_suffix(".building").unlink(missing_ok=True)
    build_cache.sweep(path.parent)


def earlier_failure(path: Path) -> str | None:
    """Why the package `path` failed to build before (`build_package` recorded it), with how to retry; None if
    it did not. A failed build is not tried again on every run."""
    failed = path.with_suffix(".failed")
    return f"{failed.read_text()} (earlier; delete {failed} to retry)" if failed.is_file() else None


def load_package(path: Path, step: nn.Module):
    """The package at `path`, computing with `step`'s own parameters and buffers: ours, user-managed (no
    copy), so the weights and cache buffers an eager forward writes are the ones it reads. The rest (e.g.
    int4 weights repacked at compile time) come from the package."""
    # The C++ loader itself: torch._inductor.aoti_load_package would import dynamo (~6 s) to wrap it.
    runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    build_cache.use(path)
    state = own_tensors(step)
    runner.load_constants({name: state[name] for name in runner.get_constant_fqns() if name in state}, False, False, True)
    return runner


def own_tensors(step: nn.Module) -> dict[str, torch.Tensor]:
    """`step`'s parameters and buffers by name (shared ones under every name): what a package's constants are."""
    return {**dict(step.named_parameters(remove_duplicate=False)), **dict(step.named_buffers(remove_duplicate=False))}


def build_later(path: Path, flags: list[str], what: str) -> None:
    """Start `decoderlm compile` with `flags` in the background (nice 19, its own session: it outlives this
    process) to build the package `path` for later, unless it is being built, failed before, or
    DECODERLM_BACKGROUND_COMPILE is off; one line on stderr says so."""
    if build_cache.switched_off("DECODERLM_BACKGROUND_COMPILE"):
        return
    if earlier_failure(path) or building(path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    command = [sys.executable, "-m", "decoderlm", "compile", *flags, "--threads", str(torch.get_num_threads())]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=lowest_priority)
    path.with_suffix(".building").write_text(str(process.pid))
    print(f"decoding eagerly; building {what} in the background (once for this model and machine; log: {log})",
          file=sys.stderr, flush=True)


def lowest_priority() -> None:
    """Run in a background build's process before it starts: nice 19 for the process and for its session's
    group. Linux schedules each session as a group (autogroup, on in most distributions' kernels) against the
    others, whatever its processes' nice values, so a build with its own session at nice 19 alone took half
    the CPU from the run that started it; the OpenMP threads of that run then waited on each other, and a
    128-token `generate` took 58-64 s instead of ~6 (docs/performance.md). Where there are no autogroups (or
    the kernel refuses), the process's nice value is what counts."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write("19")
    except OSError:
        pass


class DecodeStep(nn.Module):
    """What is exported: (token (B, 1), pos ()) → logits (B, V), writing k/v into the cache in place.
    The cache buffers are registered here, so the package sees them as mutable constants."""

    def __init__(self, model: Transformer, cache: StaticKVCache) -> None:
        super().__init__()
        self.model, self.view = model, copy.copy(cache)  # the view's lists are swapped while tracing; the cache's stay
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            self.register_buffer(f"k{i}", k)
            self.register_buffer(f"v{i}", v)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n = len(self.view.k)
        self.view.k = [getattr(self, f"k{i}") for i in range(n)]  # the traced buffers, not the originals
        self.view.v = [getattr(self, f"v{i}") for i in range(n)]
        self.view.pos = pos.clone()  # the caller advances the real position after the step
        return self.model(token, cache=self.view, logits_to_keep=1).logits[:, -1]


def cache_key(model: Transformer, shape: int | str) -> str:
    """A name for the package: it changes with the model's structure, weights, dtype and quantization,
    the cache's shape (`shape`: its size, or a description of a server's pool), decoderlm's model code,
    the torch version, the CPU and the thread count.

    The weights enter through their names, shapes, dtypes and a strided sample of their values (hashing
    every byte would add seconds to each start); the package reads the weights at run time anyway."""
    h = hashlib.sha256()
    root = Path(decoderlm.__file__).parent
    for name in SOURCES:
        for path in sorted(p for p in (root / name).rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h")) if (root / name).is_dir() else [root / name]:
            h.update(path.read_bytes())
    # Inductor writes the thread count into its CPU kernels, so --threads picks a package too.
    h.update(f"{torch.__version__} {platform.machine()} {torch.backends.cpu.get_cpu_capability()} "
             f"threads {torch.get_num_threads()} slots {shape}".encode())
    h.update(repr(model).encode())
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)].contiguous()
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


class CompiledDecoder:
    """A model's compiled decode steps, one per cache size, each built once per machine and reused: a
    `generate.Step`, so `stream(model, ids, params, step=CompiledDecoder(model))` decodes through it.

    `new_cache(n)` gives a static cache for n tokens; `step(token, cache)` is `generate.decode_step`
    through the compiled library. The library holds the cache's buffers, so each size has one cache,
    reused by the next request (its stale slots are masked): one stream at a time per model.
    build=False only loads packages built earlier, and decodes eagerly (silently) where there are none,
    unless `background` gives the `decoderlm compile` flags that load this same model: then a process
    started with them builds the missing package for later runs, and one line on stderr says so."""

    def __init__(self, model: Transformer, build: bool = True, background: list[str] | None = None) -> None:
        self.model, self.build, self.background = model, build, background
        self.runners: dict[int, object] = {}  # cache size → loaded package, or None when it failed
        self.caches: dict[int, StaticKVCache] = {}
        self.compiles = 0  # packages built by this process (tests check a second process builds none)

    def new_cache(self, n_tokens: int) -> StaticKVCache | None:
        """A fresh static cache for up to n_tokens, its package loaded (built first if missing);
        None when compiling failed and decoding must stay eager."""
        size = bucket(n_tokens, self.model.config.max_seq_len)
        if size not in self.runners:
            self.runners[size] = self._load(size)
        if self.runners[size] is None:
            return None
        cache = self.caches[size]
        cache.pos.zero_()
        return cache

    def step(self, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Feed one token per row (B,) at the cache's next position; return its logits (B, V)."""
        (logits,) = self.runners[cache.max_len].boxed_run([token[:, None], cache.pos])
        cache.advance(1)
        return logits

    def _load(self, size: int):
        path = cache_dir() / f"{cache_key(self.model, size)}.pt2"
        if not path.is_file() and not self.build:
            if self.background is not None:
                self._build_later(size, path)
            return None
        param = next(self.model.parameters())
        with torch.inference_mode(False):  # the buffers must be ordinary tensors to be exported
            cache = StaticKVCache(self.model.config, 1, size, dtype=param.dtype, device=param.device)
        try:
            if reason := not_compilable(self.model) or earlier_failure(path):
                raise CompileFailed(reason)
            if not path.is_file():
                print(f"compiling the decode step once for this model and machine (cached in {path.parent})",
                      file=sys.stderr, flush=True)
                self._compile(DecodeStep(self.model, cache), path)
            runner = load_package(path, DecodeStep(self.model, cache))
        except Exception as e:  # noqa: BLE001 — any failure leaves the eager path, which is always right
            print(f"compiled decoding unavailable ({e if isinstance(e, CompileFailed) else one_line(e)}); decoding eagerly",
                  file=sys.stderr, flush=True)
            return None
        self.caches[size] = cache
        return runner

    def _build_later(self, size: int, path: Path) -> None:
        """Start `decoderlm compile` for this model and cache size in the background (`build_later`)."""
        if not not_compilable(self.model):
            build_later(path, [*self.background, "--tokens", str(size)], "the compiled decode step")

    def _compile(self, step: DecodeStep, path: Path) -> None:
        """Export the step for one token and build its package."""
        param = next(self.model.parameters())
        example = (torch.zeros(1, 1, dtype=torch.long, device=param.device), torch.zeros((), dtype=torch.long, device=param.device))
        build_package(path, self.model, lambda: torch.export.export(step, example))
        self.compiles += 1

