"""The hybrid KV cache: one block table per KV cache group, sliding-window groups keep only
the blocks inside their window (vLLM V1's KVCacheCoordinator / HybridKVCacheManager).

Layers are grouped by attention type (config.get_kv_cache_groups): full attention, sliding
window W. All groups draw blocks from one BlockPool; the i-th layer of every group shares the
worker's i-th KV tensor, so one block id is one page of `group_size` layers, whichever group
holds it. A request's table in each group is indexed by token position:

    full group     | b0 | b1 | b2 | b3 | b4 | b5 |        every block stays until the end
    sliding group  | -- | -- | -- | b9 | b7 | b8 |        -- = the pool's null block
                                  ^ first block holding a position >= num_computed - W + 1

Before each allocation a sliding group gives back the blocks wholly before the window of the
step's first query (`remove_skipped_blocks`), so a long request holds about W / block_size
blocks there. A prefix-cache hit must hold in every group: a full group needs every block of
the hit, a sliding group only the ceil((W - 1) / block_size) blocks before the hit point
(vLLM's SlidingWindowManager.find_longest_cache_hit); the shortest hit wins and every group is
asked again at that length until they agree.

The scheduler sees the same interface as KVCacheManager; blocks and block ids come per group
(a tuple of lists, vLLM's layout). A model whose layers are all full attention never gets
here: make_kv_cache_manager returns today's KVCacheManager for it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from kvserve.config import CacheConfig, KVCacheGroupSpec
from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.kv_cache_utils import (BlockHash, KVCacheBlock, PrefixCacheStats,
                                         update_request_block_hashes)

if TYPE_CHECKING:
    from kvserve.core.request import Request

GroupedBlocks = tuple[list[KVCacheBlock], ...]


class SingleTypeKVCacheManager:
    """One group's block tables (vLLM's name); full attention keeps every block."""

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, pool: BlockPool,
                 block_size: int) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.null_block = pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_blocks: int) -> list[KVCacheBlock]:
        """The leading blocks of the request found in the cache, at most `max_blocks`."""
        hit: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention reads every position: nothing is ever skipped."""

    def num_held_blocks(self, request_id: str) -> int:
        null = self.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            null = self.null_block
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p attends to positions (p - W, p]: blocks wholly before the first
    query's window are returned to the pool (their table slots become the null block)."""

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, pool: BlockPool,
                 block_size: int) -> None:
        super().__init__(spec, group_id, pool, block_size)
        assert spec.sliding_window is not None and pool.null_block is not None
        self.window = spec.sliding_window
        # Blocks a hit must hold before its end: positions [p - W + 1, p - 1] for p aligned.
        self.contiguous_blocks = cdiv(self.window - 1, block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_blocks: int) -> list[KVCacheBlock]:
        """Scan back from `max_blocks` for `contiguous_blocks` cached blocks in a row (or a
        shorter run reaching block 0); the hit ends with that run, null blocks before it."""
        null = self.null_block
        assert null is not None
        hit: list[KVCacheBlock] = [null] * max_blocks
        if self.contiguous_blocks == 0:   # W == 1: a query reads only itself
            return hit
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run >= self.contiguous_blocks:
                return hit[:i + run]
        return hit[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful_block = max(0, num_computed_tokens - self.window + 1) // self.block_size
        null = self.null_block
        removed = []
        for i in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break          # everything before was given back earlier
            removed.append(blocks[i])
            blocks[i] = null   # type: ignore[assignment]
        if removed:
            self.pool.free_blocks(removed)


def _make_group_manager(spec: KVCacheGroupSpec, group_id: int, pool: BlockPool,
                        block_size: int) -> SingleTypeKVCacheManager:
    cls = FullAttentionManager if spec.sliding_window is None else SlidingWindowManager
    return cls(spec, group_id, pool, block_size)


class HybridKVCacheManager:
    """KVCacheManager's interface over several KV cache groups sharing one BlockPool."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], num_blocks: int, block_size: int,
                 enable_caching: bool = True, max_model_len: Optional[int] = None) -> None:
        if not groups:
            raise ValueError("HybridKVCacheManager needs at least one KV cache group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block=True)
        self.groups = [_make_group_manager(spec, g, self.block_pool, block_size)
                       for g, spec in enumerate(groups)]
        # Leading blocks registered in the prefix cache; the same in every group.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------
    def get_computed_blocks(self, request: "Request") -> tuple[GroupedBlocks, int]:
        """The longest prefix hit valid in every group, per group (null blocks where a sliding
        group needs nothing), and its length in tokens. See KVCacheManager's."""
        empty: GroupedBlocks = tuple([] for _ in self.groups)
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return empty, 0
        update_request_block_hashes(request, self.block_size)
        hashes = request.block_hashes
        num_blocks = min((request.num_tokens - 1) // self.block_size, len(hashes))
        hits: list[list[KVCacheBlock]] = [[] for _ in self.groups]
        while True:   # shrink until every group agrees (each pass only shortens the hit)
            for g, manager in enumerate(self.groups):
                hits[g] = manager.find_longest_cache_hit(hashes, num_blocks)
                num_blocks = min(num_blocks, len(hits[g]))
            if all(len(h) == num_blocks for h in hits):
                break
            for g, manager in enumerate(self.groups):
                if manager.spec.sliding_window is None:
                    hits[g] = hits[g][:num_blocks]
            if all(len(h) == num_blocks for h in hits):
                break
        num_tokens = num_blocks * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_tokens
        return tuple(hits), num_tokens

    def allocate_slots(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Union[GroupedBlocks, Sequence]] = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Optional[GroupedBlocks]:
        """KVCacheManager.allocate_slots per group; returns the new blocks per group, or None
        (no free blocks) with nothing allocated. Sliding groups first give back what left
        the window of this step's first query."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be non-negative")
        rid = request.request_id
        hits: GroupedBlocks = (tuple(new_computed_blocks) if new_computed_blocks
                               else tuple([] for _ in self.groups))  # type: ignore[assignment]
        exists = rid in self.num_cached_block
        if exists and any(hits):
            raise ValueError(f"request {rid} already has blocks; prefix hits are only "
                             "for a request being admitted")
        for manager in self.groups:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        need = num_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            need = min(need, self.max_model_len)
        num_required = cdiv(need, self.block_size)
        null = self.block_pool.null_block
        num_new = [max(0, num_required - len(m.req_to_blocks.get(rid, ())) - len(h))
                   for m, h in zip(self.groups, hits)]
        num_evictable = sum(1 for h in hits for b in h if b.ref_cnt == 0 and b is not null)
        if sum(num_new) > self.block_pool.get_num_free_blocks() - num_evictable:
            return None

        # Every group's hits are touched before any group takes new blocks: a hit on a freed
        # block must leave the free queue before get_new_blocks could hand it out again.
        for manager, hit in zip(self.groups, hits):
            table = manager.req_to_blocks.setdefault(rid, [])
            if hit:
                self.block_pool.touch(b for b in hit if b is not null)
                table.extend(hit)
        new_blocks = []
        for manager, n in zip(self.groups, num_new):
            new = self.block_pool.get_new_blocks(n) if n else []
            manager.req_to_blocks[rid].extend(new)
            new_blocks.append(new)
        if not exists:
            self.num_cached_block[rid] = len(hits[0])

        if self.enable_caching and not delay_cache_blocks:
            num_full = min(min(num_computed + num_new_tokens, request.num_tokens)
                           // self.block_size, num_required)
            num_cached = self.num_cached_block[rid]
            if num_full > num_cached:
                update_request_block_hashes(request, self.block_size)
                for g, manager in enumerate(self.groups):
                    self.block_pool.cache_full_blocks(request, manager.req_to_blocks[rid],
                                                      num_cached, num_full, group_id=g)
                self.num_cached_block[rid] = num_full
        return tuple(new_blocks)

    def free(self, request: "Request") -> None:
        """Every group's blocks back to the pool (tail first); unknown requests: nothing."""
        rid = request.request_id
        self.num_cached_block.pop(rid, None)
        for manager in self.groups:
            manager.free(rid)

    # ------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> GroupedBlocks | list:
        """The request's table per group ([] for an unknown request, so it reads as false)."""
        if request_id not in self.num_cached_block:
            return []
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.groups)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())]
                     for m in self.groups)

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (null placeholders not counted)."""
        return [m.num_held_blocks(request_id) for m in self.groups]


def make_kv_cache_manager(cache_config: CacheConfig, max_model_len: Optional[int]
                          ) -> Union[KVCacheManager, HybridKVCacheManager]:
    """Today's KVCacheManager when every layer is full attention (no groups configured), the
    hybrid one otherwise."""
    kwargs = dict(num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
                  enable_caching=cache_config.enable_prefix_caching, max_model_len=max_model_len)
    if not cache_config.kv_cache_groups:
        return KVCacheManager(**kwargs)  # type: ignore[arg-type]
    return HybridKVCacheManager(cache_config.kv_cache_groups, **kwargs)  # type: ignore[arg-type]


def to_block_ids(blocks: Union[Sequence[KVCacheBlock], GroupedBlocks]
                 ) -> Union[list[int], tuple[list[int], ...]]:
    """Block ids for the workers: a list (one group), or one list per group (hybrid)."""
    if isinstance(blocks, tuple) and (not blocks or isinstance(blocks[0], list)):
        return tuple([b.block_id for b in group] for group in blocks)
    return [b.block_id for b in blocks]
