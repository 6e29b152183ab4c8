"""The serving engine: a busy batch gives every request the tokens `generate` gives it alone; blocks
are allocated, shared, preempted and freed as the pool allows; streams, aborts and stats behave."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import isa
from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.quantize import BlockLinear
from decoderlm.sampling import SamplingParams, sample, sample_batch
from decoderlm.serve import Engine, TokenOutput
from decoderlm.serve.paged_cache import NULL_BLOCK
from decoderlm.serve.scheduler import Sequence

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, max_seq_len=96)


def prompts(n: int, shared: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (1 to ~40 tokens), each starting with `shared` if given."""
    g = torch.Generator().manual_seed(seed)
    return [(shared or []) + torch.randint(0, 64, (1 + (7 * i) % 40,), generator=g).tolist() for i in range(n)]


def drain(engine: Engine) -> None:
    """Run the loop by hand (no thread) until every request is done."""
    while engine.has_work():
        engine.step()


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outputs if o.token_id is not None]


def check_ends_once(outputs: list[TokenOutput]) -> str:
    """Exactly one output, the last, carries the finish reason; return it."""
    assert [o.finish_reason is not None for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1].finish_reason


def assert_pool_empty(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == stats["waiting"] == 0
    assert all(r == 0 for r in engine.pool.ref_counts)


# ---- same answers as generate() ----


def test_busy_batch_from_many_threads_gives_each_request_its_solo_tokens(model):
    """18 prompts of different lengths, submitted concurrently from 6 threads to a running engine
    whose pool holds a fraction of them: preemption happens and changes nothing."""
    ps = prompts(18)
    expected = [generate(model, p, GREEDY) for p in ps]
    engine = Engine(model, max_batch=16, num_blocks=1 + 16, block_size=4, prefill_chunk=16)  # 64 slots, < 2 requests' worth each
    engine.start()
    results: dict[int, list[TokenOutput]] = {}
    together = threading.Barrier(6)

    def client(indices: range) -> None:
        together.wait()
        for i in indices:
            results[i] = list(engine.add_request(ps[i], GREEDY, request_id=f"r{i}"))

    threads = [threading.Thread(target=client, args=(range(k, 18, 6),)) for k in range(6)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    engine.shutdown()
    assert [tokens(results[i]) for i in range(18)] == expected
    assert all(check_ends_once(results[i]) == "length" for i in range(18))
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["finished"] == 18 and stats["aborted"] == 0
    assert stats["generated_tokens"] == sum(map(len, expected)) and stats["prompt_tokens"] == sum(map(len, ps))
    assert_pool_empty(engine)


def test_all_submitted_at_once_with_shared_prefixes(model):
    """A system prompt shared by 16 requests: the first wave of 6 (admitted together) computes it,
    every later request reads it from the prefix cache."""
    system = list(range(20, 40))  # 20 tokens: 5 full blocks of 4
    ps = prompts(16, shared=system, seed=1)
    params = [SamplingParams(temperature=0, max_new_tokens=4 + i % 9) for i in range(16)]
    expected = [generate(model, p, q) for p, q in zip(ps, params)]
    engine = Engine(model, max_batch=6, num_blocks=1 + 60, block_size=4, prefill_chunk=24)
    streams = [engine.add_request(p, q) for p, q in zip(ps, params)]
    drain(engine)
    assert [tokens(list(s)) for s in streams] == expected
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= (16 - 6) * len(system)
    assert stats["prefix_cache_queries"] >= sum(map(len, ps))
    assert_pool_empty(engine)


def test_penalties_and_stop_tokens_match_generate(model):
    ps = prompts(8, seed=2)
    params = [SamplingParams(temperature=0, max_new_tokens=10, repetition_penalty=1.3, frequency_penalty=1.5, presence_penalty=-0.5),
              SamplingParams(temperature=0, max_new_tokens=10, presence_penalty=2.0),
              SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[generate(model, ps[2], GREEDY)[3]]),
              GREEDY] * 2
    expected = [generate(model, p, q) for p, q in zip(ps, params)]
    engine = Engine(model, num_blocks=40, block_size=4)
    streams = [engine.add_request(p, q) for p, q in zip(ps, params)]
    drain(engine)
    outputs = [list(s) for s in streams]
    assert [tokens(o) for o in outputs] == expected
    assert check_ends_once(outputs[2]) == "stop" and outputs[2][-1].token_id is None and len(expected[2]) <= 3


def test_context_full_ends_with_length_on_the_last_token():
    model = tiny_model(vocab_size=64, max_seq_len=24)
    prompt = list(range(1, 20))
    params = SamplingParams(temperature=0, max_new_tokens=50)
    engine = Engine(model, num_blocks=20, block_size=4)
    stream = engine.add_request(prompt, params)
    drain(engine)
    out = list(stream)
    # generate() writes on past a full context by re-prefilling; up to that point the tokens agree
    assert tokens(out) == generate(model, prompt, params)[: len(tokens(out))]
    assert len(prompt) + len(tokens(out)) == 24 + 1  # the last token needs no slot: it is never fed
    assert out[-1].finish_reason == "length" and out[-1].token_id is not None


def test_real_smollm2_batch_matches_generate():
    import decoderlm

    smol, tok = decoderlm.load("smollm2-135m-instruct")
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =", "List three colors:"]
    ps = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    expected = [generate(smol, p, params) for p in ps]
    engine = Engine(smol, max_batch=4, num_blocks=16, prefill_chunk=8)  # chunked prompts next to decoding ones
    streams = [engine.add_request(p, params) for p in ps]
    drain(engine)
    assert [tokens(list(s)) for s in streams] == expected


CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =", "List three colors:",
         "Name a fruit that is red.", "Who wrote Hamlet?", "Say hello in Spanish.", "What is the boiling point of water?"]


