"""BlockManager: the bookkeeping of the paged KV cache (free list, reference counts, prefix cache).

Physical block 0 is a reserved dummy page that padded batch slots point at; it is never handed
out. Once a full block's K/V has been written (`mark_computed`), the block is registered in the
prefix cache under a chained hash (sha256 of the previous block's hash and its own token ids,
seeded by the sequence's optional `cache_salt`), so a later sequence with the same prefix reuses
the page instead of recomputing it. A lookup also compares token ids, so a hash collision never
shares a page.

A freed block keeps its cached content until it is handed out for something else. Free blocks are
handed out uncached ones first, then cached ones least recently freed first, so recently used
prefixes survive longest; blocks a live session keeps (`keep`: the content of a stored
conversation, by hash) are handed out only when no other free block is left, so a session's
next turn finds its prefix unless the pool had nothing else to give.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable

from engine.sequence import Sequence


def hash_block(parent: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full block: depends on every token before it too."""
    # A cryptographic hash: with Python's hash() crafted prompts can collide (vLLM CVE-2025-25183).
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def _root_hash(seq: Sequence) -> bytes:
    salt = seq.cache_salt
    if salt is None:
        return b""
    # surrogatepass: any str a caller passes hashes (a lone surrogate would otherwise raise on
    # the engine thread); distinct strings still give distinct bytes.
    return hashlib.sha256(b"salt:" + str(salt).encode("utf-8", "surrogatepass")).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Set once a block is full and computed; kept after it is freed, until it is handed out.
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Blocks with ref count 0, the next one to hand out first; those whose content a
        # session keeps wait apart, handed out only when the other free blocks are gone.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(1, num_blocks))
        self._kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._sessions: dict[str, set[bytes]] = {}  # session -> the block hashes it keeps
        self._keepers: collections.Counter[bytes] = collections.Counter()  # hash -> sessions
        # The highest block handed out so far. Never-used blocks go out in ascending order, so
        # blocks 1..this one are every block ever written: on the CPU the pool's memory becomes
        # resident as they are (ops.kv_cache.untouched).
        self.num_touched_blocks = 0
        self.prefix_cache_queries = 0  # full blocks of admitted sequences
        self.prefix_cache_hits = 0     # of those, how many reused a cached block

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, including cached ones (reusable)."""
        return len(self._free) + len(self._kept)

    @property
    def num_kept_blocks(self) -> int:
        """Free blocks whose content a live session keeps."""
        return len(self._kept)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # -- admission ----------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        return self._num_free_blocks_needed(seq, self._cache_hits(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached blocks for its leading full ones."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds KV blocks")
        if seq.block_size != self.block_size:
            raise ValueError(f"sequence block_size {seq.block_size} != {self.block_size}")
        hits = self._cache_hits(seq)
        needed = self._num_free_blocks_needed(seq, hits)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate sequence {seq.seq_id}: needs {needed} free KV "
                               f"blocks, {self.num_free_blocks} free")
        for block in hits:
            if self._ref_counts[block] == 0:
                self._claim(block)
            self._ref_counts[block] += 1
        new = [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.block_table = hits + new
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens // self.block_size
            self.prefix_cache_hits += len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size  # < num_tokens (see _cache_hits)
        seq.num_computed_tokens = seq.num_cached_tokens

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Cached physical blocks matching seq's leading full blocks, up to the first miss."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        h = _root_hash(seq)
        for i in range(seq.num_tokens // self.block_size):
            token_ids = tuple(seq.block(i))
            h = hash_block(h, token_ids)
            block = self._hash_to_block.get(h)
            if block is None or self._token_ids[block] != token_ids:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size == seq.num_tokens:
            # The last token is always computed (the step needs its logits): it must land in a
            # block of its own, never rewrite a block other sequences read (in bfloat16 the
            # rewrite need not even be bit-equal). As vLLM does, the last full block is
            # computed again in a private block.
            hits.pop()
        return hits

    def _num_free_blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        # A hit on a cached block that nobody holds takes it off the free list too.
        return seq.num_blocks - len(hits) + sum(self._ref_counts[b] == 0 for b in hits)

    def _take_free_block(self) -> int:
        block, _ = (self._free or self._kept).popitem(last=False)
        self._uncache(block)
        self._ref_counts[block] = 1
        self.num_touched_blocks = max(self.num_touched_blocks, block)
        return block

    def _uncache(self, block: int) -> None:
        h = self._hashes[block]
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]
        self._hashes[block] = self._token_ids[block] = None

    # -- progress -----------------------------------------------------------------------------

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that K/V of seq's first `num_computed_tokens` tokens are written.

        Blocks that became full and computed enter the prefix cache: a block allocated but not
        yet written must never be hit by another sequence.
        """
        if not 0 <= num_computed_tokens <= min(seq.num_tokens,
                                               len(seq.block_table) * self.block_size):
            raise ValueError(f"sequence {seq.seq_id}: {num_computed_tokens} computed tokens, but "
                             f"it has {seq.num_tokens} tokens in {len(seq.block_table)} blocks")
        # The scheduler books progress when it schedules (steps overlap); never move it back.
        seq.num_computed_tokens = max(seq.num_computed_tokens, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        table = seq.block_table
        end = num_computed_tokens // self.block_size
        start = end  # registered blocks are a prefix of the table: find where it ends
        while start > 0 and self._hashes[table[start - 1]] is None:
            start -= 1
        h = _root_hash(seq) if start == 0 else self._hashes[table[start - 1]]
        for i in range(start, end):
            token_ids = tuple(seq.block(i))
            h = hash_block(h, token_ids)
            block = table[i]
            self._hashes[block], self._token_ids[block] = h, token_ids
            old = self._hash_to_block.get(h)
            if old is not None and self._ref_counts[old] == 0:
                self._claim(old)
                self._uncache(old)  # a copy nobody holds: hand it out first
                self._release(old, first=True)
            self._hash_to_block[h] = block  # the newest copy wins

    def block_hash(self, block: int) -> bytes | None:
        """The prefix cache's hash of what `block` holds (full and computed), else None."""
        return self._hashes[block]

    def num_cached_blocks_of(self, seq: Sequence) -> int:
        """How many of seq's leading blocks are in the prefix cache (written and hashed)."""
        n = 0
        while n < len(seq.block_table) and self._hashes[seq.block_table[n]] is not None:
            n += 1
        return n

    # -- decode -------------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether the blocks that seq's tokens still lack (0 or 1 in decode) are available."""
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Extend seq's block table to hold all its tokens (after `append_token`)."""
        if not seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} holds no KV blocks: allocate it first")
        missing = seq.num_blocks - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"cannot extend sequence {seq.seq_id}: needs {missing} free KV "
                               f"blocks, {self.num_free_blocks} free")
        seq.block_table.extend(self._take_free_block() for _ in range(missing))

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past what seq's tokens need (after rejected drafts were dropped:
        nothing in them was cached, see `mark_computed`)."""
        if len(seq.block_table) > seq.num_blocks:
            seq.table_cuts += 1
        while len(seq.block_table) > seq.num_blocks:
            block = seq.block_table.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._uncache(block)
                self._release(block, first=True)

    # -- release ------------------------------------------------------------------------------

    def deallocate(self, seq: Sequence, keep_for: str | None = None) -> None:
        """Drop seq's blocks (finish or preemption by recompute). Harmless if it holds none.
        `keep_for`: a session that keeps the content of seq's cached blocks (`keep`)."""
        if keep_for is not None:
            self.keep(keep_for, [self._hashes[b] for b in seq.block_table
                                 if self._hashes[b] is not None])
        for block in reversed(seq.block_table):  # the tail of a chain is evicted before its head
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                h = self._hashes[block]
                if h is None or self._hash_to_block.get(h) != block:
                    self._uncache(block)  # nothing findable in it: hand it out first
                    self._release(block, first=True)
                else:
                    self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _release(self, block: int, first: bool = False) -> None:
        """A block nobody holds now joins the free blocks: last out (or first, `first`), apart
        when a session keeps its content."""
        h = self._hashes[block]
        free = self._kept if h is not None and self._keepers[h] else self._free
        free[block] = None
        if first:
            free.move_to_end(block, last=False)

    def _claim(self, block: int) -> None:
        """A free block taken off the free blocks (a prefix-cache hit, or moved)."""
        if block in self._free:
            del self._free[block]
        else:
            del self._kept[block]

    # -- sessions -----------------------------------------------------------------------------

    def keep(self, session: str, hashes: Iterable[bytes]) -> None:
        """`session` keeps the blocks of this content (prefix-cache hashes) cached: while it
        lives they are handed out only when no other free block is left."""
        kept = self._sessions.setdefault(session, set())
        for h in set(hashes) - kept:
            kept.add(h)
            self._keepers[h] += 1
            block = self._hash_to_block.get(h)
            if block is not None and block in self._free:
                del self._free[block]
                self._kept[block] = None

    def release(self, session: str) -> None:
        """The session is gone: its blocks become ordinary cached blocks (most recently freed)."""
        for h in self._sessions.pop(session, ()):
            self._keepers[h] -= 1
            if self._keepers[h]:
                continue
            del self._keepers[h]
            block = self._hash_to_block.get(h)
            if block is not None and block in self._kept:
                del self._kept[block]
                self._free[block] = None

    # -- tests --------------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (with `seqs`: all live ones)."""
        problems = []
        if self._ref_counts[0] or 0 in self._free or 0 in self._kept or \
                self._hashes[0] is not None:
            problems.append("block 0 is in use")
        for block in range(1, self.num_blocks):
            ref, free = self._ref_counts[block], block in self._free or block in self._kept
            if block in self._free and block in self._kept:
                problems.append(f"block {block} is free twice")
            h = self._hashes[block]
            if block in self._kept and not (h is not None and self._keepers[h]):
                problems.append(f"block {block} is kept apart for no session")
            if block in self._free and h is not None and self._keepers[h] and \
                    self._hash_to_block.get(h) == block:
                problems.append(f"block {block} is kept by a session but not apart")
            if ref < 0 or (ref == 0) != free:
                problems.append(f"block {block}: ref count {ref}, {free=}")
            h = self._hashes[block]
            if (h is None) != (self._token_ids[block] is None):
                problems.append(f"block {block}: hash and token ids disagree")
            elif free and h is not None and self._hash_to_block.get(h) != block:
                problems.append(f"free block {block} keeps stale cached content")
        if any(not 1 <= b < self.num_blocks for b in [*self._free, *self._kept]):
            problems.append("free list holds an invalid block id")
        for h, block in self._hash_to_block.items():
            token_ids = self._token_ids[block]
            if self._hashes[block] != h or token_ids is None or len(token_ids) != self.block_size:
                problems.append(f"hash table entry for block {block} is inconsistent")
        if seqs is not None:
            problems += self._check_sequences(list(seqs))
        if problems:
            raise AssertionError("; ".join(problems))

    def _check_sequences(self, seqs: list[Sequence]) -> list[str]:
        problems = []
        held = collections.Counter(b for seq in seqs for b in seq.block_table)
        for block in range(1, self.num_blocks):
            if held[block] != self._ref_counts[block]:
                problems.append(f"block {block}: ref count {self._ref_counts[block]}, "
                                f"held by {held[block]} sequences")
        for seq in seqs:
            if 0 in seq.block_table:
                problems.append(f"sequence {seq.seq_id} holds block 0")
            if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
                problems.append(f"sequence {seq.seq_id}: computed tokens outside its blocks")
            # Cached blocks are a prefix of the table, chained from the root, all computed.
            num_cached = sum(self._hashes[b] is not None for b in seq.block_table)
            if num_cached * self.block_size > max(seq.num_computed_tokens, seq.num_cached_tokens):
                problems.append(f"sequence {seq.seq_id}: a block not yet computed is cached")
            h = _root_hash(seq)
            for i, block in enumerate(seq.block_table[:num_cached]):
                token_ids = tuple(seq.block(i))
                h = hash_block(h, token_ids)
                if self._hashes[block] != h or self._token_ids[block] != token_ids:
                    problems.append(f"sequence {seq.seq_id}: block {i} is cached with other "
                                    "content")
                    break
        return problems
