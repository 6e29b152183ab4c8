"""decoderlm's own CPU kernels: matmuls over llama.cpp's Q4_1 / Q8_0 blocks, and a decode step's attention.

A quantized layer reads each weight once per token, so its speed is the bytes it reads; what it
computes with them decides its answers. torch's packed int4 kernel is fast only in bf16 (activations,
scales and outputs rounded to 8 bits of mantissa) and its result for a row depends on how many rows
share the call. These kernels (`blocks.c`) unpack each block of 32 4- or 8-bit values to fp32 once,
multiply it with every row of fp32 activations and sum in fp32: the result is the float path's up to
the order of the sums, and a row's result never depends on the others. `qdot.c` multiplies the same
blocks as llama.cpp does, with x rounded to int8 per block of 32 and integer dot products: 2-3x faster
for one row, at the price of that rounding (`matmul(..., activations="int8")`; "int16" rounds 256 times
closer). `attention.c` attends one query per row over its cached keys (`attend_one`), read in place from
a contiguous cache or through a paged pool's block tables, each row's sums in one fixed order, and can
first rotate q and k and store k and v in the same call (`rope_attend_one`);
`norm.c` is RMSNorm (`rms_norm`): two small ops of a decode step that cost most in torch's dispatch;
`top_k.c` finds each row's k largest logits (`top_k`) for the LM head's exact rescoring.

These files are compiled on first use with the machine's C compiler, once for each
instruction set (AVX-512, with VNNI and AMX where the CPU has them; AVX2; SSE4.1), and linked with `ops.cpp` (the same kernels as torch operators, for compiled
steps) into a library cached under `~/.cache/decoderlm` (or `$DECODERLM_CACHE`); the variant that
runs is the level torch runs at (`decoderlm.isa`), so a process held to AVX2 runs the AVX2 code.
Eager code calls the kernels through ctypes (the GIL released); a compiled graph calls the operators.
Without a C/C++ compiler, on another architecture, or with `DECODERLM_KERNELS=off`, `available()` is
False and the layers use torch's kernels instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from decoderlm import build_cache, isa

HERE = Path(__file__).parent
# (source, its own flags): qdot.c twice, with int8 activations (x8) and with 16-bit ones in two int8 digits (x16)
UNITS = [(HERE / "blocks.c", []), (HERE / "qdot.c", ["-DDIGITS=1"]), (HERE / "qdot.c", ["-DDIGITS=2"]), (HERE / "attention.c", []),
         (HERE / "norm.c", []), (HERE / "top_k.c", [])]
OPS, HEADERS = HERE / "ops.cpp", sorted(HERE.glob("*.h"))  # the headers the C files share
# level -> (floats per vector, compiler flags): the instruction sets blocks.c is compiled for
VARIANTS = {"avx512": (16, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]), "avx2": (8, ["-mavx2", "-mfma", "-mf16c"]),
            "default": (4, ["-msse4.1"])}
VNNI = ["-mavx512vnni"]  # added to the AVX-512 variant on a CPU with AVX512-VNNI (vpdpbusd)
AMX = ["-mamx-tile", "-mamx-int8"]  # and AMX's, where the CPU has its tiles (and the compiler knows them: GCC 11, clang 12)
FLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off"]  # no contraction: a tile's every product is rounded as in every other
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("DECODERLM_CACHE") or Path.home() / ".cache" / "decoderlm")


def build(out: Path) -> None:
    """Compile blocks.c and qdot.c for every level in VARIANTS and ops.cpp against torch's stable ABI, and
    link them into the shared library `out`; where the compiler does not know AMX's flags (GCC < 11), without
    them (the vector kernels alone)."""
    try:
        compile_and_link(out, variants())
    except subprocess.CalledProcessError:
        if variants() == variants(amx=False):
            raise
        compile_and_link(out, variants(amx=False))


def compile_and_link(out: Path, levels: dict[str, tuple[int, list[str]]]) -> None:
    """`build` with these levels' flags."""
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    torch_dir = Path(torch.__file__).parent

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, text=True)

    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for level, (width, flags) in levels.items():
            for i, (source, own) in enumerate(UNITS):
                objects.append(f"{tmp}/{i}-{source.stem}-{level}.o")
                run(cc, *FLAGS, *flags, *own, f"-DVL={width}", f"-DNAME={level}", "-c", str(source), "-o", objects[-1])
        objects.append(f"{tmp}/ops.o")
        run(cxx, "-O2", "-fPIC", "-std=c++17", f"-I{torch_dir / 'include'}", "-c", str(OPS), "-o", objects[-1])
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(f".{os.getpid()}.tmp")  # linked beside `out`, then renamed: processes may race
        lib = torch_dir / "lib"
        run(cxx, "-shared", "-fopenmp", *objects, f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(part))
        os.replace(part, out)
    build_cache.sweep(out.parent, "blocks-")  # libraries no run has used for a month


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached on disk), or None where they cannot run here."""
    if build_cache.switched_off("DECODERLM_KERNELS") or not isa.X86 or level() is None:
        return None
    recipe = repr((variants(), [(source.name, own) for source, own in UNITS], FLAGS, os.environ.get("CC"), os.environ.get("CXX"), torch.__version__, torch.__file__))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sorted({*(source for source, _ in UNITS), OPS, *HEADERS})) + recipe.encode()).hexdigest()[:16]
    path = cache_dir() / f"blocks-{key}.so"
    try:
        if not path.exists():
            build(path)
        torch.ops.load_library(str(path))  # the operators' CPU kernels (their schemas are defined below)
        lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one the kernels share
        build_cache.use(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("decoderlm's CPU kernels could not be built (%s); using torch's kernels", " ".join(detail.split())[:200])
        return None
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p]
    for name in VARIANTS:
        for kind in ("q4", "q8"):
            for fn in (getattr(lib, f"{kind}{x}_matmul_{name}") for x in ("", "x8", "x16")):
                fn.argtypes, fn.restype = args, None
            fn = getattr(lib, f"{kind}_dequantize_{name}")
            fn.argtypes, fn.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p], None
        fn = getattr(lib, f"attend_one_{name}")
        fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, *([ctypes.c_void_p, *[ctypes.c_int64] * 3] * 2), ctypes.c_int64, ctypes.c_void_p,
                       *[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_float, ctypes.c_void_p]
        fn.restype = None
        fn = getattr(lib, f"rope_attend_one_{name}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p,
                       *([ctypes.c_void_p, *[ctypes.c_int64] * 3] * 2), ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                       ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_float, ctypes.c_void_p]
        fn.restype = None
        fn = getattr(lib, f"rms_norm_{name}")
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p], None
        fn = getattr(lib, f"top_k_{name}")
        fn.argtypes, fn.restype = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p], None
    lib.use_level(list(VARIANTS).index(level()))
    if level() == "avx512" and hasattr(lib, "amx_tiles"):
        lib.amx_tiles(int(not build_cache.switched_off("DECODERLM_AMX")))
    return lib


def variants(amx: bool = True) -> dict[str, tuple[int, list[str]]]:
    """VARIANTS as this machine builds them: VNNI's and AMX's flags where the CPU has them (amx=False: not AMX's)."""
    cpu = isa.cpuinfo()[1]
    extra = (VNNI if "avx512_vnni" in cpu else []) + (AMX if amx and {"amx_tile", "amx_int8"} <= cpu else [])
    return {name: (width, flags + extra if name == "avx512" else flags) for name, (width, flags) in VARIANTS.items()}


def amx(on: bool | None = None) -> bool:
    """Whether batches of 32 rows or more at the AVX-512 level multiply on AMX tiles (qdot.c; the same bits as
    without them); on=True or False switches them, where they exist (tests and benchmarks compare both).
    Off with DECODERLM_AMX=off."""
    lib = library()
    if lib is None or level() != "avx512" or not hasattr(lib, "amx_tiles"):
        return False
    return bool(lib.amx_tiles(-1 if on is None else int(on)))


def level() -> str | None:
    """The variant to run: the level torch runs at (SSE4.1 for its plain one, where the CPU has it)."""
    now = isa.current()
    if now == "default":
        return "default" if "sse4_1" in isa.cpuinfo()[1] else None
    return now if now in VARIANTS else None


def available() -> bool:
    return library() is not None


def integer_prompts() -> bool:
    """Whether 16-bit integer activations read prompts faster than fp32 BLAS here: the AVX-512 variant on a CPU
    with AVX512-VNNI (`vpdpwssd`): about twice the dequantize-and-BLAS prefill on a Zen 4. At AVX2 (`pmaddwd`)
    BLAS is faster from a few hundred tokens, so prompts stay fp32 there (`quantize.round_activations`)."""
    return level() == "avx512" and "avx512_vnni" in isa.cpuinfo()[1] and available()


@cache
def function(name: str) -> ctypes._CFuncPtr:
    """The entry point `name` (q4_matmul, q8_dequantize, ...) of the variant this process runs."""
    return getattr(library(), f"{name}_{level()}")


CACHE_DTYPES = (torch.float32, torch.float16)  # what attention.c reads keys and values as
ROUNDED = {"int16": "x16", "int8": "x8"}  # activations qdot.c rounds x to -> its entry points' infix


def matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, activations: str = "fp32") -> torch.Tensor:
    """x (M, K) fp32 · Wᵀ → (M, N) fp32, W given as blocks: Q4_1 (q (N, K/2) uint8 with inputs j and 16 + j
    of a block in the low and high nibbles of its byte j, scales d and offsets m (N, K/32) fp16) or Q8_0
    (q (N, K) int8, d, m None). activations "int16" or "int8": x rounded to 16 bits or int8 per block of
    32 and integer dot products (qdot.c); "fp32": x as it is (blocks.c)."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, q.shape[0], dtype=torch.float32)
    matmul_entry(m is None, activations)(x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                                          q.shape[0], y.data_ptr())
    return y


@cache
def matmul_entry(q8: bool, activations: str) -> ctypes._CFuncPtr:
    """The matmul entry point for Q8_0 (or Q4_1) blocks and these activations (a decode step calls ~120)."""
    return function(("q8" if q8 else "q4") + ROUNDED.get(activations, "") + "_matmul")


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The fp32 weight (N, K) of blocks given as to `matmul`: q·d (+ m), rounded as the float path rounds it."""
    N, K = q.shape[0], d.shape[1] * 32
    w = torch.empty(N, K, dtype=torch.float32)
    function("q8_dequantize" if m is None else "q4_dequantize")(q.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                                                                  N, K, w.data_ptr())
    return w


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of fp32 x (..., N) with fp32 weight w (N,) (norm.c): each row's
    sum of squares in one fixed order."""
    x = x.contiguous()
    y = torch.empty_like(x)
    function("rms_norm")(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], w.data_ptr(), eps, y.data_ptr())
    return y


def top_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (N, k) of each row's k largest values of fp32 y (N, V), 0 < k <= V (top_k.c): largest first,
    of equal values the lower index; a NaN counts as +inf. 3-4x faster than torch's topk over a vocabulary."""
    if y.dtype != torch.float32 or y.dim() != 2 or not 0 < k <= y.shape[1]:
        raise ValueError(f"top_k: y (N, V) fp32 and 0 < k <= V, got {tuple(y.shape)} {y.dtype} and k={k}")
    y = y.contiguous()
    out = torch.empty(y.shape[0], k, dtype=torch.long)
    function("top_k")(y.data_ptr(), y.shape[0], y.shape[1], k, out.data_ptr())
    return out


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               blocks: tuple[torch.Tensor, int, list[int]] | None = None) -> torch.Tensor:
    """Attention of one query per row (attention.c), fp32: q (B, H, 1, D) over keys k (B, Hkv, L, D) and
    values v (B, Hkv, L, Dv) → (B, H, 1, Dv); mask: additive (B or 1, 1, 1, L) or None. k and v are fp32 or
    both fp16 (an fp16 cache, read as fp32). Every row's sums run in one fixed order, so a row's result
    depends on nothing else in the batch.
    blocks=(table (B, W), block_size, lengths): k and v are a paged pool's slots (S, Hkv, D), row b's
    key l in slot table[b, l // block_size] · block_size + l % block_size, for l < lengths[b]."""
    B, H, _, D = q.shape
    if q.dtype != torch.float32 or (mask is not None and mask.dtype != torch.float32) or not k.dtype == v.dtype in CACHE_DTYPES:
        raise TypeError("attend_one computes in fp32: q and the mask must be float32, k and v both float32 or both float16")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    Hkv, Dv = k.shape[1], v.shape[-1]
    y = torch.empty(B, H, 1, Dv, dtype=torch.float32)
    function("attend_one")(q.data_ptr(), q.stride(0), q.stride(1), *_keys(k, v, mask, blocks, [k.shape[2]] * B), B, H, Hkv, D, Dv, scale,
                           y.data_ptr())
    return y