# The plain CPU level runs every kernel at SSE width (and torch's, where decoderlm's cannot be built, unvectorized): fewer, shorter requests there.
PLAIN = isa.current() == "default"


@pytest.fixture(scope="module")
def smollm2_default():
    """The embedded model in the default mode (int4 on its Q4_1 blocks), as `chat` and `serve` run it."""
    import decoderlm

    return decoderlm.load("smollm2-135m-instruct", quantize="auto")


@pytest.mark.parametrize("prompts", ["fp32", "int16"])
def test_default_mode_busy_batch_gives_each_chat_its_solo_tokens(smollm2_default, prompts, monkeypatch):
    """Greedy, in the default int4 mode, with prompts read in fp32 or in int16 (`auto` on AVX512-VNNI): 8 chat
    prompts (34-38 tokens) served together, a long prompt read in chunks beside them and a second request
    sharing its prefix, each get exactly the tokens `generate` gives alone (the kernels' rows do not depend
    on their company; with fp32 prompts, prefill chunks and prefix hits keep each prompt token on the path
    it takes alone; int16 prompts have one path, and prompts are cut anywhere)."""
    smol, tok = smollm2_default
    for layer in (m for m in smol.modules() if isinstance(m, BlockLinear)):
        monkeypatch.setattr(layer, "prompt_activations", prompts)
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) for t in CHATS[: 3 if PLAIN else 8]]
    story = tok.encode(tok.apply_chat_template([{"role": "user", "content": SHAKESPEARE_LINES}]), add_special_tokens=False)
    shared = story[:-3] + chats[0][-3:]  # a later request that finds most of the story in the prefix cache
    assert all(34 <= len(p) <= 38 for p in chats) and len(story) >= 2 * 64
    params = SamplingParams(temperature=0, max_new_tokens=8 if PLAIN else 32)
    engine = Engine(smol, max_batch=10, block_size=16, prefill_chunk=96)
    assert engine.scheduler.min_chunk == (1 if prompts == "int16" else 64)
    for batch in (chats + [story], [shared] + chats[:2]):
        streams = [engine.add_request(p, params) for p in batch]
        drain(engine)
        assert [tokens(list(s)) for s in streams] == [generate(smol, p, params) for p in batch]
    assert engine.stats()["prefix_cache_hits"] >= 64


