"""benchmarks/train_vs_nanogpt.py end to end, with a stand-in for nanoGPT's train.py (nanoGPT itself is
fetched outside the repository): both decoderlm configurations are measured against it, interleaved,
each with its ratio and its loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import corpus_text

ROOT = Path(__file__).resolve().parents[1]

# Prints what nanoGPT's train.py prints for iterations 0..max_iters (an evaluation at each multiple of
# eval_interval) and spends a little CPU time per iteration, so the long run takes longer than the short.
FAKE_TRAIN = """
import sys, time
opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
last, interval = int(opts["max_iters"]), int(opts["eval_interval"])
for it in range(last + 1):
    if it % interval == 0:
        print(f"step {it}: train loss 4.0000, val loss 4.1000")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.02:
        pass
    print(f"iter {it}: loss {4 - it / 1000:.4f}, time 20.00ms, mfu -100.00%")
"""


def fake_nanogpt(folder: Path) -> Path:
    (folder / "data" / "shakespeare_char").mkdir(parents=True)
    (folder / "data" / "shakespeare_char" / "prepare.py").write_text("")
    (folder / "config").mkdir()
    (folder / "config" / "train_shakespeare_char.py").write_text("")
    (folder / "train.py").write_text(FAKE_TRAIN)
    return folder


def test_fp32_eager_and_best_mode_are_each_compared_with_nanogpt_with_their_losses(tmp_path: Path) -> None:
    data = tmp_path / "shakespeare.txt"
    data.write_text(corpus_text(20_000), encoding="utf-8")
    out = tmp_path / "train_vs_nanogpt.json"
    proc = subprocess.run([sys.executable, "benchmarks/train_vs_nanogpt.py", "--nanogpt", str(fake_nanogpt(tmp_path / "nanogpt")),
                           "--data", str(data), "--short", "6", "--long", "10", "--repeats", "2", "--flags", "--dtype bfloat16",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    engines = ["nanogpt", "decoderlm_fp32_eager", "decoderlm_best_mode"]
    assert result["run_order"] == [engines, engines[::-1]]
    assert result["commands"]["decoderlm_fp32_eager"].startswith("decoderlm train --preset seed-char (")
    assert "--dtype bfloat16" in result["commands"]["decoderlm_best_mode"]
    assert set(result["ratio"]) == set(result["ratio_repeats"]) == set(engines[1:])
    for engine in engines[1:]:
        for kind in ("step", "wall", "cpu"):
            expected = result["tokens_per_s"][engine][kind] / result["tokens_per_s"]["nanogpt"][kind]
            assert abs(result["ratio"][engine][kind] - expected) < 0.01
        assert len(result["ratio_repeats"][engine]) == 2
    for engine in engines:
        assert len(result["repeats"][engine]) == 2
        losses = result["train_loss_last_steps"][engine]
        assert len(losses) == 2 and all(0 < loss < 6 for loss in losses)
    assert result["warm_up_wall_s"] == {}  # nothing compiled, nothing to warm
    assert "decoderlm_fp32_eager / nanogpt" in proc.stdout and "decoderlm_best_mode / nanogpt" in proc.stdout
