"""The server's compiled decode step: one forward for every running sequence's next token, over the
paged pool, built ahead of time by AOTInductor and cached on disk like `decoderlm.compiled`'s step.

Why: an eager step pays PyTorch's and Python's cost per op (~50 ops a layer) however few rows it has;
on SmolLM2-135M with 2 threads that is about half of a one-row step. The compiled step runs the same
model code with no Python between its kernels: the quantized matmuls and the attention are decoderlm's
own kernels called as operators (`decoderlm::block_matmul`, `decoderlm::attend_paged`, which reads each
row's keys in the pool's blocks through its table), the rest is inductor's fused code.

One package serves every batch size up to max_batch (the batch is a dynamic dimension) and every
length: the rows' positions, write slots, block tables and lengths are tensor inputs. The pool's
tensors are the package's user-managed constants (no copy), so eager prefills and compiled decode steps
share one cache. A row's result does not depend on the other rows (every kernel on the way is
row-independent), so a sequence's tokens are the same alone or in a crowd; they may differ from the
eager step's in the last bits (inductor fuses the norms and the elementwise ops).

Models the step covers: fp32 ones with RoPE over full attention, with SDPA's options (no softcap,
sinks, sliding windows, MLA, images, M-RoPE or length-dependent RoPE); `unsupported` says why not. The
others, and any failure to build or load, stay on the eager step, which is always right.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import zipfile
from pathlib import Path

import torch
from torch import nn

from decoderlm import build_cache, compiled, kernels
from decoderlm.model import Transformer
from decoderlm.model.attention import Attention
from decoderlm.serve.paged_cache import BlockPool


class StepCache:
    """The `Cache` the compiled step traces: every row adds one token at `positions` (B, 1), written into
    pool slot `slots` (B,), and attends over its first `lens` (B,) keys, found through `tables` (B, W)."""

    traceable = True  # Attention calls the kernel as an operator inside the graph (`one_query_kernel`)

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor) -> None:
        self.k, self.v, self.block_size = k, v, block_size  # per layer (slots, Hkv, D)
        self.pos, self.slots, self.tables, self.lens = positions, slots, tables, lens

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return self.pos

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype,
             device: torch.device) -> None:
        return None  # each row's length bounds its keys

    def attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None, scale: float) -> torch.Tensor:
        """Write the rows' new k, v (B, Hkv, 1, D) into their slots, then attend (B, H, 1, Dv) in the pool."""
        pool_k, pool_v = self.k[layer], self.v[layer]
        pool_k.index_copy_(0, self.slots, k.reshape(k.shape[0], *pool_k.shape[1:]).to(pool_k.dtype))
        pool_v.index_copy_(0, self.slots, v.reshape(v.shape[0], *pool_v.shape[1:]).to(pool_v.dtype))
        return torch.ops.decoderlm.attend_paged(q, pool_k, pool_v, self.tables, self.lens, scale, self.block_size)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the compiled step attends through attend_one only")  # unsupported() keeps such models out

    def advance(self, n: int) -> None:
        pass  # the engine counts the tokens (Scheduler.computed)


class PagedStep(nn.Module):
    """What is exported: (tokens (B, 1), positions (B, 1), slots (B,), tables (B, W), lens (B,)) → logits
    (B, V), writing each layer's new k/v into the pool in place. The pool's tensors are registered here,
    so the package sees them as mutable constants."""

    def __init__(self, model: Transformer, pool: BlockPool) -> None:
        super().__init__()
        self.model, self.block_size, self.n = model, pool.block_size, len(pool.k)
        for i, (k, v) in enumerate(zip(pool.k, pool.v)):
            self.register_buffer(f"k{i}", k)
            self.register_buffer(f"v{i}", v)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                lens: torch.Tensor) -> torch.Tensor:
        view = StepCache([getattr(self, f"k{i}") for i in range(self.n)], [getattr(self, f"v{i}") for i in range(self.n)],
                         self.block_size, positions, slots, tables, lens)
        return self.model(tokens, positions=positions, cache=view, logits_to_keep=1).logits[:, -1]


def unsupported(model: Transformer) -> str | None:
    """Why the model's server step cannot be compiled, known before trying; None when it can be tried."""
    cfg = model.config
    if not kernels.available():
        return "decoderlm's CPU kernels are not available here"
    if model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return "the compiled server step is fp32 on the CPU"
    if cfg.position != "rope" or model.rope_by_length or cfg.mrope_section or model.visual is not None:
        return "the compiled server step needs plain RoPE positions and a text-only model"
    attentions = [block.self_attn for block in model.layers]
    if any(not isinstance(a, Attention) or a.softcap is not None or a.sinks is not None for a in attentions) or cfg.windows != [None]:
        return "the compiled server step covers full attention with SDPA's options (no MLA, softcap, sinks or windows)"
    return compiled.not_compilable(model)


RELEASED = Path(__file__).with_name("released_step.cpp")


