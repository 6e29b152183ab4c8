"""The kernels' own build: where they can be built, they must be. Every kernel test skips when
`kernels.available()` is false (no C compiler, another CPU), so a source that no longer compiles would
otherwise turn hundreds of tests into skips and the suite green."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from decoderlm import isa, kernels


def test_the_kernels_build_wherever_an_x86_cpu_a_c_compiler_and_the_setting_allow():
    off = os.environ.get("DECODERLM_KERNELS", "on").lower() in ("0", "off", "no")
    buildable = not off and isa.X86 and kernels.level() is not None and shutil.which(os.environ.get("CC", "cc")) is not None
    assert kernels.available() == buildable, "decoderlm/kernels does not build (see the warning logged above)"


@pytest.mark.parametrize("knows_amx", [True, False])
def test_a_compiler_without_amx_still_builds_the_vector_kernels(knows_amx, monkeypatch, tmp_path):
    """On a CPU with AMX the AVX-512 variant is built with AMX's flags; a compiler that refuses them (GCC < 11)
    gets a second build without them instead of no kernels at all."""
    monkeypatch.setattr(isa, "cpuinfo", lambda: ("a CPU", frozenset({"avx512f", "avx512_vnni", "amx_tile", "amx_int8"})))
    builds = []

    def compile_and_link(out: Path, levels: dict) -> None:
        builds.append(levels["avx512"][1])
        if not knows_amx and "-mamx-int8" in levels["avx512"][1]:
            raise subprocess.CalledProcessError(1, "cc", stderr="cc: error: unrecognized command-line option '-mamx-int8'")

    monkeypatch.setattr(kernels, "compile_and_link", compile_and_link)
    kernels.build(tmp_path / "k.so")
    assert [kernels.AMX[1] in flags for flags in builds] == ([True] if knows_amx else [True, False])
    assert all(kernels.VNNI[0] in flags for flags in builds)