def test_default_mode_seeded_sampling_ignores_its_company(smollm2_default):
    smol, tok = smollm2_default
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a joke."}]), add_special_tokens=False)
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=8 if PLAIN else 24)
    engine = Engine(smol, max_batch=6)
    company = CHATS[: 2 if PLAIN else 5]
    others = [engine.add_request(tok.encode(t), SamplingParams(temperature=1.0, seed=i, max_new_tokens=4 + i)) for i, t in enumerate(company)]
    stream = engine.add_request(prompt, mine)
    drain(engine)
    assert tokens(list(stream)) == generate(smol, prompt, mine) and all(o.finished for o in others)


SHAKESPEARE_LINES = ("Summarise this: First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
                     "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. First Citizen: "
                     "First, you know Caius Marcius is chief enemy to the people. All: We know't, we know't. First Citizen: "
                     "Let us kill him, and we'll have corn at our own price. Is't a verdict?")


# ---- blocks: allocation, sharing, preemption, freeing ----


def test_blocks_follow_the_tokens_and_return_on_finish(model):
    engine = Engine(model, num_blocks=11, block_size=4)
    stream = engine.add_request(list(range(1, 7)), SamplingParams(temperature=0, max_new_tokens=8))
    engine.step()  # admitted with blocks for its 6 prompt tokens, prefilled, first token sampled
    seq = engine.scheduler.running[0]
    assert len(seq.block_tables[0]) == 2 and engine.stats()["kv_blocks_used"] == 2
    for _ in range(3):
        engine.step()
    assert len(seq.token_ids) == 10 and len(seq.block_tables[0]) == 3  # token 10 has a slot in block 3
    drain(engine)
    assert len(list(stream)) == 8
    assert_pool_empty(engine)


def test_a_request_that_cannot_grow_preempts_the_latest_and_both_finish(model):
    engine = Engine(model, num_blocks=1 + 6, block_size=4, prefix_caching=False)  # 24 slots
    params = SamplingParams(temperature=0, max_new_tokens=10)
    a, b = list(range(1, 9)), list(range(30, 38))
    sa, sb = engine.add_request(a, params), engine.add_request(b, params)
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["kv_blocks_free"] == 2
    drain(engine)
    assert engine.stats()["preemptions"] >= 1
    assert tokens(list(sa)) == generate(model, a, params) and tokens(list(sb)) == generate(model, b, params)
    assert_pool_empty(engine)


def test_common_prefix_shares_blocks_with_reference_counts(model):
    engine = Engine(model, num_blocks=30, block_size=4)
    prefix = list(range(1, 13))  # 3 full blocks
    params = SamplingParams(temperature=0, max_new_tokens=5)
    s1 = engine.add_request(prefix + [50, 51], params)
    engine.step()  # s1 prefilled: its full blocks are now named
    s2 = engine.add_request(prefix + [60], params)
    engine.step()
    one, two = engine.scheduler.running
    assert two.block_tables[0][:3] == one.block_tables[0][:3] and two.block_tables[0][3] != one.block_tables[0][3]
    assert all(engine.pool.ref_counts[b] == 2 for b in one.block_tables[0][:3])
    drain(engine)
    first = tokens(list(s1))
    assert first == generate(model, prefix + [50, 51], params)
    assert tokens(list(s2)) == generate(model, prefix + [60], params)
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == 14 + 13 and stats["prefix_cache_hits"] == 12
    assert_pool_empty(engine)
    # Finished, the blocks stay cached: the same prompt again is all hits but its last block.
    s3 = engine.add_request(prefix + [50, 51], params)
    drain(engine)
    assert engine.stats()["prefix_cache_hits"] == 12 + 12
    assert tokens(list(s3)) == first


