"""BlockPool: allocation, ref counts, prefix cache registration, lazy eviction, LRU order."""
from __future__ import annotations

import pytest

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_utils import update_request_block_hashes
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=100))
    update_request_block_hashes(req, BS)
    return req


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_initial_state():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 6
    assert pool.get_usage() == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_get_new_blocks_from_head():
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 1]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.get_usage() == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.get_new_blocks(0) == []


def test_cache_full_blocks_and_lookup():
    pool = BlockPool(8, enable_caching=True)
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1)
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert blocks[0].block_hash == req.block_hashes[0]
    pool.cache_full_blocks(req, blocks, 1, 2)
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert blocks[2].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 2
    # Asking for more hashes than the request has is an error, not silent corruption.
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, blocks, 2, 3)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(8, enable_caching=True)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(8)))
    blocks_a = pool.get_new_blocks(2)
    blocks_b = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, blocks_a, 0, 2)
    pool.cache_full_blocks(b, blocks_b, 0, 2)
    assert [pool.get_cached_block(h) for h in b.block_hashes] == blocks_a
    assert all(blk.block_hash is None for blk in blocks_b)
    # Reusing b's unregistered blocks must not disturb a's entries.
    pool.free_blocks(reversed(blocks_b))
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert [pool.get_cached_block(h) for h in a.block_hashes] == blocks_a


def test_touch_live_block_counts_two():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks[:1])
    assert [b.ref_cnt for b in blocks] == [2, 1]
    assert free_ids(pool) == [2, 3]
    pool.free_blocks(blocks[:1])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [2, 3]


def test_touch_freed_block_leaves_free_queue():
    pool = BlockPool(5, enable_caching=True)
    req = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 3, 4, 1, 0]
    hit = pool.get_cached_block(req.block_hashes[1])
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [2, 3, 4, 0]
    assert pool.get_num_free_blocks() == 4
    # Still cached while in use.
    assert pool.get_cached_block(req.block_hashes[1]) is hit


def test_lazy_eviction_on_reuse():
    pool = BlockPool(2, enable_caching=True)
    req = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    # Freed but still cached.
    assert len(pool.cached_block_hash_to_block) == 2
    assert free_ids(pool) == [1, 0]
    (reused,) = pool.get_new_blocks(1)
    # The tail block goes first; its hash leaves the map, the prefix block stays.
    assert reused is blocks[1]
    assert reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert len(pool.cached_block_hash_to_block) == 1


def test_lru_order_evicts_request_tail_first():
    pool = BlockPool(6, enable_caching=True)
    old = make_request("old", list(range(12)))        # 3 full blocks
    new = make_request("new", list(range(100, 112)))  # 3 full blocks
    blocks_old = pool.get_new_blocks(3)
    blocks_new = pool.get_new_blocks(3)
    pool.cache_full_blocks(old, blocks_old, 0, 3)
    pool.cache_full_blocks(new, blocks_new, 0, 3)
    pool.free_blocks(reversed(blocks_old))
    pool.free_blocks(reversed(blocks_new))
    # Least recently freed first; within a request, its tail first.
    assert free_ids(pool) == [2, 1, 0, 5, 4, 3]
    pool.get_new_blocks(2)
    assert [pool.get_cached_block(h) is not None for h in old.block_hashes] == [True, False, False]
    assert all(pool.get_cached_block(h) is not None for h in new.block_hashes)


def test_free_blocks_rejects_unused_block():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[0]])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, enable_caching=True)
    req = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 4