def rope_attend_one(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                    mask: torch.Tensor | None, scale: float, blocks: tuple[torch.Tensor, int, list[int]] | None = None) -> torch.Tensor:
    """A decode step's attention from a fused projection in one call (attention.c), fp32: rotates, in place,
    the query and key heads of qkv (B, H + 2·Hkv, D) by cos, sin (B or 1, 1, 1, rot) as `apply_rope_` does,
    writes row b's key and value heads as its key positions[b] (rounded to nearest even into an fp16 cache, as
    `Tensor.half` rounds), and attends as `attend_one` → (B, H, D).
    k, v and blocks as `attend_one` takes them: a contiguous cache's buffers (B, Hkv, S, D), every row over
    mask.shape[-1] keys, or a paged pool's slots with blocks=(table, block_size, lengths)."""
    B, heads, D = qkv.shape
    Hkv = k.shape[1]
    if not qkv.dtype == cos.dtype == sin.dtype == torch.float32 or (mask is not None and mask.dtype != torch.float32) or not k.dtype == v.dtype in CACHE_DTYPES:
        raise TypeError("rope_attend_one computes in fp32: qkv, cos, sin and the mask must be float32, the cache float32 or float16")
    if not (qkv.stride(2) == 1 and qkv.stride(1) == D and k.stride(-1) == v.stride(-1) == 1 and v.shape[-1] == D):
        raise ValueError("rope_attend_one: qkv (B, heads, D) with contiguous heads, and a cache of the heads' width, its rows contiguous")
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)  # (B or 1, rot): one row of angles per sequence
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    lengths = [mask.shape[-1]] * B if mask is not None else [p + 1 for p in positions]
    y = torch.empty(B, heads - 2 * Hkv, D, dtype=torch.float32)
    function("rope_attend_one")(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0) if cos.shape[0] > 1 else 0,
                                sin.stride(0) if sin.shape[0] > 1 else 0, cos.shape[-1], (ctypes.c_int64 * B)(*positions),
                                *_keys(k, v, mask, blocks, lengths), B, heads - 2 * Hkv, Hkv, D, scale, y.data_ptr())
    return y


