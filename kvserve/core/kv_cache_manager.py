"""KVCacheManager: per-request block tables on top of a BlockPool, with prefix caching.

The scheduler talks only to this class:

    admit a waiting request:   blocks, n = get_computed_blocks(req)        # prefix cache hit
                               new = allocate_slots(req, num_new_tokens, n, blocks)
    step a running request:    new = allocate_slots(req, num_new_tokens)
    finish / preempt:          free(req)

`allocate_slots` returning None means "not enough free blocks"; the scheduler then preempts
or skips the request, and nothing has changed here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_utils import (KVCacheBlock, PrefixCacheStats,
                                         update_request_block_hashes)

if TYPE_CHECKING:
    from kvserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPoolOwner:
    """What the scheduler and metrics read of a KV cache manager's pool (both managers)."""
    block_pool: BlockPool
    prefix_cache_stats: PrefixCacheStats

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the stats gathered since the last call, and start new ones."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()


class KVCacheManager(BlockPoolOwner):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: Optional[int] = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Slots are never allocated past this many tokens (lookahead slots are clipped to it).
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request_id -> its block table, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks of its table are registered in the prefix
        # cache (hits included), so each step hashes only the blocks that just became full.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------
    def get_computed_blocks(self, request: "Request") -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks found in the prefix cache,
        and the number of tokens they hold.

        The blocks are not referenced yet: pass them to `allocate_slots` right away, before
        anything else allocates (a hit on a freed block could otherwise be evicted).

        The hit never covers the whole request: the model must compute at least the last
        token to have logits to sample from, so a request whose every block hits recomputes
        its last block. Requests asking for prompt logprobs get no hit (those need the
        logits of every prompt position).

        Each call counts in the prefix cache stats; the scheduler calls it once per admission
        (first scheduling or resumption after preemption).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        block_hashes = request.block_hashes
        update_request_block_hashes(request, self.block_size)
        # At most num_tokens - 1 tokens may hit, rounded down to full blocks.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        cache = self.block_pool.cached_block_hash_to_block
        computed_blocks: list[KVCacheBlock] = []
        for i in range(min(max_hit_blocks, len(block_hashes))):
            block = cache.get(block_hashes[i])
            if block is None:
                break
            computed_blocks.append(block)
        num_computed_tokens = len(computed_blocks) * self.block_size

        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_computed_tokens
        return computed_blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Sequence[KVCacheBlock]] = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` more tokens (plus lookahead slots) of `request`.

        The request's block table after this call, by token position:

            | computed           | new computed       | new tokens       | lookahead     |
            | (earlier steps)    | (prefix hit:       | (this step's     | (speculative  |
            |                    |  new_computed_     |  forward pass)   |  tokens; not  |
            |                    |  blocks)           |                  |  cached)      |
            0     request.num_computed_tokens     + num_new_computed   + num_new_tokens  + lookahead
                                                                       = tokens to cache = slots needed

        Returns the blocks newly taken from the free queue (not the hit blocks), or None
        when the free queue cannot supply them, in which case nothing changed.

        With caching on, blocks that are full once this step's tokens are computed are
        registered in the prefix cache now, before their KV is written: that is safe
        because within one forward pass every layer writes all tokens' K/V before attention
        reads them, and no other request can hit a block before this step runs.
        `delay_cache_blocks`: the blocks are filled by a KV load that has not finished, so they
        are registered later (by the request's next allocate_slots call), not now.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be non-negative")
        if new_computed_blocks is None:
            new_computed_blocks = ()
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_existing_blocks = len(req_blocks) if req_blocks is not None else 0
        if new_computed_blocks and num_existing_blocks:
            raise ValueError(f"request {request_id} already has blocks; prefix hits are only "
                             "for a request being admitted")

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            num_tokens_need_slot = min(num_tokens_need_slot, self.max_model_len)
        num_required_blocks = cdiv(num_tokens_need_slot, self.block_size)
        num_new_blocks = max(
            0, num_required_blocks - num_existing_blocks - len(new_computed_blocks))

        # Hit blocks that sit in the free queue (ref 0) leave it when touched, so they count
        # against the free blocks available for new allocations.
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_computed:
            return None

        # From here on the allocation succeeds. Touch the hits first so that the new blocks
        # popped below cannot evict them.
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if request_id not in self.num_cached_block:
            self.num_cached_block[request_id] = len(new_computed_blocks)

        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            # Lookahead slots hold speculative tokens that may be rejected: never cached.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            num_full_blocks = min(num_tokens_to_cache // self.block_size, len(req_blocks))
            num_cached = self.num_cached_block[request_id]
            if num_full_blocks > num_cached:
                update_request_block_hashes(request, self.block_size)
                self.block_pool.cache_full_blocks(request, req_blocks, num_cached,
                                                  num_full_blocks)
                self.num_cached_block[request_id] = num_full_blocks
        return new_blocks

    def free(self, request: "Request") -> None:
        """Return the request's blocks to the pool, tail first so that its prefix is evicted
        last, and forget the request. Does nothing for an unknown request."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
