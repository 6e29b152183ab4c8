"""Models and recipes: presets and config files, init from a model, accumulation, bf16, the optimizer's
groups, FLOPs accounting, best and last checkpoints."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from hf_models import make_hf_model
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import decoderlm
import decoderlm.cli
from decoderlm import isa
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.model import Transformer
from decoderlm.model.transformer import lm_loss
from decoderlm.train import TrainConfig, checkpoint, train, trainer
from decoderlm.train.data import read_windows, window_starts
from decoderlm.train.distributed import World
from decoderlm.train.objective import LMObjective
from decoderlm.train.trainer import flops_per_token, make_optimizer

SMALL = dict(batch_size=4, context=16, eval_interval=5, log_interval=1, eval_batches=1, sample_chars=0, max_steps=10)
TINY = ["n_layers=1", "d_model=32", "n_heads=2", "n_kv_heads=1", "ffn_hidden=64"]


def run(corpus, out, **settings) -> dict:
    return train(TrainConfig(data=str(corpus), out=str(out), **{**SMALL, **settings}))


def rows(out) -> list[dict]:
    return runs.read(out)["history"]


def test_seed_char_llama_has_seed_chars_parameter_count_within_5_percent():
    llama, gpt = (ModelConfig.from_preset(name) for name in ("seed-char-llama", "seed-char"))
    assert (llama.position, llama.norm, llama.mlp) == ("rope", "rmsnorm", "swiglu")
    n_llama, n_gpt = (Transformer(c).num_parameters() for c in (llama, gpt))
    assert abs(n_llama - n_gpt) / n_gpt <= 0.05


def test_accumulating_two_micro_batches_equals_one_batch_twice_as_large(corpus, tmp_path, monkeypatch):
    """The gradient each step applies, under plain SGD, is the same for batch 4 as for 2 micro-batches of 2: the
    micro-batches' gradients are averaged, not summed. (AdamW's update barely changes when the gradient is
    scaled, so comparing AdamW runs would not see a missing 1/grad_accum.)"""
    grads: dict[str, list[list[torch.Tensor]]] = {}

    class Recorded(torch.optim.SGD):
        def step(self, closure=None):
            grads[run_name].append([p.grad.clone() for p in self.param_groups[0]["params"]])
            return super().step(closure)

    monkeypatch.setattr(trainer, "make_optimizer", lambda model, cfg, device: Recorded(model.parameters(), lr=cfg.lr))
    sgd = dict(preset="llama-tiny", set=TINY, max_steps=3, eval_interval=3, lr=0.5, min_lr=0.5, warmup=0, grad_clip=0)
    for run_name, batches in (("one", dict(batch_size=4)), ("two", dict(batch_size=2, grad_accum=2))):
        grads[run_name] = []
        run(corpus, tmp_path / run_name, **sgd, **batches)
    for one, two in zip(grads["one"], grads["two"], strict=True):  # per step: every parameter's gradient
        for a, b in zip(one, two, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    assert len(grads["one"]) == 3 and min(g.abs().max().item() for g in grads["one"][-1]) > 1e-4  # real gradients
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "two"), strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-5 and a["tokens_seen"] == b["tokens_seen"]


def test_weight_decay_skips_norms_biases_and_embeddings():
    model = Transformer(ModelConfig.from_preset("seed-char"))  # learned positions, biases, LayerNorm, tied head
    cfg = TrainConfig(weight_decay=0.1, lr=1e-3, beta1=0.9, beta2=0.99)
    decayed, plain = make_optimizer(model, cfg, torch.device("cpu")).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert decayed_names == {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head" for n in [n + ".weight"]}
    assert {"embed_tokens.weight", "embed_positions.weight"} <= {names[id(p)] for p in plain["params"]}
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_flops_per_token_counts_every_matmul_weight_and_attention():
    config = ModelConfig.from_preset("seed-char")
    d, L, V, T = 128, 4, 65, 64
    per_layer = 4 * d * d + 2 * d * 4 * d  # q, k, v, o and the MLP's two matrices
    assert flops_per_token(Transformer(config), T) == 6 * (L * per_layer + V * d) + 12 * L * d * T


def test_bf16_autocast_trains_close_to_fp32_but_not_identically(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(isa, "native_bf16", lambda: True)  # autocast even where bf16 is emulated (slow, but tiny here)
    run(corpus, tmp_path / "a")
    run(corpus, tmp_path / "b", dtype="bfloat16")
    fp32, bf16 = rows(tmp_path / "a"), rows(tmp_path / "b")
    diffs = [abs(a["train_loss"] - b["train_loss"]) for a, b in zip(fp32, bf16)]
    assert 0 < max(diffs) < 0.05
    assert bf16[-1]["train_loss"] < bf16[0]["train_loss"]


def test_bf16_without_bf16_instructions_computes_in_fp32_and_says_so(corpus, tmp_path, monkeypatch, capsys):
    """Emulated bf16 matmuls are ~100x slower than fp32's: such a CPU trains --dtype bfloat16 in fp32."""
    monkeypatch.setattr(isa, "native_bf16", lambda: False)
    run(corpus, tmp_path / "a")
    run(corpus, tmp_path / "b", dtype="bfloat16")
    assert [r["train_loss"] for r in rows(tmp_path / "a")] == [r["train_loss"] for r in rows(tmp_path / "b")]
    notes = [line for line in capsys.readouterr().err.splitlines() if "bf16" in line]
    assert len(notes) == 1 and notes[0].endswith("so --dtype bfloat16 computes in float32")


