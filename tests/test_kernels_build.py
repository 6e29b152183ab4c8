"""The kernels' own build: where they can be built, they must be. Every kernel test skips when
`kernels.available()` is false (no C compiler, another CPU), so a source that no longer compiles would
otherwise turn hundreds of tests into skips and the suite green."""

import os
import shutil

from decoderlm import isa, kernels


def test_the_kernels_build_wherever_an_x86_cpu_a_c_compiler_and_the_setting_allow():
    off = os.environ.get("DECODERLM_KERNELS", "on").lower() in ("0", "off", "no")
    buildable = not off and isa.X86 and kernels.level() is not None and shutil.which(os.environ.get("CC", "cc")) is not None
    assert kernels.available() == buildable, "decoderlm/kernels does not build (see the warning logged above)"
