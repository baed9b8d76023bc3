"""BlockPool: the fixed set of KV cache blocks, their free queue and the prefix cache map.

The prefix cache is four operations on this pool (STYLE.md item 7):

    match   get_cached_block(block_hash)         hash -> block, if some block holds it
    lock    touch(blocks)                        ref_cnt += 1; a freed block leaves the free queue
    insert  cache_full_blocks(...)               register the hashes of blocks that became full
    evict   get_new_blocks(n)                    lazily: a reused block drops its stale hash

Freed blocks keep their hash and their place in `cached_block_hash_to_block` until the free
queue hands them out again, so a finished request's prefix stays reusable for as long as the
memory is not needed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from kvserve.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from kvserve.core.request import Request


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool,
                 reserve_null_block: bool = False) -> None:
        if num_blocks <= int(reserve_null_block):
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The hybrid KV cache (kv_cache_coordinator.py) fills the table slots of blocks a
        # sliding window let go with this block: never handed out, written, cached or freed.
        self.null_block: Optional[KVCacheBlock] = (
            self.free_block_queue.popleft() if reserve_null_block else None)
        self.num_usable_blocks = num_blocks - int(reserve_null_block)
        # One block per hash. A second block that fills with the same tokens (two requests
        # prefilling the same prefix in the same step) stays unregistered; see cache_full_blocks.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- match ----------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash,
                         group_id: Optional[int] = None) -> Optional[KVCacheBlock]:
        key = block_hash if group_id is None else (block_hash, group_id)
        return self.cached_block_hash_to_block.get(key)  # type: ignore[call-overload]

    # -- insert ---------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: "Request",
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: Optional[int] = None,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under the request's hashes
        (keyed (hash, group_id) for a hybrid KV cache group: each group's blocks hold only its
        layers' KV, so a hit must come from the same group).

        `blocks` is the request's block table and `request.block_hashes` must already cover
        `num_full_blocks`. If another block already holds a hash, the map keeps that block and
        this one stays unhashed: both hold the same KV, and the existing entry may be shared.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = request.block_hashes
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id} has {len(block_hashes)} block hashes, "
                f"{num_full_blocks} needed; call update_request_block_hashes first")
        cache = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                # Already registered (e.g. a prefix hit); nothing to do.
                continue
            block_hash = block_hashes[i] if group_id is None else (block_hashes[i], group_id)
            if block_hash not in cache:
                block.block_hash = block_hash
                cache[block_hash] = block

    # -- allocate / evict ---------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, with ref_cnt 1 each.

        A taken block that still carries a hash is evicted from the prefix cache now (lazy
        eviction): its KV is about to be overwritten.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cache = self.cached_block_hash_to_block
        for block in blocks:
            assert block.ref_cnt == 0, block
            block_hash = block.block_hash
            if block_hash is not None:
                # block_hash is only set while registered, so the entry is this block's.
                if cache.get(block_hash) is block:
                    del cache[block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    # -- lock / unlock ----------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a hit on a freed block (ref_cnt 0) takes
        it out of the free queue so it cannot be evicted while in use."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the free queue tail in the
        given order. Pass a request's blocks in reverse so its tail blocks (the least shared
        ones) are evicted before its prefix."""
        freed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free_blocks() on a block that is not in use: {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    # -- maintenance --------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no block is in use (a running
        request's blocks may be shared through the map); returns whether it happened."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks
