"""The paged KV cache: one pool of fixed-size blocks per layer, and a block table per sequence.

A sequence's keys and values live in whatever blocks it was given, in table order, so memory grows
a block at a time with the tokens a sequence really has, and a finished one returns its blocks at
once. A full block is also named by a hash of its content and of every token before it; a later
sequence with the same prefix points its table at that block instead of computing it again
(prefix caching). Reference counts say how many tables hold a block; a block nobody holds but whose
content is known stays reusable in an LRU until the pool needs it back.

Attention kinds: a model that mixes sliding-window and full layers (Gemma-2/3, gpt-oss) gives each kind
its own block tables. The layers of one kind are cut into groups of g layers, g the greatest common
divisor of the kinds' layer counts (Gemma-2's 13 sliding and 13 full: 2 groups of 13; Gemma-3's 5:1:
6 groups of 1 in a 6-layer model), so every block holds the keys of g layers whichever group it serves
and all groups draw from one pool (`layer_groups`). A uniform model is one group of all its layers.
Each sequence keeps one table per group, all the same length: table index i means positions
i·block_size onwards in every group.

Sliding windows: in a group whose layers slide over a window W, the next query of a sequence, at
position p = its computed length, sees no key at or before p − W, nor does any later one. A block
whose last position is ≤ p − W is then given back to the pool (`Scheduler.computed`) and its table
entry becomes NULL_BLOCK; the mask hides those positions by their distance, whatever the null block
holds. Full groups keep every block, so a long Gemma-3 sequence holds its whole length in the groups
of its full layers (one in six) and only a window in the others. A given-back block keeps its name, so another prompt with that
prefix may still share it while it stays cached; a prefix hit needs, per sliding group, only the
blocks its next query sees (after a preemption a sequence is recomputed from its tokens like any other).

`PagedCache` is the view of one forward: a batch of sequences of different lengths, each adding
some new tokens, through the `decoderlm.model.cache.Cache` contract the model already writes through.
A decode step (one new token per row) attends in the pool itself, through the tables (`attend_one`).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque

import torch
import torch.nn.functional as F

from decoderlm import kernels
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model.cache import KEY_ALIGN, aligned, build_mask

NULL_BLOCK = 0  # never handed out: padding tokens write here, and padded table entries point here


def layer_groups(config: ModelConfig) -> list[list[int]]:
    """The layers that share block tables: each attention kind's layers, in groups of g (the gcd of
    the kinds' layer counts), so a block is the keys of g layers in every group."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(config.n_layers):
        kinds.setdefault(config.window(layer), []).append(layer)
    g = math.gcd(*map(len, kinds.values()))
    return [layers[i : i + g] for layers in kinds.values() for i in range(0, len(layers), g)]


