"""The package's layering is a checked contract (`.importlinter`, run by import-linter): the server,
the decoding loops, the caches, the model, the weight formats and the config import only downwards;
so do fine-tuning, training, the loader (and inspect), the checkpoint formats, the model and the
tokenizer; and no two modules, nor two packages, import each other (not even inside a function)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_keep_the_layers():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")
