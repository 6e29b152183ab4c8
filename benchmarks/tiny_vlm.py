"""Does a tiny Qwen2-VL-shaped model learn to see? Trained from scratch through the real command line on a
synthetic shapes task, against a text-only model of the same size that reads the same tokens but no pixels.

Each 84 × 84 image is a 3 × 3 grid of 28-pixel cells (one language-model token per cell after the 2 × 2 merge)
holding one triangle, one square, one star and 0-3 circles, each in one of four colours. Every image is asked
three questions: "what colour is the triangle?" (4 answers), "how many circles?" (0-3) and "is the square left
of the star?" (yes / no; the two never share a column). `decoderlm prepare` turns the (image, question, answer)
JSONL into image+text data with a byte-level BPE; `decoderlm train` trains the VLM (`--config` with a vision
tower) and the baseline (the same config without it) with the loss on the answers; held-out images are then
answered greedily through `generate(images=...)`. Writes benchmarks/results/tiny_vlm.json (accuracy per
question kind, the machine) and tiny_vlm.png (a few held-out images with both models' answers), and keeps the
trained VLM's run folder for `decoderlm chat --image` / `decoderlm serve`.

    python benchmarks/tiny_vlm.py [--work runs/tiny_vlm] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import decoderlm.cli as cli  # noqa: E402
from decoderlm import isa, load  # noqa: E402
from decoderlm.generate import generate  # noqa: E402
from decoderlm.image import ImageProcessor, expand_image_tokens, image_placeholder  # noqa: E402
from decoderlm.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZE, CELL = 84, 28
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 230), "yellow": (235, 200, 30)}
QUESTIONS = {"colour": "what colour is the triangle?", "count": "how many circles?", "left_of": "is the square left of the star?"}
CHANCE = {"colour": 1 / 4, "count": 1 / 4, "left_of": 1 / 2}
VLM = dict(n_layers=4, d_model=128, n_heads=4, ffn_hidden=384, norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=True,
           mrope_section=[4, 6, 6], vision=dict(kind="qwen2_vl", depth=2, width=64, n_heads=4, ffn_hidden=128))
FULL = dict(train_images=4000, test_images=300, steps=1500, batch=32)
QUICK = dict(train_images=30, test_images=6, steps=10, batch=8)
# At 2e-3 the VLM learned to shut the image out (its image embeddings collapsed onto one direction and
# swapping images moved the answers by ~1e-3); at 5e-4 it memorises 100 images (tests/test_vlm.py has the
# gradient parity with transformers that ruled out a bug).
LR = 5e-4


def draw(kind: str, colour: str, cell: tuple[int, int], rng: random.Random, canvas) -> None:
    """One shape of about 20 pixels in grid cell (row, col), jittered by a few pixels."""
    from PIL import ImageDraw

    d = ImageDraw.Draw(canvas)
    r = rng.randint(8, 10)
    cx = cell[1] * CELL + CELL // 2 + rng.randint(-2, 2)
    cy = cell[0] * CELL + CELL // 2 + rng.randint(-2, 2)
    fill = COLOURS[colour]
    if kind == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "square":
        d.rectangle((cx - r + 1, cy - r + 1, cx + r - 1, cy + r - 1), fill=fill)
    elif kind == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r - 2), (cx + r, cy + r - 2)], fill=fill)
    else:  # a five-pointed star
        import math

        points = [(cx + (r if i % 2 == 0 else r * 0.45) * math.sin(i * math.pi / 5), cy - (r if i % 2 == 0 else r * 0.45) * math.cos(i * math.pi / 5))
                  for i in range(10)]
        d.polygon(points, fill=fill)


def scene(rng: random.Random):
    """(image, answers by question kind)."""
    from PIL import Image

    while True:
        cells = rng.sample([(r, c) for r in range(3) for c in range(3)], 9)
        if cells[1][1] != cells[2][1]:  # square and star in different columns
            break
    circles = rng.randint(0, 3)
    canvas = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    colours = [rng.choice(list(COLOURS)) for _ in range(3 + circles)]
    for kind, colour, cell in zip(["triangle", "square", "star"] + ["circle"] * circles, colours, cells):
        draw(kind, colour, cell, rng, canvas)
    return canvas, {"colour": colours[0], "count": str(circles), "left_of": "yes" if cells[1][1] < cells[2][1] else "no"}


def render(folder: Path, n: int, seed: int) -> list[dict]:
    """n images in folder, and their (image, prompt, answer, kind) records, three per image."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, records = random.Random(seed), []
    for i in range(n):
        image, answers = scene(rng)
        image.save(folder / f"{i:05d}.png")
        records += [{"image": f"{folder.name}/{i:05d}.png", "prompt": QUESTIONS[k], "answer": answers[k], "kind": k} for k in QUESTIONS]
    return records


