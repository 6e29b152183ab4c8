"""Training: schedule, batches, exact resume, crash-safe checkpoints."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.loader import load
from decoderlm.train import TrainConfig, checkpoint, train
from decoderlm.train.data import eval_windows, get_batch
from decoderlm.train.schedule import lr_at

SMALL = dict(batch_size=4, context=16, eval_interval=10, log_interval=5, sample_chars=0)


def small_run(corpus, out, **overrides) -> dict:
    return train(TrainConfig(data=str(corpus), out=str(out), **{**SMALL, **overrides}))


@given(st.integers(1, 50), st.integers(60, 500))
def test_schedule_warms_up_then_decays_to_min_lr(warmup, total):
    lrs = [lr_at(s, 1e-3, 1e-4, warmup, total) for s in range(total + 1)]
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1 : warmup + 1]))  # rising during warmup
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))  # then never rising
    assert math.isclose(lrs[warmup], 1e-3) and math.isclose(lrs[total], 1e-4)
    assert min(lrs[warmup:]) >= 1e-4 - 1e-12 and max(lrs) <= 1e-3


def test_batches_are_windows_with_targets_shifted_by_one():
    data = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(data, 8, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, 0], x[:, 0] + 1)
    xs = torch.cat([xb for xb, _ in eval_windows(data, 32, 5)])
    assert torch.equal(xs.flatten(), torch.arange(len(xs.flatten())))  # eval covers the split in order


def test_too_short_split_is_a_clear_error():
    with pytest.raises(DecoderLMError, match="fewer than context"):
        get_batch(np.arange(10, dtype=np.uint16), 2, 16, torch.Generator())


def test_resume_is_exact(corpus, tmp_path):
    """40 steps at once == 17 steps, stop, --resume for the rest: same losses, same final weights,
    optimizer moments and RNG streams (dropout on, so the torch RNG is drawn from as well as the sampler)."""
    whole = small_run(corpus, tmp_path / "whole", max_steps=40, dropout=0.1)
    half = small_run(corpus, tmp_path / "split", max_steps=40, stop_after=17, dropout=0.1)  # not at a log or eval step
    assert half["step"] == 17
    resumed = train(TrainConfig(data=None, out=str(tmp_path / "split"), resume=True))  # max_steps from the run

    def losses(run):
        return [(r["step"], r["train_loss"], r["val_loss"], r["lr"]) for r in runs.read(run)["history"]]

    assert resumed["step"] == 40
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    a, b = whole["model"].state_dict(), resumed["model"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == whole["val_loss"]
    ends = [runs.read(tmp_path / name) for name in ("whole", "split")]
    assert ends[0]["rng"].keys() == ends[1]["rng"].keys() == {"torch", "batch"}
    assert all(torch.equal(ends[0]["rng"][k], ends[1]["rng"][k]) for k in ends[0]["rng"])
    moments = [[s[m] for s in end["optimizer"]["state"].values() for m in ("exp_avg", "exp_avg_sq")] for end in ends]
    assert all(torch.equal(a, b) for a, b in zip(*moments))


def test_a_crash_while_saving_keeps_the_previous_checkpoint(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    small_run(corpus, out, max_steps=30, stop_after=10)
    before = runs.read(out)

    def crash(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")  # some bytes reach the disk, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(data=None, out=str(out), resume=True))
    monkeypatch.undo()
    after = runs.read(out)
    assert not (out / "ckpt.pt.tmp").exists()
    assert after["step"] == before["step"] == 10
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    model, _ = load(out)  # still usable
    assert model.config.max_seq_len == 16


def test_corrupt_checkpoint_is_a_clear_error(corpus, tmp_path):
    out = tmp_path / "run"
    small_run(corpus, out, max_steps=10)
    data = (out / "ckpt.pt").read_bytes()
    (out / "ckpt.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(DecoderLMError, match="corrupt"):
        load(out)
    with pytest.raises(DecoderLMError, match="corrupt"):
        train(TrainConfig(data=None, out=str(out), resume=True))


class _RunsCodeWhenUnpickled:
    """Unpickling this calls Path.touch(marker): the kind of payload a hostile ckpt.pt could carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_never_runs_pickled_code(corpus, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    small_run(corpus, out, max_steps=10)
    state = runs.read(out)
    checkpoint.save(out, state | {"payload": _RunsCodeWhenUnpickled(marker)})
    with pytest.raises(DecoderLMError, match="never unpickles code"):
        load(out)
    assert not marker.exists()


def test_training_lowers_the_loss_and_writes_the_run_folder(corpus, tmp_path):
    result = small_run(corpus, tmp_path / "run", max_steps=60, eval_interval=30)
    history = runs.read(tmp_path / "run")["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    assert result["val_loss"] < math.log(result["tokenizer"].vocab_size)  # better than uniform
    for name in ("ckpt.pt", "log.csv", "log.json", "loss.png", "train.bin", "val.bin"):
        assert (tmp_path / "run" / name).stat().st_size > 0


def test_starting_over_an_existing_run_is_refused(corpus, tmp_path):
    small_run(corpus, tmp_path / "run", max_steps=5)
    with pytest.raises(DecoderLMError, match="--resume"):
        small_run(corpus, tmp_path / "run", max_steps=5)
    with pytest.raises(DecoderLMError, match="already at step"):
        train(TrainConfig(data=None, out=str(tmp_path / "run"), resume=True))


def test_evaluation_follows_its_own_interval_whatever_the_log_interval(corpus, tmp_path):
    """eval every 6 steps, log every 4: val losses at 6 and 12 (not only at their common multiple 12)."""
    small_run(corpus, tmp_path / "run", max_steps=12, eval_interval=6, log_interval=4)
    rows = runs.read(tmp_path / "run")["history"]
    assert [r["step"] for r in rows] == [4, 6, 8, 12]
    assert [r["step"] for r in rows if r["val_loss"] is not None] == [6, 12]
