"""The serving engine: many requests, one model, one KV pool, one loop.

`add_request` (from any thread, or from inside an asyncio loop) queues a prompt and returns a
`RequestStream` of `TokenOutput`s. A daemon thread runs `step()` while there is work: take new
requests and aborts, let the scheduler pick the rows, run one batched decode forward for every
sequence with a token to feed and one forward for the prompt chunks being read, sample every row
with its own params and generator, hand each token to its stream. The thread never holds the lock
while the model runs, so callers never wait on a forward for it; forwards release Python's GIL (an eager one
inside every kernel and torch op, the compiled step for its whole call), so an event loop in the same
process runs while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.generate import check_request
from decoderlm.kv_cache import cache_dtype
from decoderlm.model import Transformer
from decoderlm.model.vision import ImageEmbeds, Images
from decoderlm.quantize import DENSE_TOKENS, one_prompt_path, reading_prompt
from decoderlm.sampling import SamplingParams, finish_reason, sample_batch
from decoderlm.serve.images import PromptImages
from decoderlm.serve.compiled_step import CompiledPagedStep
from decoderlm.serve.paged_cache import NULL_BLOCK, BlockPool, PagedCache
from decoderlm.serve.scheduler import Scheduler, Sequence

log = logging.getLogger(__name__)

DEFAULT_KV_MEMORY = 1 << 30  # at most 1 GiB unless told otherwise


class EngineClosed(DecoderLMError):
    """A request that arrives after `shutdown`: the request was fine, the server is going away."""


@dataclass
class TokenOutput:
    token_id: int | None
    logprob: float | None = None  # log-softmax of the raw logits (before penalties and filters)
    top_logprobs: list[tuple[int, float]] | None = None  # the k most likely ids, when asked for
    finish_reason: str | None = None  # "stop" (stop token, not emitted), "length", "abort"


class RequestStream:
    """The outputs of one request, in order; the last one has finish_reason set. Iterate it with
    `for` (blocks for the next output) or, when read from an event loop, `async for` (the engine
    thread hands outputs over with call_soon_threadsafe, so the loop never waits on a lock)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finish_reason: str | None = None  # set by the engine when it sends the last output
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[TokenOutput] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue[TokenOutput] | None = None
        self._done = False  # the reader has seen the last output
        try:
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass  # no event loop here: a plain, blocking stream

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._async_queue = loop, asyncio.Queue()
        while not self._queue.empty():  # outputs that arrived before an async reader showed up
            self._async_queue.put_nowait(self._queue.get())

    def put(self, out: TokenOutput) -> None:
        """Called by the engine thread."""
        with self._lock:
            if out.finish_reason is not None:
                self.finish_reason = out.finish_reason
            if self._loop is None:
                self._queue.put(out)
                return
            loop, target = self._loop, self._async_queue
        try:
            loop.call_soon_threadsafe(target.put_nowait, out)
        except RuntimeError:
            pass  # the reader's loop is closed: nobody is listening any more

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenOutput:
        if self._done:
            raise StopIteration
        if self._loop is not None:
            raise DecoderLMError("this stream belongs to an asyncio event loop; read it with `async for`")
        out = self._queue.get()
        self._done = out.finish_reason is not None
        return out

    def __aiter__(self) -> RequestStream:
        with self._lock:
            if self._loop is None:
                self._bind(asyncio.get_running_loop())
        return self

    async def __anext__(self) -> TokenOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._async_queue.get()
        self._done = out.finish_reason is not None
        return out


