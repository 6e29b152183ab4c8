"""The tests marked `isa` (quantized kernels and packed layouts, compiled steps, SmolLM2 chat, the serving
engine) once more at every CPU dispatch level this machine can run besides its own: a child pytest whose
torch kernels, oneDNN and MKL are held to that level (decoderlm.isa). On an AVX-512 machine that is AVX2
and plain x86-64; a fast path that holds only on the CPU it was written on fails here.

At the plain level the kernels are unvectorized (a SmolLM2 forward over 512 tokens takes minutes), so the
tests marked `heavy` are left to the vectorized levels there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decoderlm import isa

REPO = Path(__file__).resolve().parents[1]
OTHER_LEVELS = [level for level in isa.supported() if level != isa.current()]


def test_the_level_in_force_is_the_one_asked_for():
    """A child started with isa.env(level) runs torch's kernels at that level."""
    for level in isa.supported():
        code = "from decoderlm import isa; print(isa.current())"
        out = subprocess.run([sys.executable, "-c", code], env=isa.env(level), capture_output=True, text=True, check=True).stdout
        assert out.strip() == level


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_isa_tests_pass_at_level(level):
    select = "isa and not slow" + (" and not heavy" if level == "default" else "")
    argv = [sys.executable, "-m", "pytest", "-m", select, "-q", "-p", "no:cacheprovider", "-x", "--timeout=900"]
    run = subprocess.run(argv, cwd=REPO, env=isa.env(level), capture_output=True, text=True)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in summary and " failed" not in summary, run.stdout[-8000:] + run.stderr[-2000:]