def test_prefix_caching_off_shares_nothing(model):
    engine = Engine(model, num_blocks=30, block_size=4, prefix_caching=False)
    for _ in range(2):
        engine.add_request(list(range(1, 13)), GREEDY)
        drain(engine)
    assert engine.stats()["prefix_cache_hits"] == 0


# ---- aborts, shutdown, streams ----


def test_abort_frees_blocks_within_one_step(model):
    engine = Engine(model, num_blocks=30, block_size=4)
    running = engine.add_request(list(range(1, 10)), SamplingParams(temperature=0, max_new_tokens=50), request_id="long")
    waiting = engine.add_request(list(range(1, 5)), SamplingParams(temperature=0, max_new_tokens=50), request_id="queued")
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort("long")
    engine.abort("queued")
    engine.abort("no-such-request")  # ignored
    engine.step()
    assert_pool_empty(engine)
    for stream in (running, waiting):
        outputs = list(stream)
        assert check_ends_once(outputs) == "abort" and stream.aborted and outputs[-1].token_id is None
    assert engine.stats()["aborted"] == 2 and engine.stats()["finished"] == 0


def test_an_abort_racing_the_last_token_is_harmless(model):
    engine = Engine(model, num_blocks=10, block_size=4)
    stream = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=1), request_id="r")
    forward = engine._forward

    def racing(chunks):
        engine.abort("r")  # the client gives up while its last token is being computed
        return forward(chunks)

    engine._forward = racing
    drain(engine)
    assert check_ends_once(list(stream)) == "length"
    assert engine.stats()["finished"] == 1 and engine.stats()["aborted"] == 0


def test_a_failing_step_aborts_its_requests_and_the_loop_serves_on(model, caplog):
    engine = Engine(model, num_blocks=20, block_size=4)
    forward = engine._forward
    failures = iter([RuntimeError("boom")])

    def flaky(chunks):
        for error in failures:
            raise error
        return forward(chunks)

    engine._forward = flaky
    engine.start()
    try:
        broken = list(engine.add_request([1, 2, 3], GREEDY))
        fine = list(engine.add_request([1, 2, 3], GREEDY))
    finally:
        engine.shutdown()
    assert check_ends_once(broken) == "abort" and "boom" in caplog.text
    assert tokens(fine) == generate(model, [1, 2, 3], GREEDY)
    assert_pool_empty(engine)


def test_shutdown_aborts_every_unfinished_stream(model):
    engine = Engine(model, num_blocks=30, block_size=4)
    engine.start()
    streams = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=80)) for p in prompts(3)]
    next(iter(streams[0]))  # the loop is running
    engine.shutdown()
    for stream in streams:
        assert check_ends_once(list(stream)) == "abort"
    with pytest.raises(DecoderLMError, match="shut down"):
        engine.add_request([1], GREEDY)


def test_async_streams_from_an_event_loop(model):
    ps = prompts(5, seed=3)
    engine = Engine(model, num_blocks=60, block_size=4)
    engine.start()

    async def client(p):
        stream = engine.add_request(p, GREEDY)  # inside the running loop: outputs come by call_soon_threadsafe
        return [out async for out in stream]

    early = engine.add_request(ps[0], GREEDY)  # made outside any loop: read by `async for` later

    async def main():
        await asyncio.sleep(0.05)  # some of early's outputs arrive before its reader does
        return await asyncio.gather(*(client(p) for p in ps), collect(early))

    async def collect(stream):
        return [out async for out in stream]

    try:
        results = asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        engine.shutdown()
    assert [tokens(r) for r in results] == [generate(model, p, GREEDY) for p in ps + ps[:1]]