class Engine:
    """Continuous batching over a paged KV cache. kv_cache_memory (bytes) or num_blocks sizes the
    pool; by default it holds max_batch full contexts, up to 1 GiB. The model must stay in eval mode
    and is used by the engine thread only.

    compile: decode steps through the compiled server step (`decoderlm.serve.compiled_step`): True builds
    it now if it is missing (about a minute, once per model, pool and machine); None uses it once its
    package exists (built earlier, or by a background `decoderlm compile --server` while this engine
    serves eagerly); False never. Prompt chunks always run eagerly."""

    def __init__(self, model: Transformer, max_batch: int = 16, kv_cache_memory: int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, prefill_chunk: int = 256, prefix_caching: bool = True, compile: bool | None = False) -> None:
        for name, value in (("max_batch", max_batch), ("block_size", block_size), ("prefill_chunk", prefill_chunk)):
            if value < 1:
                raise DecoderLMError(f"{name} must be >= 1, got {value}")
        if kv_cache_memory is not None and num_blocks is not None:
            raise DecoderLMError("give kv_cache_memory or num_blocks, not both")
        cfg = model.config
        self.model, self.device = model, model.norm.weight.device  # the embedding may be quantized
        dtype = cache_dtype(model)  # fp16 where the model keeps its keys so (`kv_cache.store_keys_in`)
        if num_blocks is None:
            per_token = BlockPool.bytes_per_token(cfg, dtype)
            memory = kv_cache_memory if kv_cache_memory is not None else min(DEFAULT_KV_MEMORY, max_batch * cfg.max_seq_len * per_token)
            num_blocks = memory // BlockPool.bytes_per_block(cfg, block_size, dtype) + 1  # + the null block
            if num_blocks < 2:
                raise DecoderLMError(f"kv_cache_memory {memory} bytes holds no block of {block_size} tokens; give more memory")
        self.pool = BlockPool(cfg, num_blocks, block_size, dtype, self.device)
        # Packed quantized layers may compute forwards of DENSE_TOKENS tokens per sequence or more on another path.
        self.two_paths = not one_prompt_path(model)
        scaling = cfg.rope_scaling or {}
        rope_switch = scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else None
        self.scheduler = Scheduler(self.pool, max_batch, prefill_chunk, prefix_caching, min_chunk=DENSE_TOKENS if self.two_paths else 1,
                                   rope_switch=rope_switch)
        # A sequence may grow while its next token has a position and a slot to go to, in every layer group.
        self.max_len = min(cfg.max_seq_len, self.pool.capacity // len(self.pool.groups) * block_size)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._active: dict[str, tuple[Sequence, RequestStream]] = {}
        self._counts = dict(prompt_tokens=0, generated_tokens=0, finished=0, aborted=0)
        self._gauges: dict[str, int] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self.compiled = None if compile is False else CompiledPagedStep(model, self.pool, max_batch, self.max_len)
        if compile:
            self.compiled.build()
        self._publish()

    # ---- the caller's side (any thread) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, logprobs: int | None = None,
                    request_id: str | None = None, images: Images | None = None) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream. Bad input raises here. images:
        the preprocessed images of the prompt's image placeholders, in order (a vision-language model)."""
        prompt = [int(t) for t in prompt_ids]
        check_request(self.model, prompt, params)
        prompt_images = PromptImages.of(self.model, prompt, images) if images is not None else None
        vocab = self.model.config.vocab_size
        if len(prompt) >= self.max_len:
            raise DecoderLMError(f"the prompt has {len(prompt)} tokens but the KV cache holds {self.max_len}; "
                                 "shorten the prompt or give the engine more kv_cache_memory")
        if logprobs is not None and not 0 <= logprobs <= vocab:
            raise DecoderLMError(f"logprobs must be in [0, {vocab}], got {logprobs}")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        seq = Sequence(request_id, prompt, len(prompt), params, params.generator(self.device), logprobs, images=prompt_images)
        stream = RequestStream(request_id)
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is shut down; start a new one")
            if request_id in self._active:
                raise DecoderLMError(f"request id {request_id!r} is already in use; give each request its own id")
            self._counts["prompt_tokens"] += len(prompt)
            if params.max_new_tokens == 0:
                self._counts["finished"] += 1
                stream.put(TokenOutput(None, finish_reason="length"))
                return stream
            self._active[request_id] = (seq, stream)
            self._inbox.append(seq)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are free after the next step. Unknown or finished ids are ignored."""
        with self._cond:
            if request_id in self._active:
                self._aborts.add(request_id)
                self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            stats = {**self._gauges, **self._counts}
            stats["waiting"] += len(self._inbox)
            return stats

    def start(self) -> None:
        """Run the loop in a daemon thread (do not call `step` yourself after this). For full speed no
        other living thread should have run torch work: build the model in a thread that has ended, as
        `decoderlm serve` does (decoderlm.cli.serve.in_passing_thread says why)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="decoderlm-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop; every unfinished stream ends with finish_reason "abort"."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._abort_all()

    # ---- the engine's side (one thread) ----

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._inbox or self._aborts or self.scheduler.has_work())

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._inbox or self._aborts or self.scheduler.has_work())
                if self._closed:
                    return
            try:
                self.step()
            except Exception:  # a bug must not hang every client: end their streams, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                self._abort_all()

    @torch.inference_mode()
    def step(self) -> None:
        """One round: take new requests and aborts, schedule, run the forwards, sample, emit."""
        with self._cond:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], set()
        self.scheduler.waiting.extend(inbox)
        for request_id in aborts:
            self._finish(request_id, TokenOutput(None, finish_reason="abort"))
        plan = self.scheduler.schedule()
        rows: list[Sequence] = []
        logits: list[torch.Tensor] = []
        if plan.decode:
            compiled = self.compiled is not None and self.compiled.ready()  # never for a model with images (`unsupported`)
            logits.append(self._compiled_decode(plan.decode) if compiled else self._forward([(seq, 1) for seq in plan.decode]))
            rows += plan.decode
        # Where they take two paths, chunks of DENSE_TOKENS or more and shorter ones run apart, each on the path it takes alone.
        groups = ([c for c in plan.prefill if c[1] >= DENSE_TOKENS], [c for c in plan.prefill if c[1] < DENSE_TOKENS]) if self.two_paths else (plan.prefill,)
        for group in groups:
            if group:
                with reading_prompt():  # a prompt's arithmetic, as `generate` reads it (BlockLinear.prompt_activations)
                    last = self._forward(group)
                done = [i for i, (seq, _) in enumerate(group) if seq.pending == 0]
                logits.append(last[done])
                rows += [group[i][0] for i in done]
        if rows:
            self._emit(rows, logits[0] if len(logits) == 1 else torch.cat(logits))
        self._publish()

    def _forward(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """One forward over rows that each feed their next n tokens; each row's last logits (B, V)."""
        T = max(n for _, n in chunks)
        ids = [[0] * (T - n) + seq.token_ids[seq.num_computed : seq.num_computed + n] for seq, n in chunks]  # left-padded
        seqs, news = [seq for seq, _ in chunks], [n for _, n in chunks]
        cache = PagedCache(self.pool, [seq.block_tables for seq in seqs], [seq.num_computed for seq in seqs], news,
                           seq_lens=[len(seq.token_ids) for seq in seqs])  # LongRoPE's factors follow each row's length
        inputs = self._image_inputs(chunks, T) if any(seq.images is not None for seq in seqs) else {}
        logits = self.model(torch.tensor(ids, device=self.device), cache=cache, logits_to_keep=1, **inputs).logits[:, -1]  # (B, V)
        for seq, n in chunks:
            self.scheduler.computed(seq, n)
        return logits

    def _compiled_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step through the compiled step: each row's next logits (B, V)."""
        bs, width = self.pool.block_size, self.compiled.width
        positions = [seq.num_computed for seq in seqs]
        tables = [seq.block_tables[0] for seq in seqs]  # the compiled step's models have one layer group
        slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, positions)]
        table = np.full((len(seqs), width), NULL_BLOCK, dtype=np.int64)  # (B, W): each row's blocks, then NULL_BLOCK
        for row, t in zip(table, tables):
            row[: len(t)] = t[:width]
        ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
        logits = self.compiled(torch.tensor(ids)[:, None], torch.tensor(positions)[:, None], torch.tensor(slots), torch.from_numpy(table),
                               torch.tensor(positions) + 1)
        for seq in seqs:
            self.scheduler.computed(seq, 1)
        return logits

    def _image_inputs(self, chunks: list[tuple[Sequence, int]], T: int) -> dict:
        """The forward's image embeddings at the chunks' image tokens and, with M-RoPE, every row's
        (t, h, w) positions (3, B, T): a text row's three are its plain positions."""
        at, embeds, positions = [], [], torch.zeros(3, len(chunks), T, dtype=torch.long)
        for b, (seq, n) in enumerate(chunks):
            start, row = seq.num_computed, [False] * T
            if seq.images is None:
                positions[:, b, T - n :] = torch.arange(start, start + n)
            else:
                row[T - n :], e = seq.images.chunk_embeds(self.model, start, n)
                embeds.append(e)
                if seq.images.positions is not None:
                    positions[:, b, T - n :] = seq.images.chunk_positions(start, n)
            at.append(row)
        inputs = dict(images=ImageEmbeds(torch.tensor(at, device=self.device), torch.cat(embeds)))
        if self.model.config.mrope_section:
            inputs["positions"] = positions.to(self.device)
        return inputs

    def _emit(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each row's next token and send it; finished rows leave the batch now."""
        params = [seq.params for seq in rows]
        seen = [seq.token_ids if seq.params.needs_history else [] for seq in rows]
        tokens = sample_batch(logits, params, [seq.generator for seq in rows], seen, [seq.prompt_len for seq in rows])
        wanted = [i for i, seq in enumerate(rows) if seq.logprobs is not None]
        logprobs = self._logprobs(logits[wanted], tokens[wanted], [rows[i].logprobs for i in wanted]) if wanted else []
        extras = dict(zip(wanted, logprobs))
        generated = 0
        for i, (seq, token) in enumerate(zip(rows, tokens.tolist())):
            logprob, top = extras.get(i, (None, None))
            reason = finish_reason(token, seq.num_generated + 1, seq.params, context_full=len(seq.token_ids) >= self.max_len)
            if reason == "stop":
                self._finish(seq.request_id, TokenOutput(None, finish_reason="stop"))
                continue
            seq.token_ids.append(token)
            generated += 1
            out = TokenOutput(token, logprob, top, finish_reason=reason)
            if reason is not None:
                self._finish(seq.request_id, out)
            else:
                self._stream(seq.request_id).put(out)
        with self._cond:
            self._counts["generated_tokens"] += generated

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[tuple[float, list[tuple[int, float]] | None]]:
        """(logprob of the chosen token, top-k (id, logprob) or None) per row, from the raw logits."""
        lp = logits.float().log_softmax(-1)  # (B, V)
        chosen = lp.gather(-1, tokens[:, None]).view(-1).tolist()
        if not max(ks):
            return [(c, None) for c in chosen]
        values, ids = lp.topk(max(ks), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        return [(c, list(zip(ids[i][:k], values[i][:k])) or None) for i, (c, k) in enumerate(zip(chosen, ks))]

    def _stream(self, request_id: str) -> RequestStream:
        return self._active[request_id][1]

    def _finish(self, request_id: str, out: TokenOutput) -> None:
        """The request's last output: it leaves the scheduler and its blocks go back to the pool."""
        with self._cond:
            if request_id not in self._active:
                return  # an abort that arrived while the request finished
            seq, stream = self._active.pop(request_id)
            self._counts["aborted" if out.finish_reason == "abort" else "finished"] += 1
        self.scheduler.remove(seq)
        stream.put(out)

    def _abort_all(self) -> None:
        with self._cond:
            ids = list(self._active)
            self._inbox, self._aborts = [], set()
        for request_id in ids:
            self._finish(request_id, TokenOutput(None, finish_reason="abort"))
        self._publish()

    def _publish(self) -> None:
        """Refresh the gauges `stats` reports, as of the end of a step."""
        used = self.pool.num_used()
        with self._cond:
            self._gauges = dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                                kv_blocks_total=self.pool.capacity, kv_blocks_used=used, kv_blocks_free=self.pool.capacity - used,
                                prefix_cache_queries=self.scheduler.prefix_queries, prefix_cache_hits=self.scheduler.prefix_hits,
                                preemptions=self.scheduler.preemptions)
