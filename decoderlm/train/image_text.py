"""Image + text training data: (image, question, answer) examples, prepared once, trained with the loss on answers.

A JSONL whose lines are `{"image": "shapes/0001.png", "prompt": "what colour is the triangle?", "answer": "red"}`
(image paths relative to the JSONL file) is prepared by `decoderlm prepare` into

    DATA_DIR/
      manifest.json            format "decoderlm-image-text", the tokenizer, the image token id, counts per split
      tokenizer.json (+ tokenizer_config.json)   with the chat template the prompts were written with
      train.pt, val.pt         {"images": [(3, H, W) uint8, ...] resized by the image processor, each kept once,
                                "examples": [[image index, answer start, token ids...], ...]}

Each example's ids are the chat template's user turn (the image placeholder, then the prompt), the
generation prompt, the answer and the end of the turn, the placeholder repeated once per image token:
exactly what `decoderlm chat --image` and the server feed the trained model. A `bpe:N` tokenizer is
trained on the prompts and answers with Qwen2-VL's vision tokens and a ChatML template; a model's
tokenizer must have an image token already. `decoderlm train --data DATA_DIR` then trains on random
batches of examples (`ImageTextObjective`), the images normalized and cut into patches per batch. A
model without a vision tower trains on the same tokens with the placeholders as plain tokens: the
text-only baseline, which can only guess.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.image import ImageProcessor, expand_image_tokens, image_placeholder, open_image
from decoderlm.model.transformer import IGNORE_INDEX, lm_loss
from decoderlm.model.vision import Images
from decoderlm.tokenizer.bpe import HFTokenizer
from decoderlm.train.config import TrainConfig
from decoderlm.train.data import EVAL_BATCH, MANIFEST
from decoderlm.train.distributed import World

FORMAT = "decoderlm-image-text"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class ImageTextSplit:
    """One split: resized images and examples [image index, answer start, ids...]."""

    images: list[torch.Tensor]
    examples: list[list[int]]
    pad_id: int
    processor: ImageProcessor = field(default_factory=ImageProcessor)

    def batch(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, Images]:
        """Inputs x (B, T) right-padded, targets y (B, T) (the answers' tokens only, else IGNORE_INDEX), their images."""
        examples = [self.examples[i] for i in rows]
        T = max(len(e) - 2 for e in examples) - 1
        x = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        y = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
        for b, (_, start, *ids) in enumerate(examples):
            x[b, : len(ids) - 1] = torch.tensor(ids[:-1])
            y[b, start - 1 : len(ids) - 1] = torch.tensor(ids[start:])
        return x, y, self.processor.pixels([self.images[e[0]] for e in examples])


def is_image_text(files: list[Path]) -> bool:
    """Whether the sources are one JSONL of image records (its first record has an `image` field)."""
    if len(files) != 1 or files[0].suffix != ".jsonl":
        return False
    with open(files[0], encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict) and "image" in json.loads(first)
    except json.JSONDecodeError:
        return False


def read_records(file: Path) -> list[dict[str, str]]:
    records = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise DecoderLMError(f"{file} line {number} is not valid JSON ({e.msg}); fix the line or remove it") from None
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("image", "prompt", "answer")):
            raise DecoderLMError(f"{file} line {number} needs string fields image, prompt and answer "
                                 '({"image": "a.png", "prompt": "...", "answer": "..."})')
        records.append(r)
    return records


def make_tokenizer(spec: str, records: list[dict[str, str]]) -> HFTokenizer:
    """bpe:N trained on the prompts and answers, with vision tokens and ChatML; or a model's tokenizer."""
    if spec.startswith("bpe:") and spec[4:].isdigit():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
        trainer = trainers.BpeTrainer(vocab_size=int(spec[4:]), special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((f"{r['prompt']}\n{r['answer']}" for r in records), trainer=trainer)
        return HFTokenizer(tok, special_tokens={"eos_token": "<|im_end|>"}, chat_template=CHATML)
    if spec == "char" or spec.startswith("bpe:"):
        raise DecoderLMError(f"--tokenizer {spec}: image+text data needs a tokenizer with an image token; give bpe:N "
                             "(e.g. bpe:512) or a vision-language model's folder")
    from decoderlm.loader import load

    _, tok = load(spec)
    if not isinstance(tok, HFTokenizer) or "<|image_pad|>" not in tok.get_vocab() or tok.chat_template is None:
        raise DecoderLMError(f"{spec}'s tokenizer has no <|image_pad|> token or no chat template; give bpe:N or a "
                             "vision-language model's folder")
    return tok


def encode(tok: HFTokenizer, record: dict[str, str], image_tokens: int, image_id: int) -> list[int]:
    """[answer start, ids...]: the user turn with the image and prompt, the generation prompt, the answer, end of turn."""
    content = image_placeholder(tok, image_id) + record["prompt"]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True),
                        add_special_tokens=False)
    prompt = expand_image_tokens(prompt, image_id, [image_tokens])
    return [len(prompt), *prompt, *tok.encode(record["answer"], add_special_tokens=False), tok.eos_token_ids[0]]