def test_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(model):
    engine = Engine(model, num_blocks=40, block_size=4, prefill_chunk=8)
    short = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=30))
    engine.step()
    long_prompt = list(range(2, 50))  # 48 tokens: 6 chunks of 8
    long = engine.add_request(long_prompt, SamplingParams(temperature=0, max_new_tokens=3))
    seq = None
    for step in range(6):
        engine.step()
        seq = seq or next(s for s in engine.scheduler.running if s.prompt_len == 48)
        assert seq.num_computed == 8 * (step + 1)
        assert engine.scheduler.running[0].num_generated == step + 2  # the short one got a token every step
    drain(engine)
    assert tokens(list(long)) == generate(model, long_prompt, SamplingParams(temperature=0, max_new_tokens=3))
    assert tokens(list(short)) == generate(model, [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=30))


def test_logprobs_are_the_raw_log_softmax(model):
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=0, max_new_tokens=4, repetition_penalty=1.5)  # penalties must not leak into logprobs
    engine = Engine(model, num_blocks=20, block_size=4)
    stream = engine.add_request(prompt, params, logprobs=3)
    drain(engine)
    outputs = list(stream)
    ids = prompt + tokens(outputs)
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)
    for j, out in enumerate(outputs):
        row = reference[len(prompt) - 1 + j]
        assert out.logprob == pytest.approx(float(row[out.token_id]), abs=1e-5)
        top = row.topk(3)
        assert [i for i, _ in out.top_logprobs] == top.indices.tolist()
        assert [v for _, v in out.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    stream = engine.add_request(prompt, GREEDY)
    drain(engine)
    quiet = list(stream)
    assert quiet[0].logprob is None and quiet[0].top_logprobs is None


# ---- seeded sampling ----


def test_seeded_request_draws_the_same_whatever_its_company(model):
    prompt = [9, 8, 7, 6]
    mine = SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=1234, max_new_tokens=15)

    def run(company: int) -> list[int]:
        engine = Engine(model, num_blocks=80, block_size=4)
        others = [SamplingParams(temperature=0.7 + 0.1 * i, min_p=0.05, max_new_tokens=5 + 3 * i) for i in range(company)]
        streams = [engine.add_request(p, q) for p, q in zip(prompts(company, seed=4), others)]
        result = engine.add_request(prompt, mine)
        streams.append(engine.add_request([1, 2], SamplingParams(temperature=1.0, seed=99, max_new_tokens=7)))
        drain(engine)
        return tokens(list(result))

    alone = run(0)
    assert run(5) == alone == run(11)
    assert alone == generate(model, prompt, mine)  # the same draws as the single-sequence path


# ---- input checks and stats ----


def test_bad_requests_raise_before_queueing(model):
    engine = Engine(model, num_blocks=1 + 5, block_size=4)  # 20 slots
    with pytest.raises(DecoderLMError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(DecoderLMError, match="context"):
        engine.add_request([1] * 96, GREEDY)
    with pytest.raises(DecoderLMError, match="KV cache"):
        engine.add_request([1] * 20, GREEDY)
    with pytest.raises(DecoderLMError, match="token ids"):
        engine.add_request([1, 64], GREEDY)
    with pytest.raises(DecoderLMError, match="logprobs"):
        engine.add_request([1], GREEDY, logprobs=-1)
    engine.add_request([1], GREEDY, request_id="x")
    with pytest.raises(DecoderLMError, match="already in use"):
        engine.add_request([2], GREEDY, request_id="x")
    with pytest.raises(DecoderLMError):
        Engine(model, max_batch=0)
    with pytest.raises(DecoderLMError, match="not both"):
        Engine(model, num_blocks=8, kv_cache_memory=1 << 20)
    with pytest.raises(DecoderLMError, match="no block"):
        Engine(model, kv_cache_memory=100)
    assert engine.stats()["waiting"] == 1 and engine.stats()["prompt_tokens"] == 1


def test_pool_sized_by_memory(model):
    per_token = 2 * 2 * 4 * 8 * 4  # K and V, 2 layers, 4 heads of 8 dims, fp32
    engine = Engine(model, kv_cache_memory=100 * per_token, block_size=16)
    assert engine.stats()["kv_blocks_total"] == 100 // 16


def test_zero_new_tokens_finishes_at_once(model):
    engine = Engine(model, num_blocks=8)
    outputs = list(engine.add_request([1, 2], SamplingParams(max_new_tokens=0)))
    assert [(o.token_id, o.finish_reason) for o in outputs] == [(None, "length")]
    assert engine.stats()["finished"] == 1


# ---- batched sampling ----


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]), top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]), min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.4]), frequency_penalty=st.sampled_from([0.0, 0.8, -1.0]),
    presence_penalty=st.sampled_from([0.0, 1.5]), seed=st.integers(0, 2**31 - 1),
)


