"""Image + text data: `decoderlm prepare` on a JSONL of (image, prompt, answer) records, `decoderlm train` on it with a
tiny Qwen2-VL-shaped config (loss on the answers only), and the run folder answering through `generate(images=...)`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import decoderlm.cli as cli
from decoderlm import load
from decoderlm.generate import generate
from decoderlm.image import ImageProcessor
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.sampling import SamplingParams
from decoderlm.train.image_text import encode, open_image_text

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}
VLM = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=True,
           mrope_section=[2, 3, 3], vision=dict(kind="qwen2_vl", depth=1, width=32, n_heads=2, ffn_hidden=64))


def write_records(folder: Path, n: int) -> Path:
    """n solid-colour 56 × 56 images, each asked its colour."""
    lines = []
    for i in range(n):
        name = list(COLOURS)[i % 3]
        Image.new("RGB", (56, 56), COLOURS[name]).save(folder / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "prompt": "what colour is it?", "answer": name}))
    (folder / "qa.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "qa.jsonl"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("data") / "prepared"
    assert cli.main(["prepare", "--data", str(write_records(src, 30)), "--out", str(out), "--tokenizer", "bpe:300", "--val-fraction", "0.2"]) == 0
    return src, out


def test_prepared_examples_are_the_chat_prompt_then_the_answer(prepared):
    src, out = prepared
    manifest, train, val = open_image_text(out)
    assert (manifest["splits"]["train"]["examples"], manifest["splits"]["val"]["examples"]) == (24, 6)
    assert len(train.images) == 24 and train.images[0].shape == (3, 56, 56) and train.images[0].dtype == torch.uint8
    tok = load_tokenizer(out)
    image, start, *ids = train.examples[0]
    assert ids[start:] == tok.encode("red", add_special_tokens=False) + [tok.eos_token_ids[0]]
    head = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    assert ids[: len(head)] == head and ids.count(manifest["image_token_id"]) == 4
    x, y, images = train.batch([0, 1])
    assert (y[0] != IGNORE_INDEX).sum() == len(ids) - start  # the answer and the end of its turn, nothing else
    assert images.grid_thw.tolist() == [[1, 4, 4]] * 2
    assert torch.equal(images.pixel_values[:16], ImageProcessor()([src / "0.png"]).pixel_values)


def test_a_batch_pairs_each_row_with_its_own_image_as_eval_reads_it(prepared):
    """Rows drawn out of order and right-padded: row b's patches are its own image's, normalized as `chat --image`
    normalizes it, its M-RoPE positions are those of the row alone, and its targets are its answer."""
    from decoderlm.model.mrope import mrope_positions

    src, out = prepared
    manifest, train, _ = open_image_text(out)
    image_id = manifest["image_token_id"]
    image, start, *ids = train.examples[5]
    train.examples.append([image, start, *ids[:-1], *ids[start:]])  # a longer answer: the other rows are padded
    rows = [4, 0, len(train.examples) - 1, 11, 7]
    x, y, images = train.batch(rows)
    lengths = [len(train.examples[i]) - 3 for i in rows]
    assert len(set(lengths)) > 1
    positions = mrope_positions(x, images.grid_thw, image_id, 2)[0]
    for b, i in enumerate(rows):
        image, start, *ids = train.examples[i]
        assert torch.equal(images.pixel_values[16 * b : 16 * (b + 1)], ImageProcessor()([src / f"{image}.png"]).pixel_values)
        alone = mrope_positions(x[b : b + 1, : lengths[b]], images.grid_thw[b : b + 1], image_id, 2)[0]
        assert torch.equal(positions[:, b : b + 1, : lengths[b]], alone)
        assert y[b][y[b] != IGNORE_INDEX].tolist() == ids[start:]


def load_tokenizer(out: Path):
    from decoderlm.train.prepare import load_tokenizer

    return load_tokenizer(out)


def test_char_tokenizer_is_refused_for_image_data(tmp_path, capsys):
    assert cli.main(["prepare", "--data", str(write_records(tmp_path, 3)), "--out", str(tmp_path / "o")]) == 2
    assert "image+text data needs a tokenizer with an image token" in capsys.readouterr().err


def test_train_a_tiny_vlm_on_image_data_and_answer_with_images(prepared, tmp_path):
    src, out = prepared
    (tmp_path / "vlm.json").write_text(json.dumps(VLM))
    run = tmp_path / "run"
    argv = ["train", "--data", str(out), "--config", str(tmp_path / "vlm.json"), "--out", str(run), "--max-steps", "200", "--batch-size", "8",
            "--context", "40", "--lr", "3e-3", "--warmup", "5", "--eval-interval", "200", "--log-interval", "200"]
    assert cli.main(argv) == 0
    log = json.loads((run / "log.json").read_text())
    assert log[-1]["val_loss"] < 0.1  # three colours, seen through the vision tower
    model, tok = load(run)
    assert model.visual is not None
    manifest = open_image_text(out)[0]
    for i, colour in ((24, "red"), (25, "green"), (26, "blue")):  # held out
        ids = encode(tok, {"prompt": "what colour is it?", "answer": ""}, 4, manifest["image_token_id"])
        prompt = ids[1 : ids[0] + 1]
        answer = generate(model, prompt, SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=tok.eos_token_ids),
                          images=ImageProcessor()([src / f"{i}.png"]))
        assert tok.decode(answer) == colour


def test_a_context_too_short_for_the_examples_is_refused(prepared, tmp_path, capsys):
    _, out = prepared
    (tmp_path / "vlm.json").write_text(json.dumps(VLM))
    assert cli.main(["train", "--data", str(out), "--config", str(tmp_path / "vlm.json"), "--out", str(tmp_path / "r"), "--context", "8"]) == 2
    assert "more than --context 8 + 1; give --context" in capsys.readouterr().err


def test_an_image_text_run_resumes(prepared, tmp_path):
    _, out = prepared
    (tmp_path / "vlm.json").write_text(json.dumps(VLM))
    run = tmp_path / "run"
    argv = ["train", "--data", str(out), "--config", str(tmp_path / "vlm.json"), "--out", str(run), "--batch-size", "4", "--context", "40",
            "--eval-interval", "2", "--log-interval", "1", "--sample-chars", "0"]
    assert cli.main(argv + ["--max-steps", "2"]) == 0
    assert cli.main(["train", "--out", str(run), "--resume", "--max-steps", "4", "--sample-chars", "0"]) == 0
    assert [r["step"] for r in json.loads((run / "log.json").read_text())][-1] == 4


@pytest.fixture(scope="module")
def quick_benchmark(tmp_path_factory):
    """benchmarks/tiny_vlm.py --quick: both models trained a few steps through prepare and train, answers, JSON and picture."""
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("tiny_vlm") / "work"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/tiny_vlm.py", "--quick", "--threads", "1", "--work", str(work)], cwd=root,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return work, json.loads((work / "tiny_vlm.json").read_text())


def test_tiny_vlm_benchmark_quick_run(quick_benchmark):
    work, result = quick_benchmark
    assert set(result["accuracy"]) == {"vlm", "text_only", "chance"}
    assert set(result["accuracy"]["vlm"]) == {"colour", "count", "left_of", "all"}
    assert result["model"]["vision_parameters"] > 0 and result["machine"]["cpus"] and (work / "tiny_vlm.png").stat().st_size > 1000
    assert len(result["examples"]) == 9 and result["task"]["test_questions"] == 18


def test_chat_image_on_the_benchmarks_vlm_gives_its_answer(quick_benchmark, monkeypatch):
    """`decoderlm chat --model RUN --image ...` on the run folder the benchmark trained: the benchmark's own answer."""
    from decoderlm.cli import chat

    work, result = quick_benchmark
    example = result["examples"][0]
    replies = []
    monkeypatch.setattr(chat, "print_stream", lambda tok, tokens, prompt: replies.append(tok.decode(list(tokens)).strip()))
    argv = ["chat", "--model", str(work / "vlm"), "--image", str(work / example["image"]), "--message", example["prompt"],
            "--temperature", "0", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    assert replies == [example["vlm"]]


def test_serve_image_parts_on_the_benchmarks_vlm_give_its_answers(quick_benchmark):
    import base64

    import openai
    from serve_helpers import ServerProcess

    work, result = quick_benchmark
    server = ServerProcess("--model", str(work / "vlm"), "--max-batch", "4", "--kv-cache-memory", "4MiB")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for example in result["examples"][:3]:
            url = "data:image/png;base64," + base64.b64encode((work / example["image"]).read_bytes()).decode()
            reply = client.chat.completions.create(model=str(work / "vlm"), max_tokens=4, temperature=0, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": example["prompt"]}]}])
            assert reply.choices[0].message.content.strip() == example["vlm"]
    finally:
        server.stop()