def prepare_image_text(file: Path, out: Path, tokenizer: str, val_fraction: float) -> dict[str, Any]:
    """Prepare a JSONL of image records into `out` (see the module docstring); returns the manifest."""
    records = read_records(file)
    n_val = max(1, round(len(records) * val_fraction))
    if len(records) - n_val < 1:
        raise DecoderLMError(f"{file} has {len(records)} records; give at least 2 (one for val)")
    tok = make_tokenizer(tokenizer, records)
    image_id = tok.get_vocab()["<|image_pad|>"]
    processor = ImageProcessor()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    splits = {}
    for name, part in (("train", records[:-n_val]), ("val", records[-n_val:])):
        images, index, examples = [], {}, []
        for r in part:
            path = file.parent / r["image"]
            if path not in index:
                index[path] = len(images)
                images.append(processor.resized(open_image(path)))
            image = images[index[path]]
            tokens = (image.shape[1] // processor.patch_size) * (image.shape[2] // processor.patch_size) // processor.merge_size**2
            examples.append([index[path], *encode(tok, r, tokens, image_id)])
        torch.save({"images": images, "examples": examples}, out / f"{name}.pt")
        splits[name] = {"file": f"{name}.pt", "examples": len(examples), "images": len(images),
                        "longest": max(len(e) - 2 for e in examples)}
    manifest = {"format": FORMAT, "version": 1, "tokenizer_spec": tokenizer, "tokenizer": {"type": "hf", "file": "tokenizer.json"},
                "vocab_size": tok.vocab_size, "image_token_id": image_id, "pad_id": tok.eos_token_ids[0], "val_fraction": val_fraction,
                "splits": splits, "sources": [{"path": str(file), "bytes": file.stat().st_size,
                                               "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def is_image_text_dir(path: str | Path | None) -> bool:
    try:
        return path is not None and json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def open_image_text(data_dir: str | Path) -> tuple[dict[str, Any], ImageTextSplit, ImageTextSplit]:
    """The manifest and the train and val splits of a prepared image+text folder."""
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / MANIFEST).read_text())
    splits = []
    for name in ("train", "val"):
        path = data_dir / manifest["splits"][name]["file"]
        try:
            data = torch.load(path, weights_only=True)
        except (OSError, RuntimeError) as e:
            raise DecoderLMError(f"cannot read {path} ({e}); run `decoderlm prepare` again") from None
        splits.append(ImageTextSplit(data["images"], data["examples"], manifest["pad_id"]))
    return manifest, splits[0], splits[1]


def check_model(config: Any, manifest: dict[str, Any], context: int, where: str) -> None:
    """The examples fit the context, and a vision tower reads the data's image token."""
    longest = max(s["longest"] for s in manifest["splits"].values())
    if longest - 1 > context:
        raise DecoderLMError(f"{where}: its longest example has {longest} tokens, more than --context {context} + 1; "
                             f"give --context {longest - 1} or more")
    if config.vision and config.image_token_id != manifest["image_token_id"]:
        raise DecoderLMError(f"{where}: the model's image_token_id is {config.image_token_id} but the data's is "
                             f"{manifest['image_token_id']}; prepare the data with the model's tokenizer")


class ImageTextObjective:
    """Next-token loss on the answers of random batches of examples, each with its image (a model without a
    vision tower sees the placeholders only). Batches are drawn as LMObjective draws windows: one generator,
    every process the same global batch, each its own slice."""

    def __init__(self, train: ImageTextSplit, val: ImageTextSplit, cfg: TrainConfig, world: World, device: torch.device) -> None:
        self.train, self.val, self.cfg, self.world, self.device = train, val, cfg, world, device
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor, Images]]:
        B, world = self.cfg.batch_size, self.world
        rows = torch.randint(len(self.train.examples), (B * self.cfg.grad_accum * world.size,), generator=self.generator).tolist()
        return [self.train.batch(rows[(m * world.size + world.rank) * B :][:B]) for m in range(self.cfg.grad_accum)]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, Images]) -> tuple[torch.Tensor, int]:
        x, y, images = batch[0].to(self.device), batch[1].to(self.device), batch[2]
        vision = getattr(model, "module", model).visual is not None  # under DDP the model is wrapped
        images = Images(images.pixel_values.to(self.device), images.grid_thw) if vision else None
        return lm_loss(model(x, images=images).logits, y), int((y != IGNORE_INDEX).sum())

    def val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, Images]]:
        """Every val example in order, each batch's rows dealt out over the processes (one left without rows
        runs one that counts for nothing)."""
        n = len(self.val.examples)
        for i in range(0, n, EVAL_BATCH):
            if self.cfg.eval_batches is not None and i // EVAL_BATCH >= self.cfg.eval_batches:
                break
            mine = list(range(i, min(i + EVAL_BATCH, n)))[self.world.rank :: self.world.size]
            x, y, images = self.val.batch(mine or [i])
            yield x, y if mine else torch.full_like(y, IGNORE_INDEX), images

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {"batch": self.generator.get_state()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["batch"])