@functools.cache
def released_steps():
    """The C++ module (`released_step.cpp`) that runs a package's model with Python's GIL released, built on
    first use (~30 s, once per machine and torch version, in the cache); None where it cannot be built (no
    C++ compiler): steps then hold the GIL for their whole call, as torch's own loader does."""
    from torch.utils import cpp_extension

    key = hashlib.sha256(RELEASED.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    folder = compiled.cache_dir() / f"released-{key}"
    path = os.environ.get("PATH", "")
    try:
        # cpp_extension runs `ninja` from PATH (in every process: it checks the build is current); the ninja
        # package's binary is not there when the virtual environment was not activated.
        os.environ["PATH"] = os.pathsep.join([*ninja_folder(), path])
        folder.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(f"decoderlm_released_{key}", [str(RELEASED)], build_directory=str(folder), extra_cflags=["-O2"])
        build_cache.use(folder)
        return module
    except Exception as e:  # noqa: BLE001 — torch's loader stays
        print(f"compiled server steps hold Python's GIL while they run ({compiled.one_line(e)})", file=sys.stderr, flush=True)
        return None
    finally:
        os.environ["PATH"] = path


def ninja_folder() -> list[str]:
    """The folder where the `ninja` package (a dependency) keeps its binary; none without the package."""
    try:
        import ninja
    except ImportError:
        return []
    return [ninja.BIN_DIR]


def load_released(path: Path, step: nn.Module):
    """The package at `path` run by `released_steps()`: its model's files (the .so, and the .json that names our
    operators) unpacked once beside it, every constant `step`'s own tensor in place. None without the module."""
    module = released_steps()
    if module is None:
        return None
    stat = path.stat()
    folder = path.with_name(f"{path.stem}.{stat.st_size}.{stat.st_mtime_ns}.model")  # a rebuilt package gets its own
    if not folder.is_dir():
        part = folder.with_suffix(f".{os.getpid()}.tmp")
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if "/data/aotinductor/model/" in name and not name.endswith("/"):
                    part.mkdir(parents=True, exist_ok=True)
                    (part / Path(name).name).write_bytes(archive.read(name))
        try:
            os.replace(part, folder)
        except OSError:  # another process unpacked it first
            shutil.rmtree(part, ignore_errors=True)
    (library,) = folder.glob("*.so")
    runner = module.Step(str(library))
    build_cache.use(path)
    state = compiled.own_tensors(step)
    runner.constants({name: state[fqn] for name, fqn in runner.fqns().items()})
    return runner


class CompiledPagedStep:
    """A model's compiled server step for one pool and batch limit: built once per machine (`build`), then
    loaded from the cache in every later process. `ready()` loads it when its package exists; calling it
    runs one decode step."""

    def __init__(self, model: Transformer, pool: BlockPool, max_batch: int, max_len: int) -> None:
        self.model, self.pool, self.max_batch = model, pool, max_batch
        self.width = -(-max_len // pool.block_size)  # block table entries per row: enough for max_len tokens
        shape = f"paged {pool.num_blocks}x{pool.block_size} rows {max_batch} table {self.width}"
        self.path = compiled.cache_dir() / f"{compiled.cache_key(model, shape)}.pt2"
        self.runner = None
        self.reason = unsupported(model) or compiled.earlier_failure(self.path)

    def ready(self) -> bool:
        """Whether the step can run: loaded now, if its package exists and loading it works."""
        if self.runner is None and self.reason is None and self.path.is_file():
            try:
                step = PagedStep(self.model, self.pool)
                try:
                    self.runner = load_released(self.path, step)
                except Exception as e:  # noqa: BLE001 — torch's loader, which holds the GIL, stays
                    print(f"the compiled server step will hold Python's GIL ({compiled.one_line(e)})", file=sys.stderr, flush=True)
                self.runner = self.runner or compiled.load_package(self.path, step)
                print(f"decode steps run through the compiled server step ({self.path.name})", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 — the eager step stays
                self.reason = compiled.one_line(e)
                print(f"compiled server step unavailable ({self.reason}); decoding eagerly", file=sys.stderr, flush=True)
        return self.runner is not None

    def build(self) -> bool:
        """Build the package if it is missing (minutes, once per model and machine); then `ready()`."""
        if self.reason is None and not self.path.is_file():
            print(f"compiling the server's decode step once for this model and machine (cached in {self.path.parent})",
                  file=sys.stderr, flush=True)
            try:
                self._compile()
            except Exception as e:  # noqa: BLE001 — the eager step stays (the failure recorded: not tried again)
                self.reason = compiled.one_line(e)
                print(f"compiled server step unavailable ({self.reason}); decoding eagerly", file=sys.stderr, flush=True)
        return self.ready()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of one decode step; inputs as `PagedStep.forward` takes them (tables (B, self.width))."""
        (logits,) = self.runner.boxed_run([tokens, positions, slots, tables, lens])
        return logits

    def _compile(self) -> None:
        B = min(2, self.max_batch)  # an example of more than one row, so the batch stays a dimension
        example = (torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                   torch.zeros(B, self.width, dtype=torch.long), torch.ones(B, dtype=torch.long))
        dynamic = None  # max_batch 1: one row, a static shape
        if self.max_batch > 1:
            batch = torch.export.Dim("batch", min=1, max=self.max_batch)
            dynamic = ({0: batch}, {0: batch}, {0: batch}, {0: batch}, {0: batch})
        compiled.build_package(self.path, self.model,
                               lambda: torch.export.export(PagedStep(self.model, self.pool), example, dynamic_shapes=dynamic))

