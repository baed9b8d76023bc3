"""The hybrid KV cache (core/kv_cache_coordinator.py): layer grouping, sliding-window groups
giving back blocks that left the window, prefix hits valid in every group, and a randomized
run whose simulated KV contents prove every query finds its window's K/V, untouched."""
from __future__ import annotations

import random
from typing import Optional

import pytest

from kvserve.config import KVCacheGroupSpec, get_kv_cache_groups, layer_sliding_windows
from kvserve.core.kv_cache_coordinator import HybridKVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4
W = 8          # window: positions (p - 8, p]
FULL = KVCacheGroupSpec((1,), None)
LOCAL = KVCacheGroupSpec((0,), W)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000))


def admit(mgr: HybridKVCacheManager, req: Request, n: Optional[int] = None):
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if n is None else n
    new = mgr.allocate_slots(req, n, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + n
    return num_hit, new


def held_in_window(c: int) -> int:
    """Blocks a sliding group must hold once position c is allocated: those covering
    [max(0, c - W + 1), c] (the window of the first query, c itself)."""
    return c // BS - max(0, c - W + 1) // BS + 1


# ---------------------------------------------------------------- grouping
def test_layer_windows_from_configs() -> None:
    gemma3 = {"num_hidden_layers": 6, "sliding_window": 16, "model_type": "gemma3_text",
              "sliding_window_pattern": 6}
    assert layer_sliding_windows(gemma3, 256) == [16] * 5 + [None]
    types = {"num_hidden_layers": 3, "sliding_window": 16,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    assert layer_sliding_windows(types, 256) == [16, None, 16]
    gemma2 = {"num_hidden_layers": 4, "sliding_window": 16, "model_type": "gemma2"}
    assert layer_sliding_windows(gemma2, 256) == [16, None, 16, None]
    mistral = {"num_hidden_layers": 2, "sliding_window": 16}
    assert layer_sliding_windows(mistral, 256) == [16, 16]
    # A window no shorter than the context cuts nothing; Qwen2 without use_sliding_window.
    assert layer_sliding_windows(mistral, 16) == [None, None]
    assert layer_sliding_windows({**mistral, "use_sliding_window": False}, 256) == [None, None]


def test_groups_have_equal_size_and_share_tensors() -> None:
    windows = [16] * 5 + [None] + [16] * 5 + [None]          # Gemma 3's 5:1, 12 layers
    groups = get_kv_cache_groups(windows)
    assert groups[0] == KVCacheGroupSpec((5, 11), None)
    assert [g.layer_ids for g in groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert all(g.sliding_window == 16 for g in groups[1:])
    assert get_kv_cache_groups([None] * 4) == []                  # today's single table
    assert get_kv_cache_groups([16] * 4) == [KVCacheGroupSpec((0, 1, 2, 3), 16)]
    assert get_kv_cache_groups(windows, disable_hybrid=True) == []


# ---------------------------------------------------------------- sliding window frees
def test_sliding_group_holds_only_the_window() -> None:
    mgr = HybridKVCacheManager([FULL, LOCAL], num_blocks=64, block_size=BS)
    req = make_request("a", list(range(10)))
    admit(mgr, req)
    for tok in range(100, 160):
        req.append_output_token_ids([tok])
        assert mgr.allocate_slots(req, 1) is not None
        c = req.num_computed_tokens            # the position this step computes
        req.num_computed_tokens += 1
        full, local = mgr.num_held_blocks("a")
        assert full == cdiv(c + 1, BS)
        assert local == held_in_window(c), (c, local)
        assert len(mgr.get_block_ids("a")[1]) == full      # null slots keep the positions
    assert mgr.num_held_blocks("a")[1] <= cdiv(W - 1, BS) + 1 < mgr.num_held_blocks("a")[0]
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.block_pool.num_usable_blocks == 63


def test_prefix_hit_needs_only_the_window_in_sliding_groups() -> None:
    mgr = HybridKVCacheManager([FULL, LOCAL], num_blocks=64, block_size=BS)
    tokens = list(range(1, 42))
    a = make_request("a", tokens)
    admit(mgr, a)
    mgr.free(a)
    pool = mgr.block_pool
    hashes = a.block_hashes                       # 10 full blocks
    # Evict the local group's blocks 0..6: a hit at 10 blocks needs only blocks 8, 9
    # (positions 33..39 = (40 - 8, 40)), so the hit stays whole, null before the window.
    for i in range(7):
        del pool.cached_block_hash_to_block[(hashes[i], 1)]
    b = make_request("b", tokens)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 10 * BS
    assert [blk is pool.null_block for blk in hits[1]] == [True] * 8 + [False] * 2
    assert not any(blk is pool.null_block for blk in hits[0])
    # Without local block 8 no hit length has its window present: at 10 blocks it needs
    # 8 and 9, at 8 blocks 6 and 7 (6 evicted), ... so there is no hit at all.
    del pool.cached_block_hash_to_block[(hashes[8], 1)]
    hits, n = mgr.get_computed_blocks(b)
    assert n == 0 and hits == ([], [])
    # A full group miss in the middle caps every group.
    c = make_request("c", tokens)
    admit(mgr, c)
    mgr.free(c)
    del pool.cached_block_hash_to_block[(hashes[5], 0)]
    hits, n = mgr.get_computed_blocks(make_request("d", tokens))
    assert n == 5 * BS and [len(h) for h in hits] == [5, 5]


# ---------------------------------------------------------------- randomized KV contents
def _check_step(mgr: HybridKVCacheManager, kv: dict, req: Request, start: int, n: int) -> None:
    """Write this step's tokens into the simulated cache of every group, then check every
    query position's window (full groups: the whole prefix) reads what was written for
    exactly these tokens at that position in that group."""
    tables = mgr.get_block_ids(req.request_id)
    null = mgr.block_pool.null_block.block_id
    tokens = req.all_token_ids
    for g, table in enumerate(tables):
        for p in range(start, start + n):
            assert table[p // BS] != null, (g, p)
            kv[(table[p // BS], p % BS)] = (g, tuple(tokens[:p + 1]))
    for g, (spec, table) in enumerate(zip(mgr.groups, tables)):
        window = spec.spec.sliding_window
        for p in range(start, start + n):
            for k in range(max(0, p - window + 1) if window else 0, p + 1):
                slot = (table[k // BS], k % BS)
                assert table[k // BS] != null and kv.get(slot) == (g, tuple(tokens[:k + 1])), \
                    f"group {g} query {p} key {k}: block {table[k // BS]} holds {kv.get(slot)}"


@pytest.mark.parametrize("seed", range(3))
def test_randomized_windows_read_their_own_kv(seed: int) -> None:
    rng = random.Random(seed)
    groups = [FULL, LOCAL, KVCacheGroupSpec((2,), W)]
    mgr = HybridKVCacheManager(groups, num_blocks=48, block_size=BS)
    kv: dict = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    running: list[Request] = []
    waiting = [make_request(f"r{i}", rng.choice(prefixes) + [rng.randrange(50)
                                                             for _ in range(rng.randrange(1, 12))])
               for i in range(14)]
    hits = 0
    while running or waiting:
        for req in list(running):
            if req.num_computed_tokens == req.num_tokens:
                if len(req.output_token_ids) >= 10:
                    running.remove(req)
                    mgr.free(req)
                    continue
                req.append_output_token_ids([rng.randrange(50)])
            start = req.num_computed_tokens
            n = min(req.num_tokens - start, rng.randrange(1, 9))
            if mgr.allocate_slots(req, n) is None:      # preempt it: recompute later
                running.remove(req)
                mgr.free(req)
                req.num_computed_tokens = 0
                waiting.append(req)
                continue
            _check_step(mgr, kv, req, start, n)
            req.num_computed_tokens += n
        if waiting and len(running) < 4:
            req = waiting[0]
            found, num_hit = mgr.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, rng.randrange(1, 20))
            if mgr.allocate_slots(req, n, num_hit, found) is not None:
                waiting.pop(0)
                hits += num_hit
                req.num_computed_tokens = num_hit
                _check_step(mgr, kv, req, num_hit, n)
                req.num_computed_tokens += n
                running.append(req)
        in_use = sum(1 for b in mgr.block_pool.blocks if b.ref_cnt > 0)
        assert in_use + mgr.num_free_blocks == mgr.block_pool.num_usable_blocks
    assert hits > 0
    # No leaks: every block back in the pool, none referenced.
    assert mgr.num_free_blocks == mgr.block_pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
