"""Which sequences run in the next step, and with which blocks.

Requests wait in a queue (first come, first served) and are admitted while the pool has blocks for
their prompt and the batch has room. Each step, every running sequence that has one token to feed
is decoded (one batched forward), and sequences still reading their prompt get the next chunk of it
(at most `prefill_chunk` padded tokens per step, so a huge prompt cannot stall the others). When a
growing sequence finds the pool empty, the most recently admitted sequence is preempted: its blocks
go back to the pool and it waits at the head of the queue, to be recomputed from its tokens later
(its full blocks usually still sit in the prefix cache, so that is cheap).

A quantized model that reads prompts in fp32 computes a forward of `min_chunk` tokens per sequence or more
on another path than shorter ones (decoderlm.quantize.DENSE_TOKENS), with other rounding; one that reads
them in int16 (`auto` on AVX512-VNNI) has one path, and min_chunk is 1. So that every prompt token takes
the path `generate` gives it when it reads the whole prompt alone, a prompt of min_chunk tokens or
more is read in chunks of at least min_chunk tokens, at least that many of it are computed even when
the prefix cache holds more, and the prefix cache shares blocks only between prompts on the same side
of min_chunk and only blocks of prompt tokens (generated ones were computed one at a time).

A sequence has one block table per layer group (decoderlm.serve.paged_cache.layer_groups), all the
same length, so each new block position takes one block per group. In a group of sliding-window
layers each computed step gives back the leading blocks no later query can see, and the pool's free
count grows back while a long sequence decodes; full groups keep theirs. Admission still asks for
blocks for all of a sequence's tokens in every group (the prompt, or everything after a preemption),
as prefill writes them before the oldest fall out of the window; so a sequence never outgrows what an
empty pool can admit (Engine.max_len).

LongRoPE (Phi-3) rotates with its short factors while a sequence is at most `rope_switch` tokens long
and with its long ones after. As transformers' generate does, a sequence whose keys were computed
short and that grows past the switch is computed again from its tokens (its blocks go back and it is
readmitted first); a sequence longer than the switch when admitted is computed long from the start,
every prompt chunk included. Long-computed blocks have names of their own in the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from decoderlm.sampling import SamplingParams
from decoderlm.serve.images import PromptImages
from decoderlm.serve.paged_cache import NULL_BLOCK, BlockPool, block_hash


def group_name(h: bytes, group: int) -> bytes:
    """A block's name in the pool: its tokens' name and its layer group (each group keeps other layers' keys)."""
    return h + group.to_bytes(2, "big")


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it: its tokens, and where their keys/values are."""

    request_id: str
    token_ids: list[int]  # the prompt, then every generated token
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None
    logprobs: int | None = None
    block_tables: list[list[int]] = field(default_factory=list)  # per layer group; NULL_BLOCK for blocks given back behind the window
    block_hashes: list[bytes] = field(default_factory=list)  # names of the full blocks' tokens, in table order
    num_computed: int = 0  # tokens whose keys/values are in the pool
    num_dropped: list[int] = field(default_factory=list)  # per group, leading blocks given back: no query can see them any more
    long_rope: bool = False  # its keys are computed with LongRoPE's long factors: it was past the switch when admitted
    images: PromptImages | None = None  # the prompt's images, for a vision-language model

    def keys(self, start: int, end: int) -> list[int | str]:
        """What names tokens start .. end in the prefix cache: their ids, an image token its image's content hash."""
        ids = self.token_ids[start:end]
        return ids if self.images is None else [self.images.keys.get(j, t) for j, t in enumerate(ids, start)]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens still to feed: the prompt (or what is left of it), or the last sampled token."""
        return len(self.token_ids) - self.num_computed


@dataclass
class StepPlan:
    """What the next forwards compute: decode rows (one token each) and prefill rows (a chunk each)."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, prefill_chunk: int, prefix_caching: bool, min_chunk: int = 1,
                 rope_switch: int | None = None) -> None:
        self.pool, self.max_batch, self.prefill_chunk, self.prefix_caching = pool, max_batch, prefill_chunk, prefix_caching
        self.rope_switch = rope_switch  # LongRoPE's original context: longer sequences take the long factors
        self.windows = pool.windows  # each layer group's sliding window (None: it sees everything)
        self.min_chunk = min_chunk if min_chunk <= prefill_chunk else 1  # a chunk never exceeds prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # ... and found there

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.pool.block_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        for seq in list(self.running):
            if self.rope_switch is not None and not seq.long_rope and len(seq.token_ids) > self.rope_switch:
                self._restart(seq)  # its keys were rotated with the short factors
        self._admit()
        decode = [seq for seq in self._grow() if seq.pending == 1]
        return StepPlan(decode, self._chunks())

    def computed(self, seq: Sequence, n: int) -> None:
        """n more tokens of seq are in the pool; name the blocks that just became full, then give
        back those that fell out of the window."""
        seq.num_computed += n
        bs = self.pool.block_size
        if self.prefix_caching:
            computed = min(seq.num_computed, seq.prompt_len) if self.min_chunk > 1 else seq.num_computed
            for i in range(len(seq.block_hashes), computed // bs):
                h = block_hash(seq.block_hashes[-1] if i else self._root(seq), seq.keys(i * bs, (i + 1) * bs))
                seq.block_hashes.append(h)
                for g, table in enumerate(seq.block_tables):
                    if table[i] != NULL_BLOCK:  # a given-back block is no longer this table's to name
                        self.pool.register(table[i], group_name(h, g))
        for g, window in enumerate(self.windows):
            if window is not None:
                n_out = min(self._behind(seq.num_computed, window), len(seq.block_tables[g]))
                for i in range(seq.num_dropped[g], n_out):
                    self.pool.release([seq.block_tables[g][i]])
                    seq.block_tables[g][i] = NULL_BLOCK
                seq.num_dropped[g] = max(seq.num_dropped[g], n_out)

    def _behind(self, n_computed: int, window: int) -> int:
        """Leading blocks no query sees any more: the next one sits at position n_computed and sees no
        key at or before n_computed - window."""
        return max(0, (n_computed - window + 1) // self.pool.block_size)

    def remove(self, seq: Sequence) -> None:
        """seq is finished or aborted: it leaves the queues and its blocks go back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        for table in seq.block_tables:
            self.pool.release([b for b in table[::-1] if b != NULL_BLOCK])
        seq.block_tables, seq.block_hashes, seq.num_computed, seq.num_dropped = [], [], 0, []

    def _admit(self) -> None:
        """Move waiting sequences into the batch while there is room and the pool holds their
        tokens, keeping back the blocks running sequences need this step."""
        bs, G = self.pool.block_size, len(self.windows)
        growing = G * sum(len(s.block_tables[0]) * bs < len(s.token_ids) for s in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            hashes = self._prefix_hashes(seq)
            hits = self._hits(hashes)  # per group, NULL_BLOCK where a sliding group needs none
            held = [b for table in hits for b in table if b != NULL_BLOCK]
            new = self.blocks_for(len(seq.token_ids)) - len(hits[0])
            idle_hits = sum(self.pool.ref_counts[b] == 0 for b in held)  # taking them shrinks the pool too
            if G * new + idle_hits + growing > self.pool.num_available():
                return
            self.waiting.popleft()
            for block in held:
                self.pool.take(block)
            seq.block_tables = [table + [self.pool.allocate() for _ in range(new)] for table in hits]
            seq.block_hashes = hashes[: len(hits[0])]
            seq.num_computed = len(hits[0]) * bs
            seq.num_dropped = [table.count(NULL_BLOCK) for table in hits]
            seq.long_rope = self.rope_switch is not None and len(seq.token_ids) > self.rope_switch
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += seq.num_computed
            self.running.append(seq)

    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Names of seq's leading full blocks to look up in the prefix cache. The last token is
        always left to compute, since its forward gives the logits for the next one."""
        if not self.prefix_caching:
            return []
        bs, hashes, n = self.pool.block_size, [], len(seq.token_ids)
        for i in range((n - (self.min_chunk if n >= self.min_chunk else 1)) // bs):
            hashes.append(block_hash(hashes[-1] if i else self._root(seq), seq.keys(i * bs, (i + 1) * bs)))
        return hashes

    def _hits(self, hashes: list[bytes]) -> list[list[int]]:
        """The cached blocks, per group, of the longest run of n leading blocks a sequence can resume
        after: a full group needs all n, a sliding group only those its next query (at position
        n·block_size) sees; the others are NULL_BLOCK, as if given back."""
        groups = range(len(self.windows))
        longest = min([len(hashes)] + [len(self.pool.lookup([group_name(h, g) for h in hashes])) for g in groups if self.windows[g] is None])
        for n in range(longest, 0, -1):
            tables = []
            for g, window in enumerate(self.windows):
                first = 0 if window is None else min(n, self._behind(n * self.pool.block_size, window))
                blocks = self.pool.lookup([group_name(h, g) for h in hashes[first:n]])
                if len(blocks) < n - first:
                    break
                tables.append([NULL_BLOCK] * first + blocks)
            else:
                return tables
        return [[] for _ in groups]

    def _root(self, seq: Sequence) -> bytes | None:
        """What a sequence's first block name starts from: its side of min_chunk and of LongRoPE's switch
        (None: no sides)."""
        sides = [] if self.min_chunk == 1 else [b"long" if seq.prompt_len >= self.min_chunk else b"short"]
        if self.rope_switch is not None and len(seq.token_ids) > self.rope_switch:
            sides.append(b"long-rope")
        return b"|".join(sides) or None

    def _grow(self) -> list[Sequence]:
        """Give each running sequence a slot for its pending token, preempting the latest admitted
        sequences while the pool is empty. Returns the sequences still running."""
        bs = self.pool.block_size
        for seq in list(self.running):
            while seq in self.running and len(seq.block_tables[0]) * bs < len(seq.token_ids):
                if self.pool.num_available() >= len(seq.block_tables):
                    for table in seq.block_tables:
                        table.append(self.pool.allocate())
                else:
                    self._preempt(self.running[-1])
        return self.running

    def _preempt(self, seq: Sequence) -> None:
        self._restart(seq)
        self.preemptions += 1

    def _restart(self, seq: Sequence) -> None:
        """seq gives back its blocks and waits first in line, to be computed again from its tokens."""
        self.running.remove(seq)
        self._free(seq)
        self.waiting.appendleft(seq)

    def _chunks(self) -> list[tuple[Sequence, int]]:
        """Prefill rows for this step: the next chunk of each prompt, in admission order, while the
        padded batch (rows × longest chunk) stays within prefill_chunk tokens."""
        rows: list[tuple[Sequence, int]] = []
        width = 0
        for seq in self.running:
            if seq.pending <= 1:
                continue
            share = self.prefill_chunk // (len(rows) + 1)
            if share < 1 or width > share:
                break
            n = self._chunk(seq, share)
            if n:
                rows.append((seq, n))
                width = max(width, n)
        return rows

    def _chunk(self, seq: Sequence, share: int) -> int:
        """The tokens of seq to read now, at most share: a long prompt's chunks, the rest of it
        included, are never shorter than min_chunk (0: wait for a wider share)."""
        n = min(seq.pending, share)
        if seq.prompt_len < self.min_chunk or n == seq.pending:
            return n
        n = min(n, seq.pending - self.min_chunk)
        return n if n >= self.min_chunk else 0
