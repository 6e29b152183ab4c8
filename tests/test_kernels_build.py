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


@pytest.mark.skipif(not isa.X86 or shutil.which(os.environ.get("CC", "cc")) is None, reason="the kernels are built for x86 with a C compiler")
def test_the_kernels_need_no_float16_type():
    """GCC 11 (Ubuntu 22.04's compiler) has no _Float16 on x86, and with it no kernel would build: the sources
    keep fp16 values as their bits (vec.h's `half`, `widen`, `narrow`). Each source, preprocessed at every
    level, has no _Float16 in any line of its own or of its headers (the compiler's headers may)."""
    cc = os.environ.get("CC", "cc")
    for level, (width, flags) in kernels.variants().items():
        for source, own in kernels.UNITS:
            proc = subprocess.run([cc, *kernels.FLAGS, *flags, *own, f"-DVL={width}", f"-DNAME={level}", "-E", str(source)],
                                  capture_output=True, text=True, check=True)
            origin, ours = "", []
            for line in proc.stdout.splitlines():
                if line.startswith("# "):  # a line marker: # LINE "FILE" FLAGS
                    origin = line.split('"')[1]
                elif Path(origin).parent == kernels.HERE and "_Float16" in line:
                    ours.append(line.strip())
            assert not ours, f"{source.name} at {level}: {ours[:3]}"
