"""Weight-only quantization for fast CPU decoding: int8 and int4, with a scale per group of 32 inputs.

Decoding one token reads every weight once and does two flops with it, so its speed is the memory
bandwidth divided by the bytes of the weights: int8 reads 4x fewer bytes than fp32, int4 8x. The
Linear weights are quantized (the MoE router, being tiny and decisive, is kept) and the token
embedding is stored as int8 rows with one scale per 32 values; norms, attention and the KV cache keep
the model's dtype.

Where decoderlm's own kernels build (`decoderlm.kernels`: any x86-64 machine with a C compiler) a
layer is a `BlockLinear`: llama.cpp's Q4_1 / Q8_0 blocks, a file's as they are (Q4_0 being Q4_1 with
m = -8d), multiplied in fp32 (the float path's result up to the order of the sums) or with x rounded to
16 bits per block of 32 and integer dot products (the default's decode steps, and its prompts on
AVX512-VNNI: `round_activations`); a row's result is the same whatever else is in the batch.
`--activations int8` decodes as llama.cpp does, x rounded to int8 per block: faster, but it answered
3 of 78 questions fewer than fp32 (quality.json).

Elsewhere the layers run on PyTorch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`),
which are fast only in bf16 (their fp16 and fp32 paths are 20-30x slower in torch 2.13), so activations,
scales and outputs of a quantized matmul are bf16. Where a kernel is missing (another device, an older
torch) a layer dequantizes its weight for each call instead. That is also the fast way for many tokens at
once (a prompt's prefill): the kernels dequantize again for every few rows, so from DENSE_TOKENS tokens
per sequence on a packed layer dequantizes its weight once (exactly, rounded once to `dense_dtype()`) for
a dense matmul.

torch's packed layout depends on the CPU level torch runs at (`Layout`: tiles of 64 rows on AVX-512, 32
on AVX2 and plain x86-64); it is detected once per process, and everything that reads packed bytes
(the dense path, the tied embedding, stacking layers) goes through it. int8 weights have Q8_0's layout
and run through the int4 kernel as two 4-bit halves (`Int8GroupLinear`); the int8 kernel (one scale per
row) is left for shapes the int4 layout cannot take. The LM head is 8-bit in both modes, and its
logits leave it in fp32, the best candidates of each row computed exactly (`rescore`) with the weight's
own scales, kept in fp32 for it (`make_exact`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import kernels
from decoderlm.errors import DecoderLMError

MODES = ("int8", "int4")
GROUP = 32  # int4 and the int8 embedding: one scale (and zero point) per 32 inputs, like llama.cpp's blocks
COMPUTE = torch.bfloat16  # the kernels' activation dtype (the only one they are fast in)
CHUNK_ROWS = 4096  # rows converted at a time, so a large matrix never exists whole in fp32
PACK_ROWS = 1024  # rows packed at a time (the packing kernel takes int32: 4 bytes a value)


def kernel(name: str, device: torch.device) -> bool:
    """Whether PyTorch has the packed-weight CPU kernel `name` for a weight on `device`."""
    return device.type == "cpu" and hasattr(torch.ops.aten, name)


@dataclass
class Blocks:
    """A weight kept as a GGUF file stores it: each run of 32 inputs of a row shares a scale d and an
    offset m, w = q·d + m (Q4_1 as is; Q4_0 has m = -8d; Q8_0 has signed q and no m). Every field has
    the rows first, so row transforms (split, permute, one expert of a stack) apply to each alike."""

    q: torch.Tensor  # (..., N, K) uint8 0..15 (Q4) or int8 (Q8_0)
    d: torch.Tensor  # (..., N, K/32) fp32 (exact: the file's fp16)
    m: torch.Tensor | None  # (..., N, K/32) fp32, or None (symmetric)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def bits(self) -> int:
        return 8 if self.m is None else 4

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Blocks:
        return Blocks(fn(self.q), fn(self.d), None if self.m is None else fn(self.m))

    def split(self, sizes: list[int]) -> list[Blocks]:
        parts = [t.split(sizes) if t is not None else [None] * len(sizes) for t in (self.q, self.d, self.m)]
        return [Blocks(*fields) for fields in zip(*parts)]

    def unbind(self, dim: int = 0) -> list[Blocks]:
        return [self.map(lambda t, i=i: t.select(dim, i)) for i in range(self.q.shape[dim])]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight (..., N, K) these blocks stand for."""
        *lead, K = self.q.shape
        w = self.q.float().view(*lead, K // GROUP, GROUP) * self.d[..., None]
        if self.m is not None:
            w += self.m[..., None]
        return w.view(*lead, K)


Weight = torch.Tensor | Blocks


def dequantize(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, Blocks) else w.float()


def row_chunks(w: Weight) -> Iterator[torch.Tensor]:
    """The fp32 rows of w, CHUNK_ROWS at a time: converting a large weight (a 128k-token embedding)
    then needs fp32 temporaries for one chunk only."""
    for i in range(0, w.shape[0], CHUNK_ROWS):
        yield dequantize(w.map(lambda t: t[i : i + CHUNK_ROWS]) if isinstance(w, Blocks) else w[i : i + CHUNK_ROWS])


def row_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scale bf16 (N,)) for fp32 rows (N, K), scale = absmax/127 per row, rounded to
    bf16 first so that q is computed against the scale the kernel uses. (Clipping the largest values
    where that lowers a row's squared error made SmolLM2's perplexity worse, not better.)"""
    scale = (rows.abs().amax(dim=1).clamp(min=1e-12) / 127).to(COMPUTE)  # (N,)
    q = torch.round(rows / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x · (q · s)ᵀ + b, with q int8 (out, in) and one scale s per output row (symmetric). As the LM
    head (`exact`), it returns fp32 logits, its best candidates rescored (`rescore`)."""

    exact = False  # set on the LM head

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # (out, in) int8
        self.register_buffer("scale", scale.to(COMPUTE))  # (out,)
        self.bias = bias
        # ATen's packed kernel reads inputs 16 at a time: other widths crash it (a tiny model's 24-wide latent)
        self.fast = kernel("_weight_int8pack_mm", qweight.device) and qweight.shape[1] % 16 == 0

    @classmethod
    def from_weight(cls, w: Weight, bias: nn.Parameter | None = None) -> Int8Linear:
        """Per-row scales (from Blocks, rows are re-quantized from their exact values)."""
        parts = [row_int8(rows) for rows in row_chunks(w)]
        return cls(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(COMPUTE).reshape(-1, x.shape[-1])  # (N, in)
        if self.fast:
            y = torch.ops.aten._weight_int8pack_mm(h, self.qweight, self.scale)
        else:
            y = F.linear(h, self.qweight.to(COMPUTE) * self.scale[:, None])
        if self.exact:
            return rescore(y, x.reshape(h.shape), self.weight_rows, self.bias).view(*x.shape[:-1], -1)
        y = y.view(*x.shape[:-1], -1).to(x.dtype)  # (..., out)
        return y if self.bias is None else y + self.bias

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows `ids` (...) of the weight, exactly, in fp32 (..., in)."""
        return self.qweight[ids].float() * self.scale[ids].float()[..., None]


def pack_int4(q_chunks: Iterable[torch.Tensor], shape: tuple[int, int], fast: bool) -> torch.Tensor:
    """An int4 layer's qweight from its (out, in) = `shape` values 0..15, given as chunks of rows (so a
    large weight needs int32 temporaries for one chunk only), written into the one result: the kernel's
    tiled layout, two values per byte (row chunks of a multiple of 64 pack independently), or one value
    per byte."""
    N, K = shape
    packed = torch.empty(N, K // 2 if fast else K, dtype=torch.uint8)
    row = 0
    for c in q_chunks:
        packed[row : row + len(c)] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 8) if fast else c
        row += len(c)
    return packed


Rows = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    """How `_convert_weight_to_int4pack_for_cpu` lays out a weight (out, in), which depends on the CPU
    level torch's kernels run at (its tiles are as wide as four vectors of fp32). Rows go in tiles of
    `tile` rows (the last tile takes the remaining rows); a tile of t rows is stored as (in, t/2) bytes.
    In a full tile byte j holds rows j (low nibble) and t/2 + j (high) when `halves` (AVX2, AVX-512),
    rows 2j and 2j + 1 otherwise (the plain kernels); the last, partial tile always holds pairs."""

    tile: int
    halves: bool

    def owner(self, rows: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For row indices (...): the first row of their tile, its row count t, and where each row sits
        in it: byte j of a run of t/2, nibble u (0 low, 1 high)."""
        full = n_rows - n_rows % self.tile
        partial = rows >= full
        start = torch.where(partial, full, rows - rows % self.tile)
        t = torch.where(partial, n_rows - full, self.tile)
        r, half = rows - start, t // 2
        pairs = partial | (not self.halves)
        return start, t, torch.where(pairs, r // 2, r % half), torch.where(pairs, r % 2, r // half)


LAYOUTS = (Layout(64, True), Layout(32, True), Layout(32, False))  # AVX-512, AVX2, plain (torch 2.5-2.13)


@cache
def layout() -> Layout | None:
    """The layout this process's torch packs int4 in (checked once on a small weight), or None when it is
    none we know: then packed layers always use the kernel and nothing reads their bytes."""
    q = torch.randint(0, 16, (2 * 64 + 16, 2 * GROUP), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    return next((lay for lay in LAYOUTS if torch.equal(packed_t(packed, nibbles, lay), (q.t() - 8).to(COMPUTE))), None)


def packed_t(packed: torch.Tensor, rows: Rows, lay: Layout, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
    """The transposed weight values (in, out) of a weight packed in layout `lay`, (out, in/2) bytes.
    rows(bytes) gives the int8 values of the low-nibble rows and of the high-nibble rows from bytes
    (..., packed inputs, j)."""
    N, packed_in = packed.shape[0], packed.shape[1] * 2
    full, half = N - N % lay.tile, lay.tile // 2
    low, high = rows(packed[:full].view(full // lay.tile, packed_in, half))  # (tiles, K, t/2) each
    K = low.shape[1]
    w = torch.empty(K, N, dtype=dtype)
    if lay.halves:  # row tile·i + half·u + j
        into = w[:, :full].view(K, -1, 2, half)
        into[:, :, 0].copy_(low.transpose(0, 1))
        into[:, :, 1].copy_(high.transpose(0, 1))
    else:  # row tile·i + 2j + u
        into = w[:, :full].view(K, -1, half, 2)
        into[..., 0].copy_(low.transpose(0, 1))
        into[..., 1].copy_(high.transpose(0, 1))
    if full < N:
        low, high = rows(packed[full:].view(packed_in, (N - full) // 2))  # (K, t/2) each
        w[:, full:].view(K, -1, 2).copy_(torch.stack((low, high), -1))
    return w


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Rows `ids` (...) of a packed weight (out, in/2) as their 4-bit values (..., in), uint8 0..15."""
    N, K = packed.shape[0], packed.shape[1] * 2
    start, t, j, u = lay.owner(ids, N)
    index = (start * (K // 2) + j)[..., None] + torch.arange(K, device=ids.device) * (t // 2)[..., None]  # (..., K)
    return (packed.view(-1)[index] >> (4 * u).to(torch.uint8)[..., None]) & 15


def nibbles(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 layer's values q - 8 (int8 -8..7) in the low and high nibbles of bytes b."""
    return (b & 15).view(torch.int8).sub_(8), (b >> 4).view(torch.int8).sub_(8)


def q8_bytes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An Int8GroupLinear's values q = 16·h + l - 128 (int8) from bytes b whose inputs are h's, then l's:
    the byte 16·h + l, read as int8 after flipping its top bit."""
    h, l = b.chunk(2, dim=-2)
    return ((h << 4) | (l & 15)).bitwise_xor_(128).view(torch.int8), ((h & 240) | (l >> 4)).bitwise_xor_(128).view(torch.int8)


@cache
def dense_dtype() -> torch.dtype:
    """The dtype of a prefill's dense matmuls: bf16 where the CPU multiplies bf16 natively (AVX-512 BF16
    at the AVX-512 level), else fp32 (bf16 matmuls run ~10-100x slower there than fp32 ones)."""
    from decoderlm import isa

    return COMPUTE if isa.current() == "avx512" and torch.cpu._is_avx512_bf16_supported() else torch.float32


@cache
def kernels_vectorized() -> bool:
    """Whether the quantized layers' kernels are vectorized here: decoderlm's always are; torch's packed
    int4 kernel is scalar code on an x86-64 CPU below AVX2 (ATen's "default" level), far slower than
    fp32's BLAS, so without decoderlm's kernels `--quantize auto` keeps such a machine on the float path."""
    from decoderlm import isa

    return kernels.available() or not (isa.X86 and isa.current() == "default")


DENSE_TOKENS = 64  # from this many tokens per sequence in one forward (a prefill) packed layers multiply densely
EXACT_TOP = 32  # the LM head rescores this many best candidates of each row exactly in fp32 (OpenAI logprobs go to 20)


def tokens_per_sequence(x: torch.Tensor) -> int:
    """T of an input (B, T, in); the rows of a 2-D input (N, in) count as one sequence."""
    return x.shape[-2] if x.dim() >= 2 else 1


def rescore(y: torch.Tensor, h: torch.Tensor, weight_rows: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits (N, V) from a quantized head's bf16 ones y: each row's EXACT_TOP best recomputed
    exactly, fp32 input · fp32 weight rows. bf16 steps are 2^-8 of a value (0.125 at 25), so two
    candidates a float path tells apart can tie in bf16; the exact values break such ties as the float
    path does. Scores outside a row's top EXACT_TOP keep their bf16 value (they are far below the best,
    and move a probability by < 0.4 %)."""
    y, k = y.float(), min(EXACT_TOP, y.shape[-1])
    if not kernels.available():
        top = y.topk(k, dim=-1).indices  # (N, k)
    else:  # the same set but for ties at the k-th value, which go to the lower index there
        top = torch.ops.decoderlm.top_k(y.contiguous(), k) if torch.compiler.is_compiling() else kernels.top_k(y, k)
    exact = (weight_rows(top) * h.float()[:, None, :]).sum(-1)  # (N, k, in) · (N, 1, in) → (N, k)
    if bias is not None:
        exact = exact + bias.float()[top]
    return y.scatter(-1, top, exact)


def int4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights (out, in) on a 4-bit grid per 32 inputs, w ≈ q·scale + low: (q (out, in) 0..15, scale,
    low (out, in/32) fp32). Each group's [min, max] is split into 15 steps, the range shrunk where that
    lowers the group's squared error (a small search: outliers otherwise widen every step)."""
    N, K = w.shape
    groups = w.detach().float().reshape(N, K // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)  # (N, K/GROUP)
    best_err = q = scale = low = None
    for shrink in (1.0, 0.95, 0.9, 0.85, 0.8):
        mid, half = (hi + lo) / 2, (hi - lo) / 2 * shrink
        s, z = (2 * half / 15).clamp(min=1e-12), mid - half
        qs = torch.round((groups - z[..., None]) / s[..., None]).clamp(0, 15)
        err = (qs * s[..., None] + z[..., None] - groups).square().sum(-1)  # (N, K/GROUP)
        if best_err is None:
            best_err, q, scale, low = err, qs, s, z
            continue
        better = err < best_err
        best_err, scale, low = torch.where(better, err, best_err), torch.where(better, s, scale), torch.where(better, z, low)
        q = torch.where(better[..., None], qs, q)
    return q.reshape(N, K).to(torch.uint8), scale, low


class BlockLinear(nn.Module):
    """y = x · Wᵀ + b with W kept in llama.cpp's blocks of 32 inputs, Q4_1 (4-bit q, a scale d and an
    offset m per block: w = q·d + m) or Q8_0 (int8 q and d), multiplied by decoderlm's own kernels
    (`decoderlm.kernels`) in fp32: the result is the float path's up to the order of the sums, and a
    row's result does not depend on the other rows of the batch. From DENSE_TOKENS tokens per sequence
    (a prefill) the weight is dequantized to fp32 once for a BLAS matmul, the float path's own numbers
    (the fp32 kernel's cost grows with the rows; BLAS is faster from a few dozen), unless prompts are
    read in int16 (`prompt_activations`). As the LM head (`exact`) it returns its fp32 logits.

    With `activations` "int16" (the default where these kernels run, `round_activations`) or "int8"
    (`--activations int8`), x is rounded per block of 32 and integer products are summed (qdot.c):
    int8 is llama.cpp's arithmetic, 2-3x faster than fp32 for one row, with an error of up to 1/254 of a
    block's largest input; int16 (two int8 digits) nearly as fast for one row, and 256 times closer.
    The LM head then rescores each row's EXACT_TOP best candidates exactly in fp32 (`rescore`). A prompt,
    read inside `reading_prompt()`, and any forward of DENSE_TOKENS tokens a sequence take
    `prompt_activations`: "fp32", the float path's numbers, so the first token of a reply, which the prompt
    decides, is the float path's (SmolLM2's "The capital of France is Paris." starts with a 0.08-logit lead
    that int8 activations reverse); or "int16", set by `round_activations("auto")` where qdot.c's batch
    kernels beat BLAS (AVX512-VNNI): every chunk length then computes a row the same way. Decode steps and
    speculative checks round as `activations` says."""

    exact = False  # set on the LM head: fp32 logits whatever the model's dtype
    activations = "fp32"  # or x rounded to "int16" / "int8" outside prompts (qdot.c)
    prompt_activations = "fp32"  # prompts and forwards of DENSE_TOKENS tokens a sequence; or "int16" (`round_activations`)

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: nn.Parameter | None = None) -> None:
        """q (out, in): 4-bit values 0..15 (uint8) with offsets m, or int8 values with m None; d, m (out, in/32),
        kept in fp16 like llama.cpp's blocks (a file's values exactly; float weights' scales rounded once)."""
        super().__init__()
        if m is not None:  # two values a byte: inputs j and 16 + j of each block in the low and high nibbles of byte j
            halves = q.to(torch.uint8).view(q.shape[0], -1, 2, GROUP // 2)
            q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).flatten(1)
        self.register_buffer("blocks", q.contiguous())  # (out, in/2) uint8 or (out, in) int8
        self.register_buffer("block_scales", d.half().contiguous())  # (out, in/32), fp16 as in a file (exact for one)
        self.register_buffer("block_offsets", None if m is None else m.half().contiguous())  # (out, in/32)
        self.bias = bias

    @classmethod
    def from_blocks(cls, b: Blocks, bias: nn.Parameter | None = None) -> BlockLinear:
        """A file's blocks as they are (Q4_0's symmetric grid is Q4_1's with m = -8d)."""
        return cls(b.q, b.d, b.m, bias)

    @classmethod
    def from_weight(cls, w: Weight, bits: int, bias: nn.Parameter | None = None) -> BlockLinear:
        """Float weights on the 4-bit grid of `int4_grid`, or Q8_0's (`q8_blocks`)."""
        return cls(*int4_grid(dequantize(w)), bias) if bits == 4 else cls.from_blocks(q8_blocks(w), bias)

    def extra_repr(self) -> str:
        return f"{self.blocks.shape[1] * (2 if self.block_offsets is not None else 1)}, {self.out_features}, " \
               f"{'Q4_1' if self.block_offsets is not None else 'Q8_0'}, x {self.activations}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1]).float()  # (N, in)
        b = self._buffers  # one lookup for the three (a decode step calls ~120 of these layers)
        args = (b["blocks"], b["block_scales"], b["block_offsets"])
        long = tokens_per_sequence(x) >= DENSE_TOKENS
        rounded = self.prompt_activations if PROMPT[0] or long else self.activations
        if long and rounded == "fp32":  # a prefill: the fp32 weight once, then BLAS (the float path's numbers)
            y = h @ (torch.ops.decoderlm.block_dequantize(*args) if torch.compiler.is_compiling() else kernels.dequantize(*args)).T
        elif torch.compiler.is_compiling():
            y = OPERATORS[rounded](h, *args)
        else:  # eager steps: no operator lookup
            y = kernels.matmul(h, *args, rounded)
        if self.exact and rounded != "fp32":
            y = rescore(y, h, self.weight_rows, None)  # the bias is added below, to every output
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], -1)  # (..., out)
        if self.bias is not None:
            y = y + self.bias
        return y if self.exact else y.to(x.dtype)

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def q_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 values q (..., in) of output rows `ids` (...) of a Q8_0 layer."""
        return self.blocks[ids]

    def row_scales(self, ids: torch.Tensor) -> torch.Tensor:
        """The scales d (..., in/32), fp32, of output rows `ids` (...)."""
        return self.block_scales[ids].float()

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 weights (..., in) of output rows `ids` (...), as the kernels dequantize them."""
        flat = ids.reshape(-1)
        args = [None if t is None else t.index_select(0, flat) for t in (self.blocks, self.block_scales, self.block_offsets)]
        w = torch.ops.decoderlm.block_dequantize(*args) if torch.compiler.is_compiling() else kernels.dequantize(*args)
        return w.view(*ids.shape, -1)


OPERATORS = {"fp32": torch.ops.decoderlm.block_matmul, "int16": torch.ops.decoderlm.block_matmul_int16x,
             "int8": torch.ops.decoderlm.block_matmul_int8x}  # what a compiled graph calls, by the activations' rounding
PROMPT = [False]  # inside reading_prompt(); a list, so a compiled graph guards on its value


@contextmanager
def reading_prompt() -> Iterator[None]:
    """Forwards inside read a prompt: BlockLinear takes x as `prompt_activations` says (fp32 unless int16 is faster)."""
    outer, PROMPT[0] = PROMPT[0], True
    try:
        yield
    finally:
        PROMPT[0] = outer


ACTIVATIONS = ("auto", "fp32", "int16", "int8")


def round_activations(model: nn.Module, activations: str) -> int:
    """Set how the model's BlockLinear layers take x (`BlockLinear.activations`, `prompt_activations`); the
    number of layers set. "auto": int16 in decode steps, and in prompts too where that is faster than fp32
    BLAS (`kernels.integer_prompts`: AVX512-VNNI), else fp32 there; a named mode rounds decode steps only."""
    layers = [layer for layer in model.modules() if isinstance(layer, BlockLinear)]
    prompts = "int16" if layers and activations == "auto" and kernels.integer_prompts() else "fp32"
    for layer in layers:
        layer.activations = "int16" if activations == "auto" else activations
        layer.prompt_activations = prompts
    return len(layers)


def one_prompt_path(model: nn.Module) -> bool:
    """Whether the model's quantized layers compute a prompt's rows the same whatever the chunk: no packed
    layer multiplies densely from DENSE_TOKENS tokens a sequence (int16 prompts, or no quantized layer)."""
    return not any(isinstance(m, Int4Linear) or isinstance(m, BlockLinear) and m.prompt_activations == "fp32" for m in model.modules())


class Int4Linear(nn.Module):
    """4-bit weights: each group of 32 inputs of a row has its own scale and zero point (asymmetric,
    like Q4_1), w = (q - 8) · scale + zero with q in 0..15. Needs in % 32 == 0 and out % 16 == 0.

    When each sequence feeds DENSE_TOKENS tokens or more (a prefill) the weight is dequantized for the
    call (to `dense_dtype()`) and multiplied densely: the kernel dequantizes per few rows, so its cost
    grows with the rows, while dequantizing once costs about half a dense matmul of 128 rows. Fewer
    tokens (decoding, the server's batched steps, short prompts) keep the kernel. The choice goes by
    tokens per sequence, never by batch size, so a request gets the same numbers alone or in a batch.
    As the LM head (`make_exact`), the layer returns fp32 logits, its best candidates rescored (`rescore`)."""

    exact = False  # set on the LM head by make_exact

    def __init__(self, q: torch.Tensor | Iterable[torch.Tensor], scale: torch.Tensor, zero: torch.Tensor,
                 bias: nn.Parameter | None = None) -> None:
        """q (out, in) integers 0..15, or its rows in chunks of PACK_ROWS; scale, zero (out, in/32) in
        fp32 (rounded to bf16 here)."""
        super().__init__()
        sz = torch.stack((scale.to(COMPUTE), zero.to(COMPUTE)), -1).transpose(0, 1)  # (in/32, out, 2), the kernel's layout
        self.register_buffer("scales_zeros", sz.contiguous())
        self.register_buffer("exact_scales", None)  # the LM head's scales and zeros in fp32 (make_exact)
        self.bias = bias
        self.fast = kernel("_weight_int4pack_mm_for_cpu", scale.device)
        chunks = q.split(PACK_ROWS) if isinstance(q, torch.Tensor) else q
        self.register_buffer("qweight", pack_int4(chunks, (scale.shape[0], scale.shape[1] * GROUP), self.fast))

    @classmethod
    def from_blocks(cls, b: Blocks, bias: nn.Parameter | None = None) -> Int4Linear:
        """The file's own 4-bit grid: q·d + m = (q - 8)·d + (m + 8d), exact but for bf16 rounding of
        d and of m + 8d (a group's midpoint, near 0 for centred weights, so its rounding is small)."""
        return cls(b.q, b.d, b.m + 8 * b.d, bias)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: nn.Parameter | None = None) -> Int4Linear:
        q, scale, low = int4_grid(w)
        return cls(q, scale, low + 8 * scale, bias)  # the kernel's (q - 8)·scale + zero is low + q·scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # (N, in)
        if self.fast and (tokens_per_sequence(x) < DENSE_TOKENS or layout() is None):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(self.kernel_input(h.to(COMPUTE)), self.qweight, GROUP, self.scales_zeros)
            if self.exact:
                return rescore(y, h, self.weight_rows, self.bias).view(*x.shape[:-1], -1)
        else:  # a prefill: dequantizing once and a dense matmul beat the kernel's per-row dequantization
            dtype = torch.float32 if self.exact else dense_dtype()
            y = h.to(dtype) @ self.dense_t(dtype)
        y = y.view(*x.shape[:-1], -1).to(torch.float32 if self.exact else x.dtype)  # (..., out)
        return y if self.bias is None else y + self.bias

    def make_exact(self, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Make this layer the LM head: its logits leave it in fp32, each row's best candidates recomputed
        from the weight's own scale and zero (out, in/32), kept in fp32 (the kernel's are rounded to bf16:
        a Q4_1 scale is fp16, 3 mantissa bits finer, and those bits moved SmolLM2's greedy choice at
        0.6 % of positions)."""
        self.exact = True
        self.exact_scales = torch.stack((scale.float(), zero.float()), -1)  # (out, in/32, 2)

    def kernel_input(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def dense_t(self, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
        """The weight (in, out) in `dtype`: (q - 8)·scale + zero, computed in fp32 (exact) and rounded once."""
        q = packed_t(self.qweight, nibbles, layout(), dtype) if self.fast else self.qweight.t().to(dtype) - 8  # (K, N)
        K, N = q.shape
        sz = self.scales_zeros if self.exact_scales is None else self.exact_scales.transpose(0, 1)  # (K/32, N, 2)
        scale, zero = (t.contiguous()[:, None] for t in sz.unbind(-1))  # (K/32, 1, N)
        return torch.addcmul(zero, q.view(K // GROUP, GROUP, N), scale, out=q.view(K // GROUP, GROUP, N)).view(K, N)

    def q_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The 4-bit values q (..., in), 0..15, of output rows `ids` (...)."""
        return packed_rows(self.qweight, ids, layout()) if self.fast else self.qweight[ids]

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows `ids` (...) of the weight, exactly, in fp32 (..., in)."""
        q = self.q_rows(ids).float() - 8
        sz = self.exact_scales[ids] if self.exact_scales is not None else self.scales_zeros[:, ids].float().movedim(0, -2)
        scale, zero = sz.unbind(-1)  # (..., in/32) each
        return (q.unflatten(-1, (-1, GROUP)) * scale[..., None] + zero[..., None]).flatten(-2)


class Int8GroupLinear(Int4Linear):
    """8-bit weights with a scale per 32 inputs (Q8_0), exactly, run by the int4 kernel (the int8 one
    has a single scale per row). A value q in -128..127 is 16·h + l - 128 with 4-bit h and l, so
    W·x = H·x + L·x, H with scale 16d and zero 0, L with scale d and zero 8d: the kernel's
    (h - 8)·16d + (l - 8)·d + 8d is d·q, and 16d, 8d are exact in bf16 once d is. One int4 matmul
    over the input repeated, [H | L]·[x; x], rounds the output once and reads as many bytes as int8
    (it ran faster than the int8 kernel on SmolLM2's LM head). A prefill's dense weight is d·q itself,
    so the dense path pays off sooner than int4's (the kernel reads the input twice): 28-64 rows."""

    def __init__(self, b: Blocks, bias: nn.Parameter | None = None) -> None:
        d = b.d  # (out, in/32)
        chunks = (torch.cat((u >> 4, u & 15), 1) for u in (q.view(torch.uint8) ^ 128 for q in b.q.split(PACK_ROWS)))  # q + 128
        super().__init__(chunks, torch.cat((16 * d, d), 1), torch.cat((torch.zeros_like(d), 8 * d), 1), bias)

    def make_exact(self, d: torch.Tensor) -> None:
        """Make this layer the LM head (see Int4Linear.make_exact), keeping its scales d (out, in/32) in fp32."""
        self.exact = True
        self.exact_scales = d.float()  # (out, in/32)

    def kernel_input(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat((h, h), -1)

    def dense_t(self, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
        """The weight (in, out) in `dtype`: d·q, computed in fp32 (exact) and rounded once."""
        if self.fast:
            q = packed_t(self.qweight, q8_bytes, layout(), dtype)  # (K, N)
        else:
            h, l = self.qweight.to(torch.int16).chunk(2, dim=1)
            q = (16 * h + l - 128).t().to(dtype)
        K, N = q.shape
        d = self.row_scales(torch.arange(N)).t().contiguous()[:, None]  # (K/32, 1, N)
        return torch.mul(q.view(K // GROUP, GROUP, N), d, out=q.view(K // GROUP, GROUP, N)).view(K, N)

    def row_scales(self, ids: torch.Tensor) -> torch.Tensor:
        """The scales d (..., in/32), fp32, of output rows `ids` (...): the exact ones on the LM head."""
        if self.exact_scales is not None:
            return self.exact_scales[ids]
        return self.scales_zeros[self.scales_zeros.shape[0] // 2 :, ids, 0].float().movedim(0, -1)

    def q_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The 8-bit values q (..., in), int8, of output rows `ids` (...): 16·h + l - 128 from the h
        nibbles (the first half of the packed inputs) and the l nibbles (the second)."""
        h, l = super().q_rows(ids).to(torch.int16).chunk(2, dim=-1)
        return (16 * h + l - 128).to(torch.int8)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q_rows(ids).float()  # (..., in)
        d = self.row_scales(ids)  # (..., in/32)
        return (q.unflatten(-1, (-1, GROUP)) * d[..., None]).flatten(-2)


def q8_blocks(w: Weight) -> Blocks:
    """Float weights (out, in) rounded as Q8_0 would: int8 with a scale absmax/127 per 32 inputs."""
    parts = [group_int8(rows) for rows in row_chunks(w)]
    return Blocks(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), None)


def group_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's rule for fp32 rows (N, K): (q int8 (N, K), scale fp32 (N, K/32)), scale = absmax/127 per group."""
    groups = rows.view(rows.shape[0], -1, GROUP)
    d = groups.abs().amax(-1).clamp(min=1e-12) / 127
    return torch.round(groups / d[..., None]).to(torch.int8).flatten(1), d


class Int8Embedding(nn.Module):
    """Token embedding as int8 with one fp32 scale per 32 values of a row (Q8_0's layout, kept exact
    when the file is Q8_0): a lookup dequantizes only the rows it reads, in `dtype`. Given the tied
    LM head made from the same blocks (an Int8GroupLinear in the kernel's tiles), the int8 values are
    read from the head's bytes instead of being stored twice (SmolLM2: 28 MB)."""

    def __init__(self, w: Weight, dtype: torch.dtype, head: nn.Module | None = None) -> None:
        super().__init__()
        b = w if isinstance(w, Blocks) and w.bits == 8 else q8_blocks(dequantize(w))
        shared = (isinstance(head, Int8GroupLinear) and (not head.fast or layout() is not None)) or \
            (isinstance(head, BlockLinear) and head.block_offsets is None)
        self.tied = (head,) if shared else ()  # a tuple: the head stays the model's module, not a second child
        self.register_buffer("qweight", None if shared else b.q)  # (V, D) int8
        exact_head = shared and (isinstance(head, BlockLinear) or head.exact_scales is not None)  # the head keeps these very scales in fp32
        self.register_buffer("scales", None if exact_head else b.d.float())  # (V, D/32)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = b.q.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = (self.tied[0].q_rows(ids) if self.tied else F.embedding(ids, self.qweight)).float()  # (..., D)
        d = self.tied[0].row_scales(ids) if self.scales is None else F.embedding(ids, self.scales)  # (..., D/32)
        return (q.unflatten(-1, (-1, GROUP)) * d[..., None]).flatten(-2).to(self.dtype)


def int4_fits(shape: tuple[int, ...]) -> bool:
    out_features, in_features = shape
    return in_features % GROUP == 0 and out_features % 16 == 0


def quantized_linear(w: Weight, mode: str, bias: nn.Parameter | None = None) -> nn.Module:
    """The layer `mode` makes of weight w (out, in). int4: a file's Q4 blocks as they are, float
    weights on their own 4-bit grid. int8 and "q8" (the LM head in both modes): a file's Q8_0 blocks
    as they are, anything else rounded to Q8_0's grid (8 bits, a scale per 32 inputs: finer than one
    per row, and faster through the int4 kernel). Shapes the int4 layout cannot take: int8 per row.
    The LM head's layer returns fp32 logits (`rescore`)."""
    exact = mode == "q8"
    if kernels.available() and w.shape[1] % GROUP == 0:
        four = mode == "int4" or (exact and isinstance(w, Blocks) and w.bits == 4)
        layer = BlockLinear.from_blocks(w, bias) if isinstance(w, Blocks) and w.bits == (4 if four else 8) else \
            BlockLinear.from_weight(w, 4 if four else 8, bias)
        layer.exact = exact
        return layer
    if not int4_fits(tuple(w.shape)):
        layer = Int8Linear.from_weight(w, bias)
        layer.exact = exact
        return layer
    if isinstance(w, Blocks) and w.bits == 4 and mode in ("int4", "q8"):
        layer = Int4Linear.from_blocks(w, bias)
        if exact:
            layer.make_exact(w.d, w.m + 8 * w.d)
        return layer
    if mode == "int4" and not isinstance(w, Blocks):
        return Int4Linear.from_weight(w, bias)
    b = w if isinstance(w, Blocks) and w.bits == 8 else q8_blocks(w)
    layer = Int8GroupLinear(b, bias)
    if exact:
        layer.make_exact(b.d)
    return layer


def layer_mode(name: str, mode: str) -> str:
    """The mode for the Linear `name`: the LM head, whose logits pick the token, is Q8_0-like in both
    modes (per-row int8 there cost SmolLM2 +0.3 % perplexity, int4 +6 %; llama.cpp's Q4 files keep
    it at 6-8 bits too)."""
    return "q8" if name == "lm_head" else mode


def targets(model: nn.Module) -> set[str]:
    """Names of the Linear layers quantization replaces: all but those the model keeps in float (`kept_float`)."""
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not kept_float(m)}


def kept_float(layer: nn.Module) -> bool:
    """MoE routers (marked `router` by the model) and layers whose weight the model reads as a matrix (marked
    `keep_float`: MLA's kv_b_proj, folded into queries and outputs)."""
    return getattr(layer, "router", False) or getattr(layer, "keep_float", False)


def parse_mode(quantize: str | None) -> str | None:
    """`load`'s (and --quantize's) value, normalised once: one of MODES, "auto", or None for float weights
    ("none" is the CLI's spelling of None)."""
    if quantize in (None, "none"):
        return None
    if quantize not in (*MODES, "auto"):
        raise DecoderLMError(f"quantize {quantize!r} is not supported; use one of {', '.join(MODES)}, auto, none")
    return quantize


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise DecoderLMError(f"quantization {mode!r} is not supported; use one of {', '.join(MODES)}")


def quantized_layers(model: nn.Module, name: str, w: Weight, mode: str, dtype: torch.dtype,
                     bias: nn.Parameter | None = None) -> dict[str, nn.Module]:
    """The one rule for what the weight `name` of `model` becomes in `mode`: {module name: its quantized
    layer}; empty where it stays float. A Linear's weight (but a MoE router's): its quantized layer. The
    token embedding: an `Int8Embedding` in `dtype` and, when the LM head is tied to it, that head too,
    made from the same values, whose bytes the embedding reads (a tied head is made only here)."""
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if name == "embed_tokens.weight":
        head = quantized_linear(w, layer_mode("lm_head", mode)) if tied else None
        return ({"lm_head": head} if tied else {}) | {"embed_tokens": Int8Embedding(w, dtype, head)}
    owner, _, param = name.rpartition(".")
    module = model.get_submodule(owner)
    if param != "weight" or not isinstance(module, nn.Linear) or kept_float(module) or (tied and owner == "lm_head"):
        return {}
    return {owner: quantized_linear(w, layer_mode(owner, mode), bias)}


def quantize(model: nn.Module, mode: str) -> nn.Module:
    """Replace the model's Linear layers (attention, MLP, experts, LM head) by quantized ones and its
    token embedding by an int8 one, in place. int4 keeps int8 for shapes its layout cannot take."""
    check_mode(mode)
    names = [f"{name}.weight" for name in sorted(targets(model))]
    if isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        names.append("embed_tokens.weight")
    for name in names:
        module = model.get_submodule(name.rpartition(".")[0])
        weight = module.weight.detach()
        for owner, layer in quantized_layers(model, name, weight, mode, weight.dtype, getattr(module, "bias", None)).items():
            set_module(model, owner, layer)
    return model


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


# Stacking quantized layers, for decoderlm.model.fuse: the dimension of each tensor that runs over output rows
# (packed int4 rows stack exactly at tile boundaries).
ROW_DIM = {"qweight": 0, "scale": 0, "scales_zeros": 1, "bias": 0, "blocks": 0, "block_scales": 0, "block_offsets": 0}


def concat(layers: list[nn.Module]) -> nn.Module | None:
    """One quantized layer whose output rows are those of `layers` (Int8Linear, Int4Linear or Int8GroupLinear, one kind,
    one input size), in order. Each row keeps its own values and scales, so the outputs are unchanged.
    None where packed int4 rows cannot be stacked: a part other than the last ends inside a tile, or the
    layout is unknown."""
    first = layers[0]
    if isinstance(first, Int4Linear) and first.fast:
        lay = layout()
        if lay is None or any(layer.qweight.shape[0] % lay.tile for layer in layers[:-1]):
            return None
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    vars(fused).update({k: v for k, v in vars(first).items() if not k.startswith("_")})  # plain settings (fast, ...)
    for name, _ in first.named_parameters(recurse=False):
        setattr(fused, name, nn.Parameter(torch.cat([getattr(layer, name) for layer in layers], ROW_DIM[name]), requires_grad=False))
    for name, buf in first._buffers.items():  # unset ones (None) too: the fused layer has every attribute
        fused.register_buffer(name, None if buf is None else torch.cat([getattr(layer, name) for layer in layers], ROW_DIM[name]))
    return fused
