"""torchrun for real: 2 CPU processes (gloo) against 1 process with the same global batch.

Tolerance: the losses agree to 1e-4 and DDP's weights to 1e-5 (they differ only by float summation
order: DDP averages two half-batch gradients where one process averages one batch; observed
differences are ~1e-6 in the losses, ~3e-8 in the weights). Under plain SGD the weights move by
lr × the gradient, so equal weights mean equal gradients: a gradient summed over processes, or one
never exchanged, fails; AdamW's update would hide the first, being nearly the same for a gradient
twice as large.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import decoderlm
from decoderlm.formats import runs
from decoderlm.train import TrainConfig, train, trainer
from conftest import corpus_text

ROOT = Path(__file__).resolve().parents[1]
TOL, WEIGHTS_TOL = 1e-4, 1e-5
# 2 processes × batch 2 (or × 2 micro-batches of 1) = 1 process × batch 4; a tiny Llama so the run is all start-up time.
MODEL = ["--preset", "llama-tiny", "--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "n_kv_heads=1",
         "--set", "ffn_hidden=64"]
COMMON = dict(context=16, max_steps=8, eval_interval=4, log_interval=1, eval_batches=1, sample_chars=0)
TIMEOUT = ["--dist-timeout", "60"]  # a mismatch between processes fails in a minute instead of hanging
SGD_SETTINGS = dict(lr=0.2, min_lr=0.2, warmup=0, grad_clip=0)  # constant lr, no clipping: the update is lr × the gradient
SGD = """
import sys
import torch
from decoderlm.cli import main
from decoderlm.train import trainer

trainer.make_optimizer = lambda model, cfg, device: torch.optim.SGD(model.parameters(), lr=cfg.lr)
sys.exit(main())
"""


def flags(**settings) -> list[str]:
    return [part for k, v in settings.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def torchrun(*args: str, nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run: Path) -> list[tuple]:
    return [(r["step"], r["train_loss"], r["val_loss"], r["tokens_seen"]) for r in runs.read(run)["history"]]


def assert_close(a: list[tuple], b: list[tuple]) -> None:
    assert [(s, t) for s, *_, t in a] == [(s, t) for s, *_, t in b]  # same steps, same tokens seen
    for (_, ta, va, _), (_, tb, vb, _) in zip(a, b):
        assert abs(ta - tb) < TOL and (va is None) == (vb is None) and (va is None or abs(va - vb) < TOL)


def weights_differ(a: Path, b: Path) -> float:
    """The largest difference between two runs' final weights."""
    wa, wb = runs.read(a)["model"], runs.read(b)["model"]
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The corpus and the 1-process reference run (batch 4)."""
    root = tmp_path_factory.mktemp("dist")
    (root / "corpus.txt").write_text(corpus_text(20_000), encoding="utf-8")
    one_process(root, root / "one")
    return root


def one_process(root: Path, out: Path, **settings) -> None:
    """The reference: 1 process, batch 4, on the corpus in `root`."""
    sets = [MODEL[i + 1] for i in range(2, len(MODEL), 2)]
    train(TrainConfig(data=str(root / "corpus.txt"), out=str(out), preset="llama-tiny", set=sets, batch_size=4, **COMMON, **settings))


def test_ddp_two_processes_equal_one_process_with_the_same_global_batch(setup, tmp_path, monkeypatch):
    """Plain SGD, 2 processes × 2 micro-batches of 1 against 1 process × batch 4: the same gradient at every step."""
    (tmp_path / "sgd.py").write_text(SGD)
    torchrun(str(tmp_path / "sgd.py"), "train", "--data", str(setup / "corpus.txt"), "--out", str(tmp_path / "ddp"), *MODEL,
             *flags(batch_size=1, grad_accum=2, **COMMON, **SGD_SETTINGS), *TIMEOUT)
    monkeypatch.setattr(trainer, "make_optimizer", lambda model, cfg, device: torch.optim.SGD(model.parameters(), lr=cfg.lr))
    one_process(setup, tmp_path / "one", **SGD_SETTINGS)
    assert weights_differ(tmp_path / "ddp", tmp_path / "one") < WEIGHTS_TOL
    assert weights_differ(tmp_path / "one", setup / "one") > 1e-2  # the reference ran SGD: its weights are not AdamW's
    assert_close(losses(tmp_path / "ddp"), losses(tmp_path / "one"))
    assert losses(tmp_path / "ddp")[-1][3] == 8 * 4 * 16  # tokens seen: steps × global batch × context
    assert json.loads((tmp_path / "ddp" / "run.json").read_text())["global_batch"] == 4


def test_ddp_stopped_and_resumed_equals_an_uninterrupted_run(setup):
    out = str(setup / "ddp-resumed")
    torchrun("-m", "decoderlm", "train", "--data", str(setup / "corpus.txt"), "--out", out, *MODEL,
             *flags(batch_size=2, stop_after=3, **COMMON), *TIMEOUT)
    state = runs.read(out)
    assert state["step"] == 3 and state["world_size"] == 2 and len(state["rng"]["ranks"]) == 2
    torchrun("-m", "decoderlm", "train", "--out", out, "--resume", *TIMEOUT)
    assert_close(losses(Path(out)), losses(setup / "one"))
    assert weights_differ(Path(out), setup / "one") < WEIGHTS_TOL


def test_fsdp_matches_one_process_resumes_and_its_sharded_checkpoint_loads_in_one_process(setup):
    out = setup / "fsdp"
    torchrun("-m", "decoderlm", "train", "--data", str(setup / "corpus.txt"), "--out", str(out), "--fsdp", *MODEL,
             *flags(batch_size=2, stop_after=3, **COMMON), *TIMEOUT)
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["ckpt-3"]  # no evaluation yet, so no best
    torchrun("-m", "decoderlm", "train", "--out", str(out), "--resume", *TIMEOUT)
    assert_close(losses(out), losses(setup / "one"))
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["best-8", "ckpt-8"]  # older shards dropped
    sharded, _ = decoderlm.load(out)  # no process group here: the shards are read whole
    plain, _ = decoderlm.load(setup / "one")
    a, b = sharded.state_dict(), plain.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3


STALL = """
import os, sys, time
from decoderlm.cli import main
from decoderlm.train import trainer

real, calls = trainer.LMObjective.batches, 0

def stall_rank_1_at_step_6(self):
    global calls
    calls += 1
    if calls == 6 and os.environ["RANK"] == "1":
        time.sleep(120)  # a hung process, or a node that dropped off the network
    return real(self)

trainer.LMObjective.batches = stall_rank_1_at_step_6
sys.exit(main())
"""


def test_a_hung_process_is_a_clear_error_and_the_last_checkpoint_stays_intact(setup, tmp_path):
    (tmp_path / "stall.py").write_text(STALL)
    out = tmp_path / "run"
    done = torchrun(str(tmp_path / "stall.py"), "train", "--data", str(setup / "corpus.txt"), "--out", str(out), *MODEL,
                    *flags(batch_size=2, **COMMON), "--dist-timeout", "5", check=False)
    assert done.returncode != 0
    assert "rank 0: lost contact with the other processes" in done.stderr
    assert f"the last checkpoint in {out} (step 4) is intact; --resume continues from it" in done.stderr
    assert runs.read(out)["step"] == 4
