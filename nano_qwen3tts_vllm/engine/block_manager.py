"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and xxhash-chained prefix reuse."""
from __future__ import annotations

from collections import deque

import xxhash

from .sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.content = b""  # a hashed prompt block's content, checked on a hash hit

    def reset(self) -> None:
        self.ref_count = 1
        self.content = b""


class BlockManager:
    """Blocks whose content hash is known stay findable after they are freed, until reused:
    a later prompt with the same prefix (same instruct, same cloned voice) reuses their KV."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @staticmethod
    def compute_hash(content: bytes, prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(content)
        return h.intdigest()

    def _hashable(self, seq: Sequence, i: int) -> bool:
        # Only full prompt blocks, and never the block holding the last position: the prefill
        # must compute at least one position to get the hidden state the predictor starts from.
        end = (i + 1) * self.block_size
        return self.enable_prefix_caching and end <= seq.num_prompt_tokens and end < seq.num_tokens

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table
        h, cache_miss = -1, False
        for i in range(seq.num_blocks):
            content = seq.block_bytes(i) if self._hashable(seq, i) else b""
            h = self.compute_hash(content, h) if content else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].content != content:
                cache_miss = True
            if cache_miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.content = content
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def needs_block(self, seq: Sequence) -> bool:
        # the next decode step writes position seq.num_tokens
        return len(seq.block_table) * self.block_size <= seq.num_tokens

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= int(self.needs_block(seq))

    def may_append(self, seq: Sequence) -> None:
        if self.needs_block(seq):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)
