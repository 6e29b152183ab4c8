"""--resume means what it says: exact continuation, refused setup changes, applied interval changes,
and an extension that never sends the learning rate back up."""

import dataclasses
import re
import shutil

import pytest
import torch
from conftest import corpus_text
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.train import TrainConfig, train, trainer
from decoderlm.train.config import FIELDS, FIXED, flag, resolve_new, resolve_resume
from decoderlm.train.state import TrainState

SMALL = dict(batch_size=4, context=16, eval_interval=10, log_interval=5, sample_chars=0, warmup=3)


def run(corpus, out, **overrides) -> dict:
    return train(TrainConfig(data=str(corpus), out=str(out), **{**SMALL, **overrides}))


def resume(out, **overrides) -> dict:
    return train(TrainConfig(out=str(out), resume=True, **overrides))


def history(out) -> list[tuple]:
    return [(r["step"], r["train_loss"], r["val_loss"], r["lr"]) for r in runs.read(out)["history"]]


def train_state(saved: dict) -> TrainState:
    state = TrainState()
    state.load_state_dict(saved)
    return state


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_killed_run_resumed_equals_an_uninterrupted_one(corpus, tmp_path, monkeypatch):
    """With dropout on, so the torch RNG matters as much as the batch sampler's: killed at step 23
    (3 steps after its last checkpoint), resumed, it must match the uninterrupted run step for step."""
    whole = run(corpus, tmp_path / "whole", max_steps=40, dropout=0.2)
    draws = 0
    real_batches = trainer.LMObjective.batches

    def killed_at_step_23(self):
        nonlocal draws
        draws += 1
        if draws == 24:
            raise KeyboardInterrupt
        return real_batches(self)

    monkeypatch.setattr(trainer.LMObjective, "batches", killed_at_step_23)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, tmp_path / "killed", max_steps=40, dropout=0.2)
    monkeypatch.undo()
    assert runs.read(tmp_path / "killed")["step"] == 20
    resumed = resume(tmp_path / "killed")
    assert history(tmp_path / "killed") == history(tmp_path / "whole")
    assert same_weights(resumed["model"], whole["model"])
    a, b = (runs.read(tmp_path / name) for name in ("whole", "killed"))
    assert all(torch.equal(x, y) for x, y in zip(a["rng"].values(), b["rng"].values()))
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg_sq"], b["optimizer"]["state"][0]["exp_avg_sq"])
    counters = [dataclasses.replace(train_state(s), history=[]) for s in (a, b)]  # the rows' speeds differ
    assert counters[0] == counters[1] and counters[0].tokens_seen == 40 * 4 * 16  # step, tokens, best val, window


