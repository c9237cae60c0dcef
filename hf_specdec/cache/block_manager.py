"""Block bookkeeping for the paged KV cache: pure Python, no torch.

Each KV group has its own pool of fixed-size blocks. A sequence owns, per group, a block table
that maps logical block ``j`` (token positions ``[j * block_size, (j + 1) * block_size)``) to a
physical block id of that group's pool::

    position:      0 ........ 15 | 16 ....... 31 | 32 ....... 47 | 48 ..
    full group:    block 7       | block 2       | block 9       | block 4
    sliding group: released (-1) | released (-1) | block 1       | block 5     (window 24)

Sliding groups release the blocks that no future query can see (all of their positions are
older than ``window`` tokens before the next query), so they hold about ``window`` tokens per
sequence however long it grows. Rollback (rejected drafts) only shortens a sequence: the blocks
past the new length go back to the pool and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RELEASED = -1


class OutOfBlocksError(RuntimeError):
    """A KV group has no free block left for a request."""


class BlockPool:
    """Free list of the physical blocks of one KV group."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # lowest ids first, released ones reused first
        self.high_water = 0  # 1 + the highest id ever handed out: the storage must hold this many blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        block = self._free.pop()
        self.high_water = max(self.high_water, block + 1)
        return block

    def release(self, block_id: int) -> None:
        self._free.append(block_id)


@dataclass
class _Sequence:
    num_tokens: int = 0
    tables: list[list[int]] = field(default_factory=list)  # per group: logical block -> physical id


class BlockManager:
    """Per-sequence block tables for every KV group.

    windows[g] is the sliding window of group g (``None`` for full attention). Every mutation checks
    capacity first and is all-or-nothing: an :class:`OutOfBlocksError` leaves every table unchanged.
    """

    def __init__(self, num_blocks: list[int], block_size: int, windows: list[int | None]):
        if len(num_blocks) != len(windows):
            raise ValueError("num_blocks and windows need one entry per KV group.")
        self.block_size = block_size
        self.windows = list(windows)
        self.pools = [BlockPool(n) for n in num_blocks]
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.version = 0  # grows whenever a block table changes (a block allocated, released or dropped)

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = _Sequence(tables=[[] for _ in self.pools])
        self.version += 1
        return seq_id

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def block_table(self, seq_id: int, group: int) -> list[int]:
        return self._seqs[seq_id].tables[group]

    def slot(self, seq_id: int, group: int, position: int) -> int:
        block = self._seqs[seq_id].tables[group][position // self.block_size]
        if block == RELEASED:
            raise IndexError(f"position {position} of sequence {seq_id} slid out of group {group}'s window.")
        return block * self.block_size + position % self.block_size

    def slots(self, seq_id: int, group: int, start: int, stop: int) -> list[int]:
        return [self.slot(seq_id, group, p) for p in range(start, stop)]

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks one group needs to hold ``num_new_tokens`` more tokens (same for every group)."""
        seq = self._seqs[seq_id]
        have = len(seq.tables[0]) if seq.tables else 0
        need = -(-(seq.num_tokens + num_new_tokens) // self.block_size)
        return max(0, need - have)

    def can_append(self, requests: dict[int, int]) -> bool:
        """Whether every group can take ``requests[seq_id]`` more tokens for each sequence at once."""
        total = sum(self.blocks_needed(s, n) for s, n in requests.items())
        return all(pool.num_free >= total for pool in self.pools)

    def append(self, requests: dict[int, int]) -> None:
        """Grow each sequence by ``requests[seq_id]`` tokens in every group (all or nothing)."""
        if not self.can_append(requests):
            short = [g for g, pool in enumerate(self.pools)
                     if pool.num_free < sum(self.blocks_needed(s, n) for s, n in requests.items())]
            raise OutOfBlocksError(
                f"KV group(s) {short} ran out of blocks ({[self.pools[g].num_free for g in short]} free). "
                "Raise CacheConfig.num_blocks (or leave it None to size the cache per request), "
                "or lower the batch size / max_new_tokens."
            )
        for seq_id, n in requests.items():
            seq = self._seqs[seq_id]
            extra = self.blocks_needed(seq_id, n)
            if extra:
                self.version += 1
                for g, pool in enumerate(self.pools):
                    seq.tables[g].extend(pool.allocate() for _ in range(extra))
            seq.num_tokens += n

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Rollback: keep the first ``num_tokens`` tokens and return the blocks past them."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot truncate sequence {seq_id} of {seq.num_tokens} tokens to {num_tokens}.")
        keep = -(-num_tokens // self.block_size)
        if seq.tables and len(seq.tables[0]) > keep:
            self.version += 1
        for g, pool in enumerate(self.pools):
            for block in seq.tables[g][keep:]:
                if block != RELEASED:
                    pool.release(block)
            del seq.tables[g][keep:]
        seq.num_tokens = num_tokens

    def slide(self, seq_id: int) -> None:
        """Release sliding-group blocks that the next query (at position ``num_tokens``) cannot see."""
        seq = self._seqs[seq_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            first_visible = seq.num_tokens - window + 1
            table = seq.tables[g]
            for j in range(max(0, first_visible) // self.block_size):
                if table[j] != RELEASED:
                    self.pools[g].release(table[j])
                    table[j] = RELEASED
                    self.version += 1

    def free_sequence(self, seq_id: int) -> None:
        self.truncate(seq_id, 0)
        del self._seqs[seq_id]
        self.version += 1

    def num_live_blocks(self, seq_id: int, group: int) -> int:
        return sum(b != RELEASED for b in self._seqs[seq_id].tables[group])
