"""A quantized GGUF stays quantized while it loads: peak memory (VmHWM of a fresh process, reset after
its imports) of loading a synthetic 24-layer Q4_1 file, over the same process's memory after importing
torch + decoderlm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from test_gguf import tokenizer_meta, write_gguf

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

REPO = Path(__file__).resolve().parents[1]
LAYERS, D, FFN, HEADS = 24, 512, 1536, 8
MB = 2**20

PROBE = """
import json, sys, torch
import decoderlm.formats.gguf, decoderlm.loader  # the baseline: interpreter, torch and decoderlm's code

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

path, mode = sys.argv[1], sys.argv[2]
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from here: the imports' own transient peak is not the baseline
model, _ = decoderlm.loader.load(path, quantize=None if mode == "float32" else mode)
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3, 4]]))
print(json.dumps({"extra": status("VmHWM") - base}))
"""


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory) -> Path:
    """A Llama-shaped GGUF as llama.cpp's Q4_1 files are: matrices Q4_1, the token embedding Q8_0 (tied), norms F32."""
    path = tmp_path_factory.mktemp("mem") / "q4.gguf"
    meta, vocab = tokenizer_meta()
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)

    tensors = [("token_embd.weight", matrix(vocab, D), Q.Q8_0), ("output_norm.weight", np.ones(D, np.float32), Q.F32)]
    for i in range(LAYERS):
        tensors += [(f"blk.{i}.attn_norm.weight", np.ones(D, np.float32), Q.F32), (f"blk.{i}.ffn_norm.weight", np.ones(D, np.float32), Q.F32)]
        tensors += [(f"blk.{i}.attn_{p}.weight", matrix(D, D), Q.Q4_1) for p in ("q", "k", "v", "output")]
        tensors += [(f"blk.{i}.ffn_gate.weight", matrix(FFN, D), Q.Q4_1), (f"blk.{i}.ffn_up.weight", matrix(FFN, D), Q.Q4_1),
                    (f"blk.{i}.ffn_down.weight", matrix(D, FFN), Q.Q4_1)]

    def hparams(w: GGUFWriter) -> None:
        w.add_block_count(LAYERS)
        w.add_context_length(256)
        w.add_embedding_length(D)
        w.add_feed_forward_length(FFN)
        w.add_head_count(HEADS)
        w.add_head_count_kv(HEADS)
        w.add_layer_norm_rms_eps(1e-5)

    write_gguf(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA], meta, tensors, hparams)
    return path


def extra_peak_rss(path: Path, mode: str) -> int:
    """Peak resident memory of loading `path` in a fresh process, over that process's after its imports."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path), mode], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra"]


@pytest.mark.parametrize(("mode", "files"), [("int4", 1.5), ("int8", 3.0)])
def test_quantized_load_peaks_under_the_issues_target(q4_file, mode, files):
    """int4, the fastest faithful mode, under the issue's target of 1.5x the file (the KV cache is nil
    here: no cache, 4 tokens; measured 1.44x); int8, whose 8-bit layers take twice int4's bytes, under
    twice that (measured 2.69x)."""
    size = q4_file.stat().st_size
    assert size > 40 * MB
    extra = extra_peak_rss(q4_file, mode)
    assert extra <= files * size, f"{mode} load took {extra / MB:.0f} MB over the interpreter for a {size / MB:.0f} MB file"


def test_float32_load_holds_the_model_once(q4_file):
    """No second copy of the model: the fp32 weights plus at most a quarter for one tensor's temporaries."""
    params = LAYERS * (4 * D * D + 3 * D * FFN) + tokenizer_meta()[1] * D
    extra = extra_peak_rss(q4_file, "float32")
    assert extra <= 1.25 * 4 * params, f"fp32 load took {extra / MB:.0f} MB for {4 * params / MB:.0f} MB of weights"
