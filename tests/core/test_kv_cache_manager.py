"""KVCacheManager: block tables, prefix hits, allocation failure, freeing, and a randomized
run whose simulated KV contents prove that every prefix hit returns the right KV."""
from __future__ import annotations

import random
from collections import Counter
from typing import Optional

import pytest

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_utils import hash_request_tokens
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], cache_salt: Optional[str] = None,
                 prompt_logprobs: Optional[int] = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000, prompt_logprobs=prompt_logprobs),
                   cache_salt=cache_salt)


def admit(mgr: KVCacheManager, req: Request, num_new_tokens: Optional[int] = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hits, num_hit = mgr.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    new = mgr.allocate_slots(req, num_new_tokens, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + num_new_tokens
    return hits, num_hit, new


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(mgr: KVCacheManager):
    pool = mgr.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_ids(mgr),
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in mgr.req_to_blocks.items()},
        dict(mgr.num_cached_block),
        pool.get_num_free_blocks(),
    )


# ---------------------------------------------------------------- basics
def test_allocate_counts_blocks():
    mgr = KVCacheManager(10, BS)
    req = make_request("a", list(range(9)))  # ceil(9/4) = 3 blocks
    _, num_hit, new = admit(mgr, req)
    assert num_hit == 0
    assert [b.block_id for b in new] == [0, 1, 2]
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 7
    assert mgr.usage == pytest.approx(0.3)
    # Two full blocks were registered; the partial third was not.
    assert mgr.num_cached_block["a"] == 2
    assert [mgr.block_pool.get_cached_block(h).block_id for h in req.block_hashes] == [0, 1]
    assert mgr.get_block_ids("unknown") == []


def test_decode_grows_block_table_at_boundaries():
    mgr = KVCacheManager(10, BS)
    req = make_request("a", list(range(6)))
    admit(mgr, req)
    assert len(mgr.get_block_ids("a")) == 2
    new_counts = []
    for tok in range(100, 110):
        req.append_output_token_ids([tok])
        new = mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        new_counts.append(len(new))
        assert len(mgr.get_block_ids("a")) == -(-req.num_tokens // BS)
        # Every block full of computed tokens is registered.
        assert mgr.num_cached_block["a"] == req.num_computed_tokens // BS
    # Tokens 7..16: new blocks at token 9 and 13.
    assert new_counts == [0, 0, 1, 0, 0, 0, 1, 0, 0, 0]
    # A later request with this request's whole history hits the decode-filled blocks too.
    mgr.free(req)
    other = make_request("b", list(req.all_token_ids) + [1])
    hits, num_hit, _ = admit(mgr, other)
    assert num_hit == 16
    assert [b.block_id for b in hits] == mgr.get_block_ids("b")[:4]


def test_chunked_prefill_registers_only_computed_blocks():
    mgr = KVCacheManager(20, BS)
    req = make_request("a", list(range(14)))
    admit(mgr, req, num_new_tokens=6)  # chunk 1: tokens 0..5
    assert mgr.get_block_ids("a") == [0, 1]
    assert mgr.num_cached_block["a"] == 1
    assert mgr.block_pool.get_cached_block(req.block_hashes[1]) is None
    mgr.allocate_slots(req, 6)  # chunk 2: tokens 6..11
    req.num_computed_tokens += 6
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.num_cached_block["a"] == 3
    mgr.allocate_slots(req, 2)  # last chunk
    req.num_computed_tokens += 2
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]
    assert mgr.num_cached_block["a"] == 3  # 14 // 4


def test_lookahead_slots_are_allocated_not_cached_and_clipped():
    mgr = KVCacheManager(20, BS, max_model_len=14)
    req = make_request("a", list(range(8)))
    new = mgr.allocate_slots(req, 8, num_lookahead_tokens=3)
    req.num_computed_tokens = 8
    assert len(new) == 3  # 11 slots
    assert mgr.num_cached_block["a"] == 2
    # 8 + 1 + 5 = 14 -> clipped to max_model_len = 14 -> 4 blocks.
    req.append_output_token_ids([50])
    mgr.allocate_slots(req, 1, num_lookahead_tokens=5)
    assert len(mgr.get_block_ids("a")) == 4
    # Far past max_model_len: still 4 blocks.
    assert mgr.allocate_slots(req, 1, num_lookahead_tokens=50) == []
    assert len(mgr.get_block_ids("a")) == 4