@given(st.lists(row_params, min_size=1, max_size=6), st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_batched_sampling_draws_what_each_row_draws_alone(params, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), 50, generator=g) * 3  # (B, V)
    history = [torch.randint(0, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in params]
    prompt_lens = [len(h) // 2 for h in history]
    batched = sample_batch(logits, params, [p.generator() for p in params], history, prompt_lens)
    for i, p in enumerate(params):
        alone = sample(logits[i : i + 1], p, p.generator(), torch.tensor([history[i]]), prompt_lens[i])
        assert int(batched[i]) == int(alone)


@given(st.floats(-2, 2), st.floats(-2, 2), st.integers(0, 2**31 - 1))
def test_frequency_and_presence_penalties_follow_openai(frequency, presence, seed):
    """logit − frequency·count − presence·[count > 0], counting generated tokens only."""
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(seed))
    prompt, generated = [1, 1, 2], [2, 3, 3, 3]
    params = SamplingParams(temperature=0, frequency_penalty=frequency, presence_penalty=presence)
    counts = Counter(generated)
    expected = logits[0].clone()
    for token, n in counts.items():
        expected[token] -= frequency * n + presence
    assert int(sample(logits, params, seen=torch.tensor([prompt + generated]), prompt_len=3)) == int(expected.argmax())


def test_generate_honours_the_openai_penalties(model):
    """A hand-written greedy loop over full forwards, subtracting the penalties, gives generate's tokens."""
    prompt = [4, 4, 4, 9]
    params = SamplingParams(temperature=0, max_new_tokens=12, frequency_penalty=0.9, presence_penalty=0.6)
    ids, counts = list(prompt), Counter()
    with torch.inference_mode():
        for _ in range(12):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for token, n in counts.items():
                logits[token] -= 0.9 * n + 0.6
            ids.append(int(logits.argmax()))
            counts[ids[-1]] += 1
    assert generate(model, prompt, params) == ids[len(prompt):]
    assert generate(model, prompt, params) != generate(model, prompt, SamplingParams(temperature=0, max_new_tokens=12))


@pytest.mark.parametrize("bad", [dict(frequency_penalty=2.5), dict(presence_penalty=-2.1)])
def test_penalties_out_of_range_raise(bad):
    with pytest.raises(DecoderLMError, match="must be in"):
        SamplingParams(**bad)


# ---- sliding windows: blocks behind the window go back to the pool ----


@pytest.fixture(scope="module")
def sliding():
    return tiny_model(vocab_size=64, max_seq_len=96, sliding_window=8)  # every layer slides over 8 keys


def used_per_step(engine: Engine) -> list[int]:
    used = []
    while engine.has_work():
        engine.step()
        used.append(engine.stats()["kv_blocks_used"])
    return used


def test_sliding_window_blocks_go_back_while_a_long_sequence_decodes(sliding):
    engine = Engine(sliding, num_blocks=1 + 24, block_size=4)
    prompt, params = list(range(1, 11)), SamplingParams(temperature=0, max_new_tokens=40)
    stream = engine.add_request(prompt, params)
    used = used_per_step(engine)
    # The next query at position p sees p-7..p: at most 3 blocks of 4, plus the pending token's.
    assert max(used[:-1]) <= 4 and any(b < a for a, b in zip(used, used[1:]))
    assert tokens(list(stream)) == generate(sliding, prompt, params)
    assert_pool_empty(engine)


@pytest.fixture(scope="module")
def mixed():
    return tiny_model(vocab_size=64, max_seq_len=96, sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def test_a_mixed_model_gives_back_its_sliding_layers_blocks_and_keeps_the_full_ones(mixed):
    engine = Engine(mixed, num_blocks=1 + 26, block_size=4)  # a block holds one layer's keys: 2 groups, 1 layer each
    assert engine.pool.windows == [8, None] and engine.max_len == 52
    prompt, params = list(range(1, 11)), SamplingParams(temperature=0, max_new_tokens=40)
    stream = engine.add_request(prompt, params)
    held, used = [], []
    while engine.has_work():
        engine.step()
        held += [[sum(b != NULL_BLOCK for b in t) for t in seq.block_tables] for seq in engine.scheduler.running]
        used.append(engine.stats()["kv_blocks_used"])
    # Before the last step, 48 tokens computed in blocks of 4: the full layer holds all 12 blocks, the sliding one the 2
    # its next query (at 48) sees, 41..47; keeping every block would hold 24.
    assert held[-1] == [2, 12] and max(h[0] for h in held) <= 3 and used[-2] == 14
    assert tokens(list(stream)) == generate(mixed, prompt, params)
    assert_pool_empty(engine)


def test_a_prefix_hit_after_the_sliding_head_blocks_were_evicted(mixed):
    """A finished sequence's sliding-layer blocks behind the window went back first, so they are the first
    the pool reuses; the same prompt again shares the full layer's blocks and the sliding blocks its
    next query sees, never a block since given to another sequence."""
    engine = Engine(mixed, max_batch=1, num_blocks=1 + 26, block_size=2)  # 26 tokens in blocks of 2, in 2 groups
    prompt, params = prompts(4, seed=5)[3][:20], SamplingParams(temperature=0, max_new_tokens=6)
    first = engine.add_request(prompt, params)
    drain(engine)  # 13 blocks per group used, the 2 partial ones free again, the sliding head cached oldest
    engine.add_request([40, 41], SamplingParams(temperature=0, max_new_tokens=3))
    drain(engine)  # 3 blocks per group: the 2 free ones and the first 4 of the sliding head, evicted
    hits = engine.scheduler._hits(engine.scheduler._prefix_hashes(Sequence("again", prompt, 20, params)))
    assert [len(t) for t in hits] == [9, 9] and hits[0][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in hits[0][5:] + hits[1]
    again = engine.add_request(prompt, params)
    drain(engine)
    assert tokens(list(again)) == tokens(list(first)) == generate(mixed, prompt, params)
    assert engine.stats()["prefix_cache_hits"] == 18  # the second time: all 9 full blocks before the last token
    assert_pool_empty(engine)


def test_sliding_window_with_preemption_and_shared_prefixes_matches_generate(sliding):
    # Blocks of 2: each sequence holds ~5 blocks while decoding, four of them overflow the 12-block pool.
    engine = Engine(sliding, max_batch=4, num_blocks=1 + 12, block_size=2, prefill_chunk=8)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    batch = [p[:8] for p in prompts(4, shared=[5, 6, 7, 8])]  # prompt + new tokens fit the 24-slot pool
    streams = [engine.add_request(p, params) for p in batch]
    drain(engine)
    assert engine.stats()["preemptions"] >= 1 and engine.stats()["prefix_cache_hits"] > 0
    for p, s in zip(batch, streams):
        assert tokens(list(s)) == generate(sliding, p, params)
    assert_pool_empty(engine)
    # The first prompt again: its head blocks, given back behind the window, are shared from the cache.
    again = engine.add_request(batch[0], params)
    drain(engine)
    assert tokens(list(again)) == generate(sliding, batch[0], params)