def test_extending_a_finished_run_keeps_the_schedule_and_equals_a_run_planned_that_long(corpus, tmp_path, capsys):
    """20 steps, then --max-steps 30: the lr decays to min_lr at step 20 and stays there, exactly as a
    run started with --max-steps 30 --decay-steps 20; never a jump back up."""
    planned = run(corpus, tmp_path / "planned", max_steps=30, decay_steps=20, log_interval=1, lr=1e-3, min_lr=1e-4)
    run(corpus, tmp_path / "ext", max_steps=20, log_interval=1, lr=1e-3, min_lr=1e-4)
    capsys.readouterr()
    extended = resume(tmp_path / "ext", max_steps=30)
    err = capsys.readouterr().err
    assert "note: resuming with --max-steps 30 (the run had 20)" in err
    assert "note: steps 21-30 run at --min-lr 0.0001" in err
    lrs = [lr for *_, lr in history(tmp_path / "ext")]
    assert len(lrs) == 30 and lrs[20:] == [1e-4] * 10
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # after warmup: never rising, across the extension too
    assert history(tmp_path / "ext") == history(tmp_path / "planned")
    assert same_weights(extended["model"], planned["model"])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped at step 5 of 40: resumable."""
    root = tmp_path_factory.mktemp("resume")
    (root / "corpus.txt").write_text(corpus_text(), encoding="utf-8")
    run(root / "corpus.txt", root / "run", max_steps=40, stop_after=5)
    return root


def test_the_train_state_round_trips_through_a_checkpoint(stopped_run):
    saved = runs.read(stopped_run / "run")
    state = train_state(saved)
    assert (state.step, state.tokens_seen, state.window_steps) == (5, 5 * 4 * 16, 0)
    assert state.history == saved["history"] and state.best_val == float("inf")  # not evaluated yet
    assert train_state(state.state_dict()) == state
    assert state.describe(40) == "step 5 of 40, best val loss none yet, 320 tokens seen"


CHANGED = dict(data="other.txt", preset="llama-tiny", decay_steps=99, batch_size=5, context=8, lr=5e-4, min_lr=5e-5, warmup=7,
               weight_decay=0.0, beta1=0.8, beta2=0.9, grad_clip=0.5, dropout=0.1, seed=7, grad_accum=2, dtype="bfloat16",
               fsdp=True, config="model.json", set=["n_layers=3"], init_from="other-model", scheduled_sampling=0.3,
               optimizer="muon", muon_lr=0.05)


def test_every_fixed_setting_is_in_the_refusal_table():
    assert set(CHANGED) == {name for name, f in FIELDS.items() if f.metadata["on_resume"] == FIXED}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_changing_a_setting_the_run_was_built_with_is_refused(stopped_run, name):
    value = str(stopped_run / CHANGED[name]) if name == "data" else CHANGED[name]
    before = (stopped_run / "run" / "ckpt.pt").read_bytes()
    with pytest.raises(DecoderLMError, match=f"--{name.replace('_', '-')} {re.escape(str(value))} \\(the run's: "):
        resume(stopped_run / "run", **{name: value})
    assert (stopped_run / "run" / "ckpt.pt").read_bytes() == before


def test_all_differences_are_named_at_once(stopped_run):
    with pytest.raises(DecoderLMError, match="--batch-size 5 .*; --seed 7 "):
        resume(stopped_run / "run", batch_size=5, seed=7)


def test_the_run_own_values_and_run_settings_are_accepted(stopped_run, tmp_path, capsys, monkeypatch):
    """Fixed settings repeated with the run's values (the data by another path) are fine; interval
    changes apply with a note; --stop-after belongs to one invocation."""
    out = tmp_path / "run"
    shutil.copytree(stopped_run / "run", out)
    saved = TrainConfig(**runs.read(out)["train_config"])
    fixed = {name: getattr(saved, name) for name in CHANGED}
    monkeypatch.chdir(stopped_run)
    fixed["data"] = "corpus.txt"  # relative, the same file
    capsys.readouterr()
    result = resume(out, **fixed, max_steps=12, eval_interval=4, log_interval=2, eval_batches=1)
    err = capsys.readouterr().err
    for note in ("--max-steps 12 (the run had 40)", "--eval-interval 4 (the run had 10)", "--log-interval 2 (the run had 5)",
                 "--eval-batches 1 (the run had None)"):
        assert f"note: resuming with {note}" in err
    assert result["step"] == 12
    rows = runs.read(out)["history"]
    assert [r["step"] for r in rows if r["step"] > 5] == [6, 8, 10, 12]
    assert [r["step"] for r in rows if r["val_loss"] is not None and r["step"] > 5] == [8, 12]
    now = TrainConfig(**runs.read(out)["train_config"])
    assert {name: getattr(now, name) for name in CHANGED} == {name: getattr(saved, name) for name in CHANGED}
    assert (now.max_steps, now.eval_interval, now.log_interval, now.eval_batches, now.stop_after) == (12, 4, 2, 1, None)


def test_resuming_a_finished_run_asks_for_more_steps(stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run / "run", out)
    resume(out, max_steps=6)
    with pytest.raises(DecoderLMError, match="already at step 6; pass a --max-steps larger than 6"):
        resume(out)
    with pytest.raises(DecoderLMError, match="already at step 6"):
        resume(out, max_steps=3)
    with pytest.raises(DecoderLMError, match="--stop-after 6 is not after the run's step 6"):
        resume(out, max_steps=10, stop_after=6)  # would otherwise be ignored and the run go on to 10


@given(st.dictionaries(st.sampled_from(sorted(CHANGED)), st.booleans()))
def test_resume_refuses_exactly_the_fixed_settings_that_differ(choice):
    """Any mix of fixed settings, each given with the run's value or another: refused iff one differs,
    and the error names exactly those that differ."""
    saved = resolve_new(TrainConfig(data="corpus.txt", out="r", max_steps=40))
    given_values = {name: CHANGED[name] if differs else getattr(saved, name) for name, differs in choice.items()}
    differing = {flag(name) for name, differs in choice.items() if differs}
    try:
        cfg, _ = resolve_resume(TrainConfig(out="r", resume=True, **given_values), saved, step=5)
    except DecoderLMError as e:
        assert set(re.findall(r"(--[a-z0-9-]+) \S+ \(the run's: ", str(e))) == differing
    else:
        assert not differing
        assert all(getattr(cfg, name) == getattr(saved, name) for name in CHANGED)