def test_free_is_idempotent_and_reverse_order():
    mgr = KVCacheManager(6, BS)
    req = make_request("a", list(range(12)))
    admit(mgr, req)
    assert free_ids(mgr) == [3, 4, 5]
    mgr.free(req)
    assert free_ids(mgr) == [3, 4, 5, 2, 1, 0]
    before = snapshot(mgr)
    mgr.free(req)
    mgr.free(make_request("never-seen", [1]))
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("a") == [] and "a" not in mgr.num_cached_block


# ---------------------------------------------------------------- prefix hits
def test_prefix_hit_on_live_request():
    mgr = KVCacheManager(20, BS)
    a = make_request("a", list(range(14)))
    admit(mgr, a)
    a_blocks = mgr.block_pool.blocks
    b = make_request("b", list(range(12)) + [99, 98, 97])
    hits, num_hit, new = admit(mgr, b)
    assert num_hit == 12
    assert [h.block_id for h in hits] == mgr.get_block_ids("a")[:3]
    assert [a_blocks[i].ref_cnt for i in mgr.get_block_ids("a")] == [2, 2, 2, 1]
    assert mgr.get_block_ids("b")[:3] == mgr.get_block_ids("a")[:3]
    assert len(new) == 1 and new[0].block_id not in mgr.get_block_ids("a")
    assert b.num_computed_tokens == 15
    mgr.free(a)
    assert [a_blocks[i].ref_cnt for i in mgr.get_block_ids("b")] == [1, 1, 1, 1]


def test_prefix_hit_on_finished_request_leaves_free_queue():
    mgr = KVCacheManager(8, BS)
    a = make_request("a", list(range(12)) + [5])
    admit(mgr, a)
    a_ids = mgr.get_block_ids("a")
    mgr.free(a)
    assert mgr.num_free_blocks == 8
    b = make_request("b", list(range(12)) + [6, 7])
    hits, num_hit, new = admit(mgr, b)
    assert num_hit == 12 and [h.block_id for h in hits] == a_ids[:3]
    assert all(h.ref_cnt == 1 for h in hits)
    free = free_ids(mgr)
    assert not set(a_ids[:3]) & set(free)
    assert mgr.num_free_blocks == len(free) == 8 - 4


def test_never_whole_prompt_hit():
    mgr = KVCacheManager(20, BS)
    a = make_request("a", list(range(8)))  # exactly 2 blocks
    admit(mgr, a)
    mgr.free(a)
    same = make_request("b", list(range(8)))
    hits, num_hit, new = admit(mgr, same)
    assert num_hit == 4 and len(hits) == 1  # the last block is recomputed
    assert same.num_computed_tokens == 8
    # The recomputed block gets a fresh block; the old copy stays the cached one.
    assert len(new) == 1
    mgr.free(same)
    longer = make_request("c", list(range(8)) + [42])
    _, num_hit, _ = admit(mgr, longer)
    assert num_hit == 8
    tiny = make_request("d", [0, 1, 2, 3][:3])
    assert mgr.get_computed_blocks(tiny) == ([], 0)


def test_prompt_logprobs_disables_hits():
    mgr = KVCacheManager(20, BS)
    admit(mgr, make_request("a", list(range(9))))
    mgr.make_prefix_cache_stats()
    req = make_request("b", list(range(9)), prompt_logprobs=1)
    assert mgr.get_computed_blocks(req) == ([], 0)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    # Its blocks are still cached for others.
    admit(mgr, req)
    mgr.free(req)
    _, num_hit, _ = admit(mgr, make_request("c", list(range(9))))
    assert num_hit == 8


