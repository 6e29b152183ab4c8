"""Qwen2-VL / Qwen2.5-VL against transformers on tiny random checkpoints, with two images of different
sizes in one prompt: logits, cached decoding against recomputation, greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoderlm import load
from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import config_from_hf, config_to_hf
from decoderlm.generate import generate
from decoderlm.kv_cache import cache_for
from decoderlm.model.mrope import ShiftedPositions, mrope_positions
from decoderlm.model.vision import Images
from decoderlm.sampling import SamplingParams
from hf_models import tokenizer_json, write_tokenizer

IMAGE, START, END = 300, 302, 303
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VL_CASES = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
    # windows of 2 × 2 merged tokens: the 6 × 10 image's 3 × 5 tokens fall into six windows, some partial; block 1 sees it whole
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, window_size=56, fullatt_block_indexes=[1]),
}
GRID = torch.tensor([[1, 4, 4], [1, 6, 10]])  # patches (t, h, w): 4 and 15 language-model tokens
PROMPT = [5, 6, START, *[IMAGE] * 4, END, 7, 8, 9, START, *[IMAGE] * 15, END, 10, 11]


def hf_config(kind: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, text_config=TEXT, vision_config=VL_CASES[kind], image_token_id=IMAGE, video_token_id=301,
                                vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="module", params=list(VL_CASES))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(hf_config(request.param)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_vl_tokenizer(folder)
    ours, _ = load(folder)
    pixels = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    return hf, ours, Images(pixels, GRID), folder


def write_vl_tokenizer(folder: Path) -> None:
    """The tests' byte-level BPE (300 tokens) plus Qwen2-VL's image tokens as 300..303."""
    from tokenizers import Tokenizer

    write_tokenizer(folder)
    tok = Tokenizer.from_str(tokenizer_json())
    tok.add_special_tokens(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    assert tok.token_to_id("<|image_pad|>") == IMAGE and tok.token_to_id("<|vision_end|>") == END
    (folder / "tokenizer.json").write_text(tok.to_str())


def hf_inputs(ids: list[int], images: Images) -> dict:
    t = torch.tensor([ids])
    return dict(input_ids=t, pixel_values=images.pixel_values, image_grid_thw=images.grid_thw, mm_token_type_ids=(t == IMAGE).int())


@torch.no_grad()
def test_logits_match_transformers(pair):
    hf, ours, images, _ = pair
    ref = hf(**hf_inputs(PROMPT, images)).logits
    got = ours(torch.tensor([PROMPT]), images=images).logits
    assert (ref - got).abs().max() < 1e-4


@torch.no_grad()
def test_text_only_matches_transformers(pair):
    hf, ours, _, _ = pair
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert (hf(input_ids=ids).logits - ours(ids).logits).abs().max() < 1e-4


@torch.no_grad()
def test_greedy_tokens_match_and_cached_decoding_equals_recompute(pair):
    hf, ours, images, _ = pair
    n = 8
    ref = hf.generate(**hf_inputs(PROMPT, images), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(PROMPT):].tolist()
    got = generate(ours, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=n), images=images)
    assert got == ref
    # Recomputed from scratch at every length, the last logits choose the same tokens.
    ids = list(PROMPT)
    for tok in got:
        ids.append(int(ours(torch.tensor([ids]), images=images).logits[0, -1].argmax()))
    assert ids[len(PROMPT):] == got


@torch.no_grad()
def test_cached_decode_logits_equal_recompute(pair):
    """Decoding continues at cache position + rope_delta: each step's logits are the full recomputation's."""
    _, ours, images, _ = pair
    ids = list(PROMPT)
    delta = mrope_positions(torch.tensor([ids]), images.grid_thw, IMAGE, 2)[1]
    assert delta.item() == (11 + 2 + 5) - len(PROMPT)  # 11 text tokens, then each image's larger side in tokens
    cache = ShiftedPositions(cache_for(ours.config, 1, len(ids) + 4), delta)
    logits = ours(torch.tensor([ids]), cache=cache, images=images).logits[0, -1]
    for _ in range(4):
        full = ours(torch.tensor([ids]), images=images).logits[0, -1]
        assert (full - logits).abs().max() < 1e-4
        ids.append(int(logits.argmax()))
        logits = ours(torch.tensor([ids[-1:]]), cache=cache).logits[0, -1]


def test_config_round_trips_and_counts_both_towers(pair):
    hf, ours, _, folder = pair
    d = (folder / "config.json").read_text()
    config = config_from_hf(__import__("json").loads(d))
    assert config_from_hf(config_to_hf(config)) == config
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_transformers_5_names_load(pair, tmp_path):
    """transformers 5 may write model.language_model.* and model.visual.*: both spellings load."""
    from safetensors.torch import load_file, save_file

    hf, ours, images, folder = pair
    tensors = load_file(folder / "model.safetensors")
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else "model." + k if k.startswith("visual.") else k): v
               for k, v in tensors.items()}
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again, _ = load(tmp_path)
    with torch.no_grad():
        assert torch.equal(again(torch.tensor([PROMPT]), images=images).logits, ours(torch.tensor([PROMPT]), images=images).logits)


def test_placeholder_count_must_match_the_images(pair):
    _, ours, images, _ = pair
    with pytest.raises(DecoderLMError, match="has 16 image placeholder tokens but the images make 19"):
        ours(torch.tensor([PROMPT[:-6]]), images=images)


def test_text_only_model_refuses_images(tmp_path: Path):
    from hf_models import make_hf_model

    make_hf_model("qwen2-bias-tied", tmp_path)
    model, _ = load(tmp_path)
    with pytest.raises(DecoderLMError, match="no vision tower"):
        model(torch.tensor([PROMPT]), images=Images(torch.zeros(16, 1176), torch.tensor([[1, 4, 4]])))


def test_inspect_counts_both_towers_exactly(pair):
    from decoderlm.inspect.accounting import Accounting
    from decoderlm.inspect.arch import read_spec

    hf, _, _, folder = pair
    acc = Accounting.of(read_spec(folder))
    assert acc.total == sum(p.numel() for p in hf.parameters())
    assert acc.group("vision tower") == sum(p.numel() for p in hf.model.visual.parameters())


@pytest.mark.parametrize("kind", list(VL_CASES))
def test_inspect_counts_a_7b_shaped_config_as_transformers_does(kind):
    import json

    from transformers import AutoConfig, AutoModelForImageTextToText

    from decoderlm.inspect.accounting import Accounting
    from decoderlm.inspect.arch import spec_from_hf
    from decoderlm.inspect.report import as_dict, summary

    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
    config = AutoConfig.for_model(kind, text_config=text, vision_config={"hidden_size" if kind == "qwen2_vl" else "out_hidden_size": 3584})
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    acc = Accounting.of(spec_from_hf(json.loads(config.to_json_string())))
    assert acc.total == n
    assert "448×448 px: 256 tokens, KV 14.00 MiB" in "\n".join(summary(acc, 4096, 1))
    assert as_dict(acc, 4096, 1)["image_tokens"] == {"448x448": 256, "1280x720": 1196, "1920x1080": 1222}


def test_chat_with_images_gives_transformers_reply(pair, tmp_path, monkeypatch):
    """`decoderlm chat --image a.png --image b.png --message ...` against transformers' own processor and generate."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import decoderlm.cli as cli
    from decoderlm.cli import chat

    hf, _, _, folder = pair
    rng = np.random.default_rng(0)
    files = []
    for name, (h, w) in (("a.png", (40, 60)), ("b.png", (90, 120))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
        files.append(tmp_path / name)
    message = "the quick fox"
    tok = AutoTokenizer.from_pretrained(folder)
    pixels = Qwen2VLImageProcessorPil()([Image.open(f) for f in files], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 8]]  # two sizes
    # What Qwen2VLProcessor does (it needs torchvision for its video half): each <|image_pad|> repeated per merged patch.
    text = tok.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>" * 2 + message}],
                                   add_generation_prompt=True, tokenize=False)
    first, second, rest = text.split("<|image_pad|>")
    text = first + "<|image_pad|>" * 6 + second + "<|image_pad|>" * 12 + rest
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **pixels)
    out = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    replies = []  # the token ids chat prints (random weights decode to partial characters, which a stream holds back)
    monkeypatch.setattr(chat, "print_stream", lambda tok, tokens, prompt: replies.append(list(tokens)))
    argv = ["chat", "--model", str(folder), "--image", str(files[0]), "--image", str(files[1]), "--message", message,
            "--temperature", "0", "--max-new-tokens", "6"]
    assert cli.main(argv) == 0
    assert replies == [out.tolist()]