def train(work: Path, name: str, data: Path, config: dict, steps: int, batch: int, threads: int | None) -> tuple[Path, float]:
    """`decoderlm train` on the prepared data; the run folder and its wall time."""
    (work / f"{name}.json").write_text(json.dumps(config))
    run = work / name
    t0 = time.perf_counter()
    code = cli.main(["train", "--data", str(data), "--config", str(work / f"{name}.json"), "--out", str(run), "--max-steps", str(steps),
                     "--batch-size", str(batch), "--context", "48", "--lr", str(LR), "--min-lr", str(LR / 10), "--warmup", str(max(steps // 20, 1)),
                     "--eval-interval", str(steps), "--log-interval", str(max(steps // 10, 1)), "--seed", "0", "--sample-chars", "0",
                     *(["--threads", str(threads)] if threads else [])])
    if code:
        sys.exit(f"training {name} failed (exit {code})")
    return run, time.perf_counter() - t0


@torch.no_grad()
def answer(run: Path, work: Path, records: list[dict]) -> list[str]:
    """Greedy answers of the model in run to the held-out records (with their images if it has a vision tower)."""
    model, tok = load(run)
    processor = ImageProcessor()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=tok.eos_token_ids)
    image_id = model.config.image_token_id
    out = []
    for r in records:
        text = tok.apply_chat_template([{"role": "user", "content": image_placeholder(tok, image_id) + r["prompt"]}], add_generation_prompt=True)
        images = processor([work / r["image"]])
        ids = expand_image_tokens(tok.encode(text, add_special_tokens=False), image_id, images.tokens(2))
        out.append(tok.decode(generate(model, ids, params, images=images if model.visual is not None else None)).strip())
    return out


def accuracy(records: list[dict], answers: list[str]) -> dict[str, float]:
    acc = {k: sum(a == r["answer"] for r, a in zip(records, answers) if r["kind"] == k) / sum(r["kind"] == k for r in records) for k in QUESTIONS}
    return {k: round(v, 3) for k, v in acc.items()} | {"all": round(sum(a == r["answer"] for r, a in zip(records, answers)) / len(records), 3)}


def picture(work: Path, records: list[dict], vlm: list[str], text: list[str], out: Path, n: int = 6) -> None:
    """n held-out images, each with its three questions and both models' answers."""
    from PIL import Image, ImageDraw

    scale, w, h = 2, 330, SIZE * 2 + 62
    sheet = Image.new("RGB", (w * 3, h * ((n + 2) // 3)), (255, 255, 255))
    d = ImageDraw.Draw(sheet)
    for i in range(min(n, len(records) // 3)):
        x, y = (i % 3) * w, (i // 3) * h
        sheet.paste(Image.open(work / records[3 * i]["image"]).resize((SIZE * scale, SIZE * scale), Image.Resampling.NEAREST), (x + 4, y + 4))
        for j in range(3):
            r, a, b = records[3 * i + j], vlm[3 * i + j], text[3 * i + j]
            mark = "ok" if a == r["answer"] else "WRONG"
            d.text((x + SIZE * scale + 10, y + 8 + 52 * j), f"{r['prompt']}\nVLM: {a} ({mark})\ntext-only: {b}", fill=(0, 0, 0))
        d.text((x + 4, y + SIZE * scale + 10), f"truth: {', '.join(records[3 * i + j]['answer'] for j in range(3))}", fill=(90, 90, 90))
    sheet.save(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "tiny_vlm"), help="new folder for images, data and the two run folders")
    ap.add_argument("--quick", action="store_true", help="a test-sized run (seconds); writes into --work only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 is much faster on a busy machine)")
    ap.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/tiny_vlm.json; with --quick, in --work)")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    work = Path(args.work)
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty; give a new folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else (work / "tiny_vlm.json" if args.quick else RESULTS / "tiny_vlm.json")
    t0 = time.perf_counter()
    train_records = render(work / "train", size["train_images"], seed=0)
    test_records = render(work / "test", size["test_images"], seed=1)
    (work / "train.jsonl").write_text("".join(json.dumps({k: r[k] for k in ("image", "prompt", "answer")}) + "\n" for r in train_records))
    data = work / "data"
    if cli.main(["prepare", "--data", str(work / "train.jsonl"), "--out", str(data), "--tokenizer", "bpe:320", "--val-fraction", "0.05"]):
        sys.exit("prepare failed")
    text_only = {k: v for k, v in VLM.items() if k != "vision"}
    vlm_run, vlm_seconds = train(work, "vlm", data, VLM, size["steps"], size["batch"], args.threads)
    text_run, text_seconds = train(work, "text_only", data, text_only, size["steps"], size["batch"], args.threads)
    vlm, text = answer(vlm_run, work, test_records), answer(text_run, work, test_records)
    model, _ = load(vlm_run)
    results = {
        "task": {"canvas": f"{SIZE}x{SIZE}", "image_tokens": (SIZE // CELL) ** 2, "questions": QUESTIONS, "train_images": size["train_images"],
                 "train_examples": len(train_records), "test_images": size["test_images"], "test_questions": len(test_records)},
        "model": {"config": VLM, "parameters": model.num_parameters(), "vision_parameters": sum(p.numel() for p in model.visual.parameters())},
        "train": {"steps": size["steps"], "batch_size": size["batch"], "lr": LR, "threads": torch.get_num_threads(), "vlm_seconds": round(vlm_seconds, 1), "text_only_seconds": round(text_seconds, 1)},
        "accuracy": {"vlm": accuracy(test_records, vlm), "text_only": accuracy(test_records, text), "chance": {k: round(v, 3) for k, v in CHANCE.items()}},
        "examples": [{"image": r["image"], "prompt": r["prompt"], "truth": r["answer"], "vlm": a, "text_only": b}
                     for r, a, b in list(zip(test_records, vlm, text))[:9]],
        "vlm_run_folder": str(vlm_run.relative_to(ROOT) if vlm_run.is_relative_to(ROOT) else vlm_run),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "machine": isa.describe(),
        "quick": args.quick,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    picture(work, test_records, vlm, text, out.with_suffix(".png"))
    print(json.dumps(results["accuracy"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}; the trained VLM is in {vlm_run} "
          f"(decoderlm chat --model {vlm_run} --image {work / test_records[0]['image']} --message \"{QUESTIONS['colour']}\")")


if __name__ == "__main__":
    main()
