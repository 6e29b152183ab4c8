"""`decoderlm prepare`: corpus → token shards + tokenizer + manifest, and training from them."""

import hashlib
import json

import numpy as np
import pytest

import decoderlm
from conftest import corpus_text, run_cli
from hf_models import make_hf_model
from decoderlm.errors import DecoderLMError
from decoderlm.train import TrainConfig, train
from decoderlm.train.data import open_data_dir
from decoderlm.train.prepare import load_tokenizer, prepare


@pytest.fixture
def sources(tmp_path):
    """A folder with a text file and a JSONL file (two documents, one blank line between)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(corpus_text(20_000), encoding="utf-8")
    records = [{"text": "Émigré café, naïve façade."}, {"text": "Second document\nwith two lines."}]
    (folder / "b.jsonl").write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n", encoding="utf-8")
    return folder, records


def decoded(data_dir) -> str:
    tok = load_tokenizer(data_dir)
    train_split, val_split = open_data_dir(data_dir)
    ids = np.concatenate([np.asarray(s) for s in train_split + val_split]).tolist()
    return tok.decode(ids)


@pytest.mark.parametrize("tokenizer", ["char", "bpe:400"])
def test_the_shards_decode_back_to_the_corpus_with_document_separators(sources, tmp_path, tokenizer):
    folder, records = sources
    manifest = prepare([str(folder)], tmp_path / "data", tokenizer, workers=1, shard_tokens=3000)
    expected = corpus_text(20_000) + "\n" + records[0]["text"] + "\n" + records[1]["text"] + "\n"
    if tokenizer == "char":
        assert decoded(tmp_path / "data") == expected
    else:  # the BPE separator is <|endoftext|>, which decoding skips as a special token
        assert decoded(tmp_path / "data") == expected.replace(corpus_text(20_000) + "\n", corpus_text(20_000)).replace(
            records[0]["text"] + "\n", records[0]["text"]).removesuffix("\n")
        assert manifest["vocab_size"] == load_tokenizer(tmp_path / "data").vocab_size <= 400
    for split in ("train", "val"):
        shards = manifest["splits"][split]["shards"]
        assert all(s["tokens"] <= 3000 for s in shards) and sum(s["tokens"] for s in shards) == manifest["splits"][split]["tokens"]
    assert len(manifest["splits"]["train"]["shards"]) > 1
    total = manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]
    assert 0.05 < manifest["splits"]["val"]["tokens"] / total < 0.15  # the last 10% of the bytes
    hashes = {s["path"]: s["sha256"] for s in manifest["sources"]}
    assert hashes == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_parallel_workers_write_exactly_what_one_process_writes(sources, tmp_path):
    folder, _ = sources
    prepare([str(folder)], tmp_path / "one", "bpe:300", workers=1)
    prepare([str(folder)], tmp_path / "two", "bpe:300", workers=2)
    for name in ("train_0000.bin", "val_0000.bin", "tokenizer.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_train_from_a_bpe_folder_and_generate_from_the_run(sources, tmp_path, capsys):
    folder, _ = sources
    assert run_cli(["prepare", "--data", str(folder / "a.txt"), "--out", str(tmp_path / "data"), "--tokenizer", "bpe:300",
                    "--workers", "1"], capsys)[0] == 0
    result = train(TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), preset="seed-char-llama", batch_size=4,
                               context=32, max_steps=6, eval_interval=3, sample_chars=0))
    assert result["model"].config.vocab_size == 300
    assert not (tmp_path / "run" / "train.bin").exists()  # the shards are read where prepare wrote them
    model, tok = decoderlm.load(tmp_path / "run")
    assert tok.encode("First Citizen", add_special_tokens=False) == load_tokenizer(tmp_path / "data").encode("First Citizen")
    code, out, _ = run_cli(["generate", "--model", str(tmp_path / "run"), "--prompt", "First", "--max-new-tokens", "5",
                            "--temperature", "0"], capsys)
    assert code == 0 and out.startswith("First")
    resumed = train(TrainConfig(out=str(tmp_path / "run"), resume=True, max_steps=8))
    assert resumed["step"] == 8


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"body": "x"}\n', "line 1 has no string `text` field"),
])
def test_bad_jsonl_is_refused_with_its_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DecoderLMError, match=message):
        prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", workers=1)


def test_bad_arguments_are_refused(tmp_path, sources):
    folder, _ = sources
    with pytest.raises(DecoderLMError, match="--workers must be a positive integer"):
        prepare([str(folder)], tmp_path / "o0", workers=0)
    with pytest.raises(DecoderLMError, match="bpe:N with N above 256"):
        prepare([str(folder)], tmp_path / "o1", "bpe:10", workers=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DecoderLMError, match="not an empty folder"):
        prepare([str(folder)], tmp_path / "full", workers=1)
    with pytest.raises(DecoderLMError, match="does not exist"):
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o2", workers=1)
    (tmp_path / "bin.txt").write_bytes(b"ab\0cd")
    with pytest.raises(DecoderLMError, match="NUL bytes"):
        prepare([str(tmp_path / "bin.txt")], tmp_path / "o3", workers=1)


def test_a_models_tokenizer_prepares_data_that_init_from_trains_on(sources, tmp_path):
    folder, _ = sources
    make_hf_model("llama", tmp_path / "hf")
    _, hf_tok = decoderlm.load(tmp_path / "hf")
    prepare([str(folder / "a.txt")], tmp_path / "data", str(tmp_path / "hf"), workers=1)
    train_split, val_split = open_data_dir(tmp_path / "data")
    ids = np.concatenate([np.asarray(s) for s in train_split + val_split]).tolist()
    assert ids == hf_tok.encode(corpus_text(20_000), add_special_tokens=False) + hf_tok.eos_token_ids[:1]
    result = train(TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), init_from=str(tmp_path / "hf"),
                               batch_size=2, context=8, max_steps=2, eval_batches=1, sample_chars=0))
    assert result["step"] == 2
    prepare([str(folder / "a.txt")], tmp_path / "chars", "char", workers=1)
    with pytest.raises(DecoderLMError, match="tokenized with another tokenizer"):
        train(TrainConfig(data=str(tmp_path / "chars"), out=str(tmp_path / "run2"), init_from=str(tmp_path / "hf"),
                          context=8, max_steps=2, sample_chars=0))