def test_best_and_last_checkpoints_and_save_interval(corpus, tmp_path, monkeypatch):
    saves, real_save = [], checkpoint.save

    def save(out, state, name="ckpt.pt"):
        saves.append((state["step"], name))
        return real_save(out, state, name)

    monkeypatch.setattr(checkpoint, "save", save)
    run(corpus, tmp_path / "r", max_steps=12, eval_interval=6, save_interval=4)
    assert [s for s, n in saves if n == "ckpt.pt"] == [4, 6, 8, 12]
    best = runs.read(tmp_path / "r")["best_val"]
    assert runs.read_path(tmp_path / "r" / "best.pt")["history"][-1]["val_loss"] == best
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["parameters"] == Transformer(ModelConfig.from_dict(runs.read(tmp_path / "r")["config"])).num_parameters()
    assert rows(tmp_path / "r")[-1]["tokens_seen"] == 12 * 4 * 16


def test_config_file_with_set_overrides(corpus, tmp_path):
    path = tmp_path / "shape.json"
    ModelConfig.from_preset("llama-tiny").to_json(path)
    result = run(corpus, tmp_path / "r", config=str(path), set=TINY + ["qk_norm=true"], max_steps=2)
    config = result["model"].config
    assert (config.n_layers, config.d_model, config.qk_norm, config.max_seq_len) == (1, 32, True, 16)
    with pytest.raises(DecoderLMError, match="--set vocab_size is decided by the tokenizer"):
        run(corpus, tmp_path / "r2", set=["vocab_size=9"])
    with pytest.raises(DecoderLMError, match="not key=value"):
        run(corpus, tmp_path / "r3", set=["n_layers"])
    with pytest.raises(DecoderLMError, match="--preset and --config each choose the model"):
        run(corpus, tmp_path / "r4", preset="seed-char", config=str(path))


def test_init_from_a_run_continues_from_its_weights(corpus, tmp_path):
    base = run(corpus, tmp_path / "base", max_steps=30)
    result = run(corpus, tmp_path / "more", init_from=str(tmp_path / "base"), max_steps=2, lr=1e-9, min_lr=0, warmup=0)
    a, b = base["model"].state_dict(), result["model"].state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # a vanishing lr: the weights stay the loaded ones
    assert abs(rows(tmp_path / "more")[0]["train_loss"] - rows(tmp_path / "base")[-1]["train_loss"]) < 0.3


def test_init_from_an_hf_folder_trains_with_its_bpe_tokenizer_and_the_run_converts_back(corpus, tmp_path, capsys):
    make_hf_model("llama", tmp_path / "hf")
    hf_model, hf_tok = decoderlm.load(tmp_path / "hf")
    run(corpus, tmp_path / "run", init_from=str(tmp_path / "hf"), max_steps=3, context=8)
    model, tok = decoderlm.load(tmp_path / "run")
    assert model.config.vocab_size == hf_model.config.vocab_size and tok.encode("To be") == hf_tok.encode("To be")
    assert decoderlm.cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    again, _ = decoderlm.load(tmp_path / "back")
    ids = torch.tensor([tok.encode("To be, or not")])
    assert torch.allclose(again(ids).logits, model(ids).logits, atol=1e-4)


