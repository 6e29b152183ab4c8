"""`decoderlm serve` on a tiny random Qwen2-VL: OpenAI image_url parts (base64 data URLs) through the official
client, answered as `generate(images=...)` answers alone, also when batched with text requests; the prefix
cache shares an image's blocks only with the same image."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from serve_helpers import ServerProcess, metrics
from test_vlm import hf_config, write_vl_tokenizer

import decoderlm
from decoderlm.generate import generate
from decoderlm.image import ImageProcessor, expand_image_tokens, image_placeholder
from decoderlm.sampling import SamplingParams

QUESTION = "what is in this picture?"


def png(seed: int, size: tuple[int, int] = (112, 112)) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(data: bytes, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(data)}}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(hf_config("qwen2_vl")).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("qwen2-vl")
    hf.save_pretrained(folder)
    write_vl_tokenizer(folder)
    model, tok = decoderlm.load(folder)
    server = ServerProcess("--model", str(folder), "--max-batch", "8", "--kv-cache-memory", "4MiB")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    yield server, client, str(folder), model, tok
    server.stop()


def reference(model, tok, data: bytes | None, text: str, n: int) -> list[int]:
    """The greedy tokens `generate` gives alone, for the prompt the server builds."""
    content = (image_placeholder(tok, model.config.image_token_id) if data else "") + text
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True), add_special_tokens=False)
    images = ImageProcessor()([data]) if data else None
    if images is not None:
        ids = expand_image_tokens(ids, model.config.image_token_id, images.tokens(2))
    return generate(model, ids, SamplingParams(temperature=0.0, max_new_tokens=n), images=images)


def tokens(response) -> list[str]:
    """The answer's tokens, each as its text (what the logprobs carry)."""
    return [t.token for t in response.choices[0].logprobs.content]


def texts(tok, ids: list[int]) -> list[str]:
    return [tok.decode([i]) for i in ids]


def ask(client, name: str, messages: list[dict], n: int = 6):
    return client.chat.completions.create(model=name, messages=messages, max_tokens=n, temperature=0, logprobs=True,
                                          extra_body={"ignore_eos": True})


def test_image_answer_equals_generate_alone(served):
    _, client, name, model, tok = served
    data = png(1)
    got = ask(client, name, image_message(data))
    assert tokens(got) == texts(tok, reference(model, tok, data, QUESTION, 6))


def test_image_answers_batched_with_text_requests(served):
    server, _, name, model, tok = served
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    jobs = [(png(2), QUESTION), (None, "the quick brown fox"), (png(3, (56, 84)), "and this one?"), (None, "hello there, how are")]

    async def all_at_once():
        return await asyncio.gather(*[client.chat.completions.create(
            model=name, messages=image_message(d, t) if d else [{"role": "user", "content": t}], max_tokens=8, temperature=0,
            logprobs=True, extra_body={"ignore_eos": True}) for d, t in jobs])

    answers = asyncio.run(all_at_once())
    for (data, text), answer in zip(jobs, answers):
        assert tokens(answer) == texts(tok, reference(model, tok, data, text, 8))


def test_prefix_cache_shares_blocks_of_the_same_image_only(served):
    """Each prompt is 47 tokens: 2 full 16-token blocks, the image's 16 tokens from token 4 on. The same image again
    hits both blocks; a different image behind the same placeholder tokens hits nothing (its first block holds image tokens)."""
    server, client, name, model, tok = served

    def hits() -> float:
        return metrics(server.url)["decoderlm_prefix_cache_hits_total"]

    first, other = png(10), png(11)
    ask(client, name, image_message(first, "say"), 1)
    before = hits()
    ask(client, name, image_message(first, "say"), 1)
    assert hits() - before == 32
    before = hits()
    ask(client, name, image_message(other, "say"), 1)
    assert hits() == before


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "remote image URLs are not fetched by this server"),
    ("data:image/png;base64,@@@@", "the data URL's base64 does not decode"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "is not an image Pillow can read"),
    (data_url(png(4, (1, 300))), "too elongated"),
])
def test_bad_images_are_one_line_400s(served, url, message):
    _, client, name, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert e.value.param == "messages.0.content" and message in e.value.body["message"] and "\n" not in e.value.body["message"]


def test_an_oversized_image_is_a_400(served):
    _, client, name, _, _ = served
    out = io.BytesIO()
    Image.new("1", (9000, 8000)).save(out, format="PNG")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, max_tokens=2, messages=image_message(out.getvalue()))
    assert "more than the" in e.value.body["message"] and "downscale it first" in e.value.body["message"]
