"""What decoderlm builds and keeps (~/.cache/decoderlm, or $DECODERLM_CACHE): its kernels' libraries
(`blocks-KEY.so`) and, under `compiled/`, compiled steps' packages (`KEY.pt2`, with their `KEY.log`, the
folders a server unpacks them into, `KEY.SIZE.MTIME.model`) and the GIL-releasing module (`released-KEY`);
and the environment switches that keep a build from being made or used (`switched_off`).

A new decoderlm version, a new torch or an edited source gives new keys, so without care the cache would
keep every build ever made (150 MB after a day of development). Each use stamps its entry (`use`: a
`KEY.used` file beside it, touched; the package itself keeps its mtime, which names its unpacked folder),
and each new build sweeps away the entries no run has used for KEEP_DAYS (`sweep`). An entry is every file
and folder whose name is its key or starts with its key and a dot; its last use is the newest mtime among
them.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

KEEP_DAYS = 30


def switched_off(variable: str) -> bool:
    """Whether the environment variable turns its build off: 0, off or no, in any case (unset: on)."""
    return os.environ.get(variable, "on").lower() in ("0", "off", "no")


def key(name: str) -> str:
    """The entry a cache file or folder belongs to: its name up to the first dot."""
    return name.split(".", 1)[0]


def use(path: Path) -> None:
    """Stamp the entry of `path` as used now (nothing where the cache cannot be written)."""
    try:
        (path.parent / f"{key(path.name)}.used").touch()
    except OSError:
        pass


def sweep(folder: Path, prefix: str = "", keep_days: float = KEEP_DAYS) -> list[str]:
    """Delete the entries in `folder` whose names start with `prefix` and whose last use (see above) is more
    than keep_days ago; the keys deleted."""
    entries: dict[str, list[Path]] = {}
    try:
        for p in folder.iterdir():
            if p.name.startswith(prefix):
                entries.setdefault(key(p.name), []).append(p)
    except OSError:
        return []
    cutoff, gone = time.time() - keep_days * 86400, []
    for name, paths in sorted(entries.items()):
        try:
            if max(p.lstat().st_mtime for p in paths) >= cutoff:
                continue
            for p in paths:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:  # another process is using or removing it: left for the next sweep
            continue
        gone.append(name)
    return gone