def test_caching_disabled():
    mgr = KVCacheManager(20, BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(mgr, a)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    _, num_hit, _ = admit(mgr, make_request("b", list(range(9))))
    assert num_hit == 0


def test_cache_salt_isolates():
    mgr = KVCacheManager(20, BS)
    admit(mgr, make_request("a", list(range(9)), cache_salt="x"))
    assert admit(mgr, make_request("b", list(range(9))))[1] == 0
    assert admit(mgr, make_request("c", list(range(9)), cache_salt="y"))[1] == 0
    assert admit(mgr, make_request("d", list(range(9)), cache_salt="x"))[1] == 8


def test_prefix_cache_stats():
    mgr = KVCacheManager(20, BS)
    admit(mgr, make_request("a", list(range(9))))
    admit(mgr, make_request("b", list(range(10))))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 19, 8)
    again = mgr.make_prefix_cache_stats()
    assert (again.requests, again.queries, again.hits) == (0, 0, 0)


def test_reset_prefix_cache():
    mgr = KVCacheManager(20, BS)
    a = make_request("a", list(range(9)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert admit(mgr, make_request("b", list(range(9))))[1] == 0


# ---------------------------------------------------------------- out of blocks
def test_allocate_returns_none_without_side_effects():
    mgr = KVCacheManager(4, BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    b = make_request("b", list(range(100, 110)))
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 10) is None
    assert snapshot(mgr) == before
    assert "b" not in mgr.req_to_blocks
    # A running request that cannot grow is left as it was, too.
    a.append_output_token_ids([1, 2, 3])
    assert mgr.allocate_slots(a, 2, num_lookahead_tokens=8) is None  # 20 slots: 5 blocks
    assert snapshot(mgr) == before


def test_free_hit_blocks_count_as_consumed():
    # 5 blocks. "a" caches 3 full blocks and is freed: all 5 free, 3 of them hit candidates.
    mgr = KVCacheManager(5, BS)
    a = make_request("a", list(range(12)) + [7])
    admit(mgr, a)
    mgr.free(a)
    # "b" hits 3 blocks and needs 3 more (24 tokens): 5 free, but touching the hits leaves 2.
    b = make_request("b", list(range(12)) + list(range(50, 62)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 12, num_hit, hits) is None
    assert snapshot(mgr) == before
    # With 2 new blocks (20 tokens) it fits exactly, and the hits survive the allocation.
    c = make_request("c", list(range(12)) + list(range(50, 58)))
    hits, num_hit = mgr.get_computed_blocks(c)
    new = mgr.allocate_slots(c, 8, num_hit, hits)
    assert new is not None and len(new) == 2
    assert mgr.get_block_ids("c")[:3] == [h.block_id for h in hits]
    assert all(mgr.block_pool.get_cached_block(h) is not None for h in c.block_hashes[:3])
    assert mgr.num_free_blocks == 0


# ---------------------------------------------------------------- randomized
class Simulator:
    """Drives a KVCacheManager as a scheduler would and simulates the KV each block holds:
    every slot stores the key of the token sequence ending at that position, which is what
    a real K/V vector depends on. A prefix hit is correct iff the hit blocks hold exactly
    the keys of the request's own positions."""

    def __init__(self, seed: int, num_blocks: int) -> None:
        self.rng = random.Random(seed)
        self.mgr = KVCacheManager(num_blocks, BS)
        self.live: dict[str, Request] = {}
        self.kv: dict[int, list] = {}
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(4) for _ in range(self.rng.randint(0, 14))]
                         for _ in range(4)]
        self.num_hits = 0
        self.num_failed = 0

    def key(self, req: Request, pos: int):
        return (req.cache_salt, tuple(req.all_token_ids[:pos + 1]))

    def write_kv(self, req: Request, start: int, end: int) -> None:
        blocks = self.mgr.get_blocks(req.request_id)
        for pos in range(start, end):
            block = blocks[pos // BS]
            # Computed tokens always land in a block this request owns alone.
            assert block.ref_cnt == 1
            self.kv.setdefault(block.block_id, [None] * BS)[pos % BS] = self.key(req, pos)

    def admit(self) -> None:
        rng = self.rng
        tokens = rng.choice(self.prefixes) + [rng.randrange(4) for _ in range(rng.randint(1, 9))]
        req = make_request(f"r{self.next_id}", tokens, cache_salt=rng.choice([None, None, "s"]))
        self.next_id += 1
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit == len(hits) * BS < req.num_tokens
        for i, block in enumerate(hits):
            assert self.kv[block.block_id] == [self.key(req, p) for p in range(i * BS, (i + 1) * BS)]
        self.num_hits += num_hit
        num_new = min(rng.randint(1, 12), req.num_tokens - num_hit)
        before = snapshot(self.mgr)
        new = self.mgr.allocate_slots(req, num_new, num_hit, hits)
        if new is None:
            assert snapshot(self.mgr) == before
            self.num_failed += 1
            return
        self.live[req.request_id] = req
        self.write_kv(req, num_hit, num_hit + num_new)
        req.num_computed_tokens = num_hit + num_new

    def step(self) -> None:
        rng = self.rng
        req = self.live[rng.choice(sorted(self.live))]
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([rng.randrange(4)])  # a decode step's sampled token
        num_new = min(rng.randint(1, 8), req.num_tokens - req.num_computed_tokens)
        lookahead = rng.choice([0, 0, 0, 3])
        before = snapshot(self.mgr)
        new = self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
        if new is None:
            assert snapshot(self.mgr) == before
            self.num_failed += 1
            # Recompute preemption: give the blocks back, start over later.
            self.mgr.free(req)
            del self.live[req.request_id]
            return
        start = req.num_computed_tokens
        self.write_kv(req, start, start + num_new)
        req.num_computed_tokens += num_new

    def finish(self) -> None:
        rid = self.rng.choice(sorted(self.live))
        self.mgr.free(self.live.pop(rid))

    def check_invariants(self) -> None:
        mgr, pool = self.mgr, self.mgr.block_pool
        assert set(mgr.req_to_blocks) == set(self.live)
        holders = Counter()
        for rid, req in self.live.items():
            blocks = mgr.req_to_blocks[rid]
            assert len({b.block_id for b in blocks}) == len(blocks)
            assert len(blocks) >= -(-req.num_computed_tokens // BS)
            num_cached = mgr.num_cached_block[rid]
            assert num_cached == req.num_computed_tokens // BS
            assert req.block_hashes[:num_cached] == hash_request_tokens(
                BS, req.all_token_ids[:num_cached * BS], req.cache_salt)
            for i, b in enumerate(blocks):
                if i < num_cached:
                    # Registered under its hash, or left unhashed as a duplicate.
                    assert b.block_hash in (None, req.block_hashes[i])
                else:
                    assert b.block_hash is None
            holders.update(b.block_id for b in blocks)
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], b
        free = free_ids(mgr)
        assert len(free) == len(set(free)) == pool.get_num_free_blocks() == mgr.num_free_blocks
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert mgr.usage == pytest.approx(1 - len(free) / pool.num_blocks)
        for block_hash, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == block_hash
        for b in pool.blocks:
            if b.block_hash is not None:
                assert pool.cached_block_hash_to_block[b.block_hash] is b


@pytest.mark.parametrize("seed", range(6))
def test_randomized_shared_prefixes(seed):
    sim = Simulator(seed, num_blocks=24)
    for _ in range(600):
        r = sim.rng.random()
        if r < 0.3 and len(sim.live) < 8 or not sim.live:
            sim.admit()
        elif r < 0.85:
            sim.step()
        else:
            sim.finish()
        sim.check_invariants()
    for rid in sorted(sim.live):
        sim.mgr.free(sim.live.pop(rid))
    sim.check_invariants()
    pool = sim.mgr.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sim.mgr.req_to_blocks == {} and sim.mgr.num_cached_block == {}
    # The run exercised what it is meant to.
    assert sim.num_hits > 0 and sim.num_failed > 0
