"""The kernels' own build: where they can be built, they must be. Every kernel test skips when
`kernels.available()` is false (no C compiler, another CPU), so a source that no longer compiles would
otherwise turn hundreds of tests into skips and the suite green."""

import os
import shutil

import pytest

from decoderlm import isa, kernels


def test_the_kernels_build_on_an_x86_cpu_with_a_c_compiler():
    if os.environ.get("DECODERLM_KERNELS", "on").lower() in ("0", "off", "no"):
        pytest.skip("DECODERLM_KERNELS=off: torch's kernels by request")
    if not isa.X86 or kernels.level() is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no x86-64 CPU with SSE4.1, or no C compiler: the kernels are not built here")
    assert kernels.available(), "decoderlm/kernels does not build (see the warning logged above)"