@pytest.mark.slow
def test_compile_trains_like_eager(corpus, tmp_path):
    """With inductor's kernels; test_train_speed.py's test_a_compiled_run_trains_like_the_eager_fp32_run is the short version."""
    run(corpus, tmp_path / "eager", max_steps=3)
    run(corpus, tmp_path / "compiled", max_steps=3, compile=True)
    for a, b in zip(rows(tmp_path / "eager"), rows(tmp_path / "compiled"), strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4


def test_init_from_the_embedded_gguf_starts_from_its_weights(corpus, tmp_path, monkeypatch):
    """Short version of the slow test below: one step at a vanishing lr from the GGUF (dequantized). The step's loss
    is the GGUF model's own on that batch, a pretrained model's (a random one's is ln 49152 ≈ 10.8), and the
    weights stay the GGUF's. No checkpoint is written (1.6 GB with AdamW's moments; the slow test loads one)."""
    gguf_model, _ = decoderlm.load("smollm2-135m-instruct")
    drawn, real_batches = [], LMObjective.batches

    def batches(self):
        drawn.append(real_batches(self))
        return drawn[-1]

    monkeypatch.setattr(LMObjective, "batches", batches)
    monkeypatch.setattr(checkpoint, "save", lambda *args: None)
    result = run(corpus, tmp_path / "run", init_from="smollm2-135m-instruct", max_steps=1, batch_size=1, context=8, lr=1e-9,
                 min_lr=0, warmup=0)
    (x, y), = drawn[0]
    with torch.no_grad():
        want = lm_loss(gguf_model(x).logits, y).item()
    assert abs(json.loads((tmp_path / "run" / "log.json").read_text())[0]["train_loss"] - want) < 1e-4 and want < 6
    a, b = result["model"].state_dict(), gguf_model.state_dict()
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
def test_init_from_the_embedded_gguf_dequantized(corpus, tmp_path):
    gguf_model, gguf_tok = decoderlm.load("smollm2-135m-instruct")
    result = run(corpus, tmp_path / "run", init_from="smollm2-135m-instruct", max_steps=1, batch_size=1, context=8, eval_interval=1)
    assert result["model"].config.n_layers == gguf_model.config.n_layers
    assert result["val_loss"] < 6  # a pretrained model, not a random one (ln 49152 ≈ 10.8)
    _, tok = decoderlm.load(tmp_path / "run")
    assert tok.encode("To be") == gguf_tok.encode("To be")


@given(st.lists(st.integers(0, 60), min_size=1, max_size=5), st.integers(1, 8), st.integers(0, 2**31))
def test_windows_lie_inside_one_shard(lengths, context, seed):
    split = [np.arange(n, dtype=np.uint16) + 1000 * i for i, n in enumerate(lengths)]
    if all(n <= context for n in lengths):
        with pytest.raises(DecoderLMError, match="fewer than context"):
            window_starts(split, 4, context, torch.Generator().manual_seed(seed))
        return
    x, y = read_windows(split, window_starts(split, 16, context, torch.Generator().manual_seed(seed)), context)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y - x, torch.ones_like(x))  # consecutive ids: never across a shard boundary (ids jump by ~1000)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_the_processes_micro_batches_partition_one_processs_batch(world_size, accum, batch):
    """What N processes with grad_accum A read in one step is exactly the windows of one process with batch N·A·B."""
    data = [np.arange(500, dtype=np.uint16)]
    cfg = TrainConfig(batch_size=batch, grad_accum=accum, context=8, seed=3)
    ranks = [LMObjective(data, data, cfg, World(r, world_size), torch.device("cpu")).batches() for r in range(world_size)]
    single = LMObjective(data, data, dataclasses.replace(cfg, batch_size=batch * accum * world_size, grad_accum=1), World(),
                         torch.device("cpu")).batches()[0][0]
    mine = torch.cat([ranks[r][m][0] for m in range(accum) for r in range(world_size)])
    assert torch.equal(mine, single)
