"""--optimizer muon: Muon trains the matrices inside the blocks, AdamW everything else; the run learns,
follows the schedule, and a killed run resumed equals an uninterrupted one (both optimizers' states saved)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.model import Transformer
from decoderlm.train import TrainConfig, train, trainer
from decoderlm.train.config import resolve_new
from decoderlm.train.optim import MuonAdamW, make_optimizer
from decoderlm.train.schedule import lr_at

SMALL = dict(batch_size=4, context=16, eval_interval=10, log_interval=5, sample_chars=0, warmup=3, eval_batches=1, optimizer="muon")


def run(corpus, out, **overrides) -> dict:
    return train(TrainConfig(data=str(corpus), out=str(out), **{**SMALL, **overrides}))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = Transformer(ModelConfig.from_preset("seed-char-llama", tie_embeddings=False))
    cfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1, beta1=0.9, beta2=0.99)
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())
    linear_in_blocks = {n + ".weight" for n, m in model.layers.named_modules(prefix="layers") if isinstance(m, nn.Linear)}
    assert muon == linear_in_blocks  # q/k/v/o, gate/up/down of every block
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= adamw
    assert opt.muon.param_groups[0]["lr"] == 0.02
    assert opt.muon.param_groups[0]["weight_decay"] * 0.02 == pytest.approx(0.1 * 1e-3)  # AdamW's shrink per step


def test_a_muon_run_learns_and_follows_the_schedule(corpus, tmp_path):
    run(corpus, tmp_path / "run", max_steps=40, log_interval=1, lr=3e-3, min_lr=3e-4, muon_lr=0.05)
    state = runs.read(tmp_path / "run")
    losses = [r["train_loss"] for r in state["history"]]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # from ~ln(vocab) well down: both optimizers move their weights
    groups = state["optimizer"]["muon"]["param_groups"]
    assert groups[0]["lr"] == pytest.approx(0.05 * lr_at(39, 3e-3, 3e-4, 3, 40) / 3e-3)  # the last step's scheduled fraction


def test_a_killed_muon_run_resumed_equals_an_uninterrupted_one(corpus, tmp_path, monkeypatch):
    whole = run(corpus, tmp_path / "whole", max_steps=30, dropout=0.1)
    draws = 0
    real_batches = trainer.LMObjective.batches

    def killed_at_step_13(self):
        nonlocal draws
        draws += 1
        if draws == 14:
            raise KeyboardInterrupt
        return real_batches(self)

    monkeypatch.setattr(trainer.LMObjective, "batches", killed_at_step_13)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, tmp_path / "killed", max_steps=30, dropout=0.1)
    monkeypatch.undo()
    assert runs.read(tmp_path / "killed")["step"] == 10
    resumed = train(TrainConfig(out=str(tmp_path / "killed"), resume=True))
    a, b = (runs.read(tmp_path / name) for name in ("whole", "killed"))
    curve = [[(r["step"], r["train_loss"], r["val_loss"], r["lr"]) for r in s["history"]] for s in (a, b)]
    assert curve[0] == curve[1]
    sa, sb = whole["model"].state_dict(), resumed["model"].state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for part, key in (("muon", "momentum_buffer"), ("adamw", "exp_avg_sq")):
        assert all(torch.equal(x[key], y[key]) for x, y in zip(a["optimizer"][part]["state"].values(),
                                                               b["optimizer"][part]["state"].values()))


def test_resume_refuses_another_optimizer(corpus, tmp_path):
    run(corpus, tmp_path / "run", max_steps=10)
    with pytest.raises(DecoderLMError, match="--optimizer adamw \\(the run's: muon\\)"):
        train(TrainConfig(out=str(tmp_path / "run"), resume=True, optimizer="adamw", max_steps=20))


@pytest.mark.parametrize("overrides, message", [
    (dict(optimizer="sgd"), "--optimizer 'sgd' is not supported; use one of adamw, muon"),
    (dict(optimizer="muon", muon_lr=0.0), "--muon-lr must be a positive number"),
    (dict(optimizer="muon", fsdp=True), "--optimizer muon needs each matrix whole"),
])
def test_bad_optimizer_settings_are_one_line_errors(corpus, tmp_path, overrides, message):
    with pytest.raises(DecoderLMError, match=message):
        resolve_new(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), **overrides))


def test_the_cli_has_the_flags(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "decoderlm", "train", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "--optimizer {adamw,muon}" in help_text and "--muon-lr" in help_text


def test_seed_char_plus_keeps_seed_char_s_budget_and_trains_with_muon(corpus, tmp_path):
    plus, gpt = (Transformer(ModelConfig.from_preset(name)) for name in ("seed-char-plus", "seed-char"))
    assert abs(plus.num_parameters() / gpt.num_parameters() - 1) <= 0.05
    cfg = resolve_new(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), preset="seed-char-plus"))
    assert (cfg.optimizer, cfg.batch_size, cfg.context, cfg.max_steps) == ("muon", 12, 64, 2000)
    assert plus.config.qk_norm
