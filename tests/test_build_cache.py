"""decoderlm's build cache (decoderlm/build_cache.py): each use stamps its entry, each build sweeps away the
entries no run has used for a month, the kernels' library stamps itself when it loads, and a build's switch reads
0, off or no as off."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from decoderlm import build_cache, kernels

DAY = 86400


def made(path: Path, days_ago: float, folder: bool = False) -> Path:
    """A file (or a folder with a file in it) last modified `days_ago` days ago."""
    if folder:
        path.mkdir()
        (path / "model.so").write_bytes(b"x")
    else:
        path.write_bytes(b"x")
    then = time.time() - days_ago * DAY
    os.utime(path, (then, then))
    return path


def test_an_entry_goes_whole_once_no_run_has_used_it_for_a_month(tmp_path: Path) -> None:
    """Every file and folder of an old entry goes (its package, log and unpacked folder); an entry as old but
    used last week stays, as does a new one."""
    old = [made(tmp_path / "aaa.pt2", 40), made(tmp_path / "aaa.log", 40), made(tmp_path / "aaa.123.456.model", 40, folder=True)]
    used = [made(tmp_path / "bbb.pt2", 40), made(tmp_path / "bbb.used", 7)]
    new = [made(tmp_path / "ccc.pt2", 1), made(tmp_path / "released-ddd", 1, folder=True)]
    assert build_cache.sweep(tmp_path) == ["aaa"]
    assert not any(p.exists() for p in old)
    assert all(p.exists() for p in used + new)


def test_a_use_stamps_the_entry_and_keeps_the_package_untouched(tmp_path: Path) -> None:
    """The stamp is a file beside the package: the package's own mtime names its unpacked folder."""
    package = made(tmp_path / "aaa.pt2", 40)
    before = package.stat().st_mtime_ns
    build_cache.use(package)
    assert package.stat().st_mtime_ns == before
    assert time.time() - (tmp_path / "aaa.used").stat().st_mtime < 60
    assert build_cache.sweep(tmp_path) == [] and package.exists()


def test_the_root_sweep_takes_only_kernel_libraries(tmp_path: Path) -> None:
    """In the cache's root only `blocks-*` entries are the kernels'; the `compiled` folder and anything
    else stay whatever their age."""
    library = made(tmp_path / "blocks-0123.so", 40)
    others = [made(tmp_path / "compiled", 40, folder=True), made(tmp_path / "notes.txt", 40)]
    assert build_cache.sweep(tmp_path, "blocks-") == ["blocks-0123"]
    assert not library.exists() and all(p.exists() for p in others)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler here")
def test_loading_the_kernels_stamps_their_library() -> None:
    library = Path(kernels.library()._name)  # in the cache that was $DECODERLM_CACHE when it loaded
    stamp = library.with_name(f"{library.name.split('.')[0]}.used")
    assert stamp.is_file() and time.time() - stamp.stat().st_mtime < 600


@pytest.mark.parametrize("value, off", [(None, False), ("on", False), ("1", False), ("yes", False), ("0", True),
                                        ("off", True), ("OFF", True), ("No", True)])
def test_a_switch_is_off_for_0_off_or_no(monkeypatch, value, off):
    if value is None:
        monkeypatch.delenv("DECODERLM_SOME_BUILD", raising=False)
    else:
        monkeypatch.setenv("DECODERLM_SOME_BUILD", value)
    assert build_cache.switched_off("DECODERLM_SOME_BUILD") is off