def _keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, blocks: tuple[torch.Tensor, int, list[int]] | None,
          lengths: list[int]) -> tuple:
    """attention.c's arguments for the keys and values: k, its row, key and head strides; v's; 1 for an fp16
    cache (0: fp32); the block table,
    its width and block size (None, 0, 0 for a contiguous cache); each row's key count; the mask and its row
    stride. A contiguous cache's rows attend over `lengths`, a paged pool's over blocks' lengths."""
    if blocks is None:
        table, W, bs = None, 0, 0
        ks, vs = (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1))
    else:
        table, bs, lengths = blocks
        table, W = table.contiguous(), table.shape[1]
        ks, vs = (k.stride(0) * bs, k.stride(0), k.stride(1)), (v.stride(0) * bs, v.stride(0), v.stride(1))
    if mask is not None:
        mask = mask.reshape(mask.shape[0], mask.shape[-1])
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    return (k.data_ptr(), *ks, v.data_ptr(), *vs, int(k.dtype == torch.float16), None if table is None else table.data_ptr(), W, bs,
            (ctypes.c_int64 * len(lengths))(*lengths), None if mask is None else mask.data_ptr(),
            0 if mask is None or mask.shape[0] == 1 else mask.stride(0))


# The same kernels as operators a compiled graph can call (ops.cpp); eager code calls the functions above.
torch.library.define("decoderlm::block_matmul", "(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor")
torch.library.define("decoderlm::block_matmul_int8x", "(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor")
torch.library.define("decoderlm::block_matmul_int16x", "(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor")
torch.library.define("decoderlm::block_dequantize", "(Tensor q, Tensor d, Tensor? m) -> Tensor")
torch.library.define("decoderlm::top_k", "(Tensor y, int k) -> Tensor")
torch.library.define("decoderlm::attend_paged", "(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lens, float scale, int block_size) -> Tensor")


@torch.library.register_fake("decoderlm::block_matmul")
@torch.library.register_fake("decoderlm::block_matmul_int8x")
@torch.library.register_fake("decoderlm::block_matmul_int16x")
def _(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0], dtype=torch.float32)


@torch.library.register_fake("decoderlm::block_dequantize")
def _(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    return d.new_empty(q.shape[0], d.shape[1] * 32, dtype=torch.float32)


@torch.library.register_fake("decoderlm::top_k")
def _(y: torch.Tensor, k: int) -> torch.Tensor:
    return y.new_empty(y.shape[0], k, dtype=torch.long)


@torch.library.register_fake("decoderlm::attend_paged")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])