def test_chat_image_on_a_text_only_model_is_refused(tmp_path, capsys):
    from hf_models import make_hf_model

    import decoderlm.cli as cli

    make_hf_model("qwen2-bias-tied", tmp_path)
    capsys.readouterr()
    assert cli.main(["chat", "--model", str(tmp_path), "--image", "x.png", "--message", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reads text only (it has no vision tower)" in err


@torch.no_grad()
def test_saved_checkpoint_loads_in_transformers(pair, tmp_path):
    from transformers import AutoModelForImageTextToText

    from decoderlm.formats.hf import save_hf

    hf, _, images, folder = pair
    model, tok = load(folder, fuse=False)
    save_hf(model, tok, tmp_path)
    again = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert torch.equal(again(**hf_inputs(PROMPT, images)).logits, hf(**hf_inputs(PROMPT, images)).logits)


# The layout of Qwen2-VL-2B-Instruct's config.json (transformers 4.4x): text fields at the top level, rope_scaling of type
# "mrope", the vision tower's in_chans.
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 28,
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}


def test_flat_qwen2_vl_config_reads_as_transformers_does():
    from transformers import AutoConfig, AutoModelForImageTextToText

    from decoderlm.inspect.accounting import Accounting
    from decoderlm.inspect.arch import spec_from_hf

    c = config_from_hf(QWEN2_VL_2B)
    assert (c.d_model, c.n_layers, c.rope_theta, c.rope_scaling, c.mrope_section) == (1536, 28, 1e6, None, [16, 24, 24])
    assert c.tie_embeddings and c.norm_eps == 1e-6 and c.image_token_id == 151655 and c.vision["width"] == 1280
    config = AutoConfig.for_model(**QWEN2_VL_2B)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    assert Accounting.of(spec_from_hf(QWEN2_VL_2B)).total == n


def test_a_batch_of_rows_with_images_matches_transformers_and_trains(pair):
    """Two rows of one length, each with its own image (the grids in row order): logits as transformers', and a
    loss whose gradient reaches the vision tower (what training on image + text data needs)."""
    hf, ours, images, _ = pair
    rows = [[5, START, *[IMAGE] * 4, END, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [START, *[IMAGE] * 15, END, 5, 6]]
    assert len(rows[0]) == len(rows[1])
    t = torch.tensor(rows)
    with torch.no_grad():
        ref = hf(input_ids=t, pixel_values=images.pixel_values, image_grid_thw=images.grid_thw, mm_token_type_ids=(t == IMAGE).int()).logits
        assert (ours(t, images=images).logits - ref).abs().max() < 1e-4
    loss = ours(t, images=images, labels=t).loss
    loss.backward()
    assert ours.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    ours.zero_grad(set_to_none=True)


def answer_loss(logits: torch.Tensor, ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each answer token (answer: (B, T) bool) predicted from the position before it."""
    targets = ids[:, 1:].masked_fill(~answer[:, 1:], -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_gradients_of_every_parameter_match_transformers(pair):
    """The backward pass, not only the forward: one image + text batch, the loss on the answers only, and the gradient of
    every parameter of both towers equal to transformers' (mapped through the weight table)."""
    from decoderlm.formats.families import expand, family_of
    from decoderlm.formats.hf import _copy_in, _table_key

    hf, _, images, folder = pair
    ours = load(folder, fuse=False)[0]  # as training builds it: one matrix per checkpoint projection
    rows = [[5, START, *[IMAGE] * 4, END, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [START, *[IMAGE] * 15, END, 5, 6]]
    t = torch.tensor(rows)
    answer = torch.zeros_like(t, dtype=torch.bool)
    answer[:, -3:] = True
    hf.zero_grad(set_to_none=True)
    try:
        answer_loss(hf(**hf_inputs(rows[0], images) | dict(input_ids=t, mm_token_type_ids=(t == IMAGE).int())).logits, t, answer).backward()
        answer_loss(ours(t, images=images).logits, t, answer).backward()
        ref = {name: torch.zeros_like(p) for name, p in ours.named_parameters()}
        table = expand(family_of(ours.config.family), ours.config, set(ref))
        for name, p in hf.named_parameters():
            key = _table_key(name, table, family_of(ours.config.family), ours.config)
            if key is not None:
                _copy_in(table[key], p.grad, ref)
        assert any(n.startswith("visual.") for n in ref)
        for name, p in ours.named_parameters():
            scale = max(ref[name].abs().max().item(), 1e-6)
            assert p.grad is not None and ref[name].abs().max() > 0, name
            assert (p.grad - ref[name]).abs().max() / scale < 1e-4, name
    finally:
        hf.zero_grad(set_to_none=True)


def test_image_text_objective_trains_the_vision_tower(pair):
    """Through decoderlm's own training path: ImageTextObjective's loss reaches every vision parameter, and the
    trainer's optimizer holds them."""
    from decoderlm.image import ImageProcessor
    from decoderlm.train.config import TrainConfig, resolve_new
    from decoderlm.train.distributed import World
    from decoderlm.train.image_text import ImageTextObjective, ImageTextSplit
    from decoderlm.train.optim import make_optimizer

    ours = load(pair[3], fuse=False)[0]
    gen = torch.Generator().manual_seed(2)
    pictures = [torch.randint(0, 256, (3, 56, 56), generator=gen, dtype=torch.uint8) for _ in range(2)]
    prompt = [5, START, *[IMAGE] * 4, END, 6, 7]
    examples = [[0, len(prompt), *prompt, 8, 9], [1, len(prompt) + 1, 5, *prompt, 10, 11, 12]]
    split = ImageTextSplit(pictures, examples, pad_id=0, processor=ImageProcessor())
    cfg = resolve_new(TrainConfig(data="d", out="r", batch_size=2))
    objective = ImageTextObjective(split, split, cfg, World(), torch.device("cpu"))
    loss, n = objective.loss(ours, split.batch([0, 1]))
    assert n == 2 + 3
    loss.backward()
    visual = dict(ours.visual.named_parameters())
    for name, p in visual.items():
        assert p.grad is not None and p.grad.abs().max() > 0, name
    held = {id(p) for group in make_optimizer(ours, cfg, torch.device("cpu")).param_groups for p in group["params"]}
    assert all(id(p) in held for p in visual.values())