def block_hash(parent: bytes | None, token_ids: list[int | str]) -> bytes:
    """The name of a full block: a digest of the previous block's name and this block's ids, so
    equal names mean equal tokens all the way from the start of the sequence (an image token is
    named by its image's content hash instead of its id)."""
    h = hashlib.sha256(parent or b"")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class BlockPool:
    """K and V for num_blocks × block_size token slots in each of g layers, and the bookkeeping of who
    holds which block. Slot s of block b is row b·block_size + s of each (slots, Hkv, D) tensor; the
    block serves one layer group at a time, whose j-th layer keeps its keys in tensor j (`place`)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if block_size < 1 or num_blocks < 2:
            raise DecoderLMError(f"a KV pool needs block_size >= 1 and at least 2 blocks (one is reserved), "
                                 f"got {num_blocks} blocks of {block_size}")
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        self.groups = layer_groups(config)
        self.windows = [config.window(group[0]) for group in self.groups]  # each group's window (None: full attention)
        self.place = {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group)}  # layer → (group, tensor)
        k_shape, v_shape = config.kv_cache_widths  # (Hkv, D) each; MLA: the latent and the RoPE key
        # Zeros, not empty: masked slots still enter softmax·V with weight 0, and 0·NaN would be NaN.
        width = len(self.groups[0])
        self.k = [torch.zeros((num_blocks * block_size, *k_shape), dtype=dtype, device=device) for _ in range(width)]  # (slots, Hkv, D)
        self.v = [torch.zeros((num_blocks * block_size, *v_shape), dtype=dtype, device=device) for _ in range(width)]
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))  # blocks with no known content
        self.cached: OrderedDict[int, None] = OrderedDict()  # held by nobody, content known; oldest first
        self.by_hash: dict[bytes, int] = {}

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """KV memory one token takes: K and V of every layer (MLA: its latent and RoPE key)."""
        (k_heads, k_width), (v_heads, v_width) = config.kv_cache_widths
        return config.n_layers * (k_heads * k_width + v_heads * v_width) * torch.finfo(dtype).bits // 8

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """KV memory one block takes: block_size tokens of one layer group."""
        return BlockPool.bytes_per_token(config, dtype) * block_size // len(layer_groups(config))

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def num_available(self) -> int:
        """Blocks that `allocate` can hand out now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.cached)

    def num_used(self) -> int:
        return self.capacity - self.num_available()

    def allocate(self) -> int:
        """A block for new content (ref count 1): a free one, else the least recently used cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hashes[block]]
            self.hashes[block] = None
        else:
            raise DecoderLMError("the KV pool is out of blocks")  # the scheduler checks first; reaching this is a bug
        self.ref_counts[block] = 1
        return block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks for the longest run of `hashes` from the start (not yet taken)."""
        blocks = []
        for h in hashes:
            if h not in self.by_hash:
                break
            blocks.append(self.by_hash[h])
        return blocks

    def take(self, block: int) -> None:
        """Share a cached block: one more table holds it."""
        if self.ref_counts[block] == 0:
            del self.cached[block]
        self.ref_counts[block] += 1

    def register(self, block: int, h: bytes) -> None:
        """A block just became full with the content named h; later prefixes may share it. When that
        content is already cached in another block, this one stays anonymous."""
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hashes[block] = h

    def release(self, blocks: list[int]) -> None:
        """A table drops these blocks. Give them in reverse table order: the LRU then evicts a
        prefix's tail before its head, which more sequences are likely to share."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hashes[block] is not None:
                    self.cached[block] = None
                else:
                    self.free.append(block)


class PagedCache:
    """One forward over a batch of sequences in a BlockPool. Row i has `context_lens[i]` tokens
    cached and adds `new_lens[i]` tokens, left-padded to T = max(new_lens) so every row's newest
    token is the last column (the model's logits_to_keep=1 then picks each row's next-token logits).
    block_tables[i][g] is row i's table for layer group g; each must already cover context + new tokens.
    seq_lens: each row's whole length (for a RoPE whose frequencies depend on it, LongRoPE's), when known.

    A prefill chunk's attention gathers each row's blocks into a padded (B, Hkv, L, D) tensor; the mask
    hides padding and unwritten slots by position. A decode step's reads them where they are
    (`attend_one`). Padding columns write into the null block, which no table really uses."""

    def __init__(self, pool: BlockPool, block_tables: list[list[list[int]]], context_lens: list[int],
                 new_lens: list[int], seq_lens: list[int] | None = None) -> None:
        bs, device = pool.block_size, pool.k[0].device
        B, T, G = len(new_lens), max(new_lens), len(pool.groups)
        totals = [c + n for c, n in zip(context_lens, new_lens)]
        unit = math.lcm(bs, KEY_ALIGN) // bs  # whole blocks that hold a multiple of KEY_ALIGN slots
        width = -(-max(-(-t // bs) for t in totals) // unit) * unit  # blocks in the longest row, rounded up
        for tables, total in zip(block_tables, totals):
            if len(tables) != G or any(len(t) * bs < total for t in tables):
                raise DecoderLMError(f"{len(tables)} block tables of {[len(t) for t in tables]} blocks cannot hold {total} tokens "
                                     f"in {G} layer groups")
        tables = torch.tensor([[list(row[g][:width]) + [NULL_BLOCK] * (width - len(row[g][:width])) for row in block_tables]
                               for g in range(G)], device=device)  # (G, B, W)
        self.blocks = tables.view(G, -1)  # (G, B·W)
        slots = (tables[..., None] * bs + torch.arange(bs, device=device)).view(G, B, width * bs)  # (G, B, L): slot of position j
        positions = [[0] * (T - n) + list(range(c, c + n)) for c, n in zip(context_lens, new_lens)]
        self.q_pos = torch.tensor(positions, device=device)  # (B, T); padding columns: position 0
        is_new = torch.tensor([[False] * (T - n) + [True] * n for n in new_lens], device=device)
        new_slots = slots.gather(2, self.q_pos.expand(G, B, T))  # (G, B, T)
        self.write_slots = torch.where(is_new, new_slots, NULL_BLOCK * bs).view(G, -1)  # (G, B·T)
        self.k_pos = torch.arange(width * bs, device=device)[None]  # (1, L): slot j of a row holds position j
        self.pool, self.shape, self.dtype = pool, (B, T, width * bs), pool.dtype
        self.lengths, self.totals, self.new_lens = list(context_lens), totals, list(new_lens)
        self.seq_lens = seq_lens

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return self.q_pos

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        # Causality alone hides the slots not yet written: they hold positions after every query.
        return build_mask(self.q_pos, self.k_pos, window, dtype)  # (B, 1, T, L)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k, v (B, Hkv, T, D) into their slots; the layer's pool tensors (slots, Hkv, D)."""
        B, T, L = self.shape
        g, j = self.pool.place[layer]  # the layer's group (its tables) and its tensor in the pool
        pool_k, pool_v, write_slots = self.pool.k[j], self.pool.v[j], self.write_slots[g]
        pool_k.index_copy_(0, write_slots, k.transpose(1, 2).reshape(B * T, *pool_k.shape[1:]).to(pool_k.dtype))
        pool_v.index_copy_(0, write_slots, v.transpose(1, 2).reshape(B * T, *pool_v.shape[1:]).to(pool_v.dtype))
        return pool_k, pool_v

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k, v (B, Hkv, T, D) into their slots; gather every row's keys/values (B, Hkv, L, D)."""
        B, T, L = self.shape
        pool_k, pool_v = self.write(layer, k, v)
        blocks = self.blocks[self.pool.place[layer][0]]
        # Gather whole blocks (block_size slots in one copy), not single slots.
        N, bs = self.pool.num_blocks, self.pool.block_size
        keys = pool_k.view(N, bs, *pool_k.shape[1:]).index_select(0, blocks).view(B, L, *pool_k.shape[1:]).transpose(1, 2)  # (B, Hkv, L, D)
        values = pool_v.view(N, bs, *pool_v.shape[1:]).index_select(0, blocks).view(B, L, *pool_v.shape[1:]).transpose(1, 2)
        return keys.to(k.dtype), values.to(v.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool, scale: float | None = None,
               attention=F.scaled_dot_product_attention) -> torch.Tensor:
        """Attention (B, H, T, Dv) one row at a time, each row's queries over its own keys rounded up to a
        multiple of 16, as `generate` computes it alone: SDPA's CPU kernel splits its work by the batch's
        shape, so a row attended in a batch would come out different in its last bits. Padding queries
        get zeros. `attention`: SDPA or a function of its signature (MLA's latent attention)."""
        B, T, _ = self.shape
        y = q.new_zeros((*q.shape[:-1], v.shape[-1]))  # (B, H, T, Dv)
        for i, (n, total) in enumerate(zip(self.new_lens, self.totals)):
            L = aligned(total)
            y[i : i + 1, :, T - n :] = attention(
                q[i : i + 1, :, T - n :], k[i : i + 1, :, :L], v[i : i + 1, :, :L], attn_mask=mask[i : i + 1, :, T - n :, :L], scale=scale,
                enable_gqa=gqa)
        return y

    def attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
        """A decode step's attention (B, H, 1, D) on decoderlm's kernel, which reads each row's keys and
        values in the pool's blocks through its table (no gather): k, v (B, Hkv, 1, D) are written first."""
        pool_k, pool_v = self.write(layer, k, v)
        return kernels.attend_one(q, pool_k, pool_v, mask, scale, blocks=self.tables(layer))

    def rope_attend_one(self, layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
        """A decode step's attention (B, H, D) from the fused projection qkv (B, H + 2·Hkv, D) in one kernel
        call (`kernels.rope_attend_one`): q and k rotated, each row's k and v written at its next position in
        its blocks, attention there. The same numbers as apply_rope_ and `attend_one`."""
        if self.shape[1] != 1 or min(self.new_lens) != 1:
            raise RuntimeError("rope_attend_one is a decode step's: every row adds one token")
        j = self.pool.place[layer][1]
        return kernels.rope_attend_one(qkv, *rope, self.pool.k[j], self.pool.v[j], self.lengths, mask, scale, blocks=self.tables(layer))

    def tables(self, layer: int) -> tuple[torch.Tensor, int, list[int]]:
        """How the kernels find this layer's keys: its group's block tables (B, W), the block size and each
        row's length after this forward (`kernels.attend_one`'s blocks)."""
        return self.blocks[self.pool.place[layer][0]].view(self.shape[0], -1), self.pool.block_size, self.totals

    def advance(self, n: int) -> None:
        """The forward is done: each row's new tokens now count as cached (see `lengths`)."""
        self.lengths = self.totals
