"""Block hashes, the free block queue and prefix cache stats."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache_utils import (BlockHash, FreeKVCacheBlockQueue, KVCacheBlock,
                                         PrefixCacheStats, hash_block_tokens,
                                         hash_request_tokens, update_request_block_hashes)
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100), cache_salt=cache_salt)


# ---------------------------------------------------------------- hashes
def test_hash_is_deterministic_and_keeps_tokens():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, (1, 2, 3, 4))
    assert a == b and hash(a) == hash(b) == a.hash_value
    assert a.token_ids == (1, 2, 3, 4)
    assert a.extra_keys is None


def test_same_tokens_different_parent_differ():
    p1 = hash_block_tokens(None, [1, 2])
    p2 = hash_block_tokens(None, [3, 4])
    c1 = hash_block_tokens(p1.hash_value, [5, 6])
    c2 = hash_block_tokens(p2.hash_value, [5, 6])
    assert c1.token_ids == c2.token_ids
    assert c1.hash_value != c2.hash_value
    assert c1 != c2
    # A first block differs from the same tokens after some parent.
    assert hash_block_tokens(None, [5, 6]) != c1


def test_colliding_hash_value_is_not_a_hit():
    real = hash_block_tokens(None, [1, 2, 3])
    forged = BlockHash(real.hash_value, (9, 9, 9), None)
    cache = {real: "block"}
    assert forged not in cache
    assert BlockHash(real.hash_value, (1, 2, 3), None) in cache
    assert BlockHash(real.hash_value, (1, 2, 3), ("salt",)) not in cache


def test_hash_request_tokens_chains_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_request_tokens(4, tokens)
    assert len(hashes) == 2  # 10 // 4, the 2-token tail is not hashed
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0.hash_value, [4, 5, 6, 7])
    assert hashes == [h0, h1]


def test_cache_salt_changes_first_block_key_only():
    tokens = list(range(12))
    plain = hash_request_tokens(4, tokens)
    salted = hash_request_tokens(4, tokens, cache_salt="tenant-a")
    other = hash_request_tokens(4, tokens, cache_salt="tenant-b")
    assert salted[0].extra_keys == ("tenant-a",)
    assert all(h.extra_keys is None for h in salted[1:])
    # Every block differs (through the chain) although only the first carries the salt.
    for p, s, o in zip(plain, salted, other):
        assert p.token_ids == s.token_ids == o.token_ids
        assert len({p.hash_value, s.hash_value, o.hash_value}) == 3


def test_update_request_block_hashes_is_incremental():
    bs = 4
    req = make_request("r", [7, 8, 9], cache_salt="s")
    assert update_request_block_hashes(req, bs) == []
    assert req.block_hashes == []
    seen_new = []
    for tok in range(20):
        req.append_output_token_ids([tok])
        new = update_request_block_hashes(req, bs)
        seen_new.extend(new)
        expected = hash_request_tokens(bs, req.all_token_ids, cache_salt="s")
        assert req.block_hashes == expected
        assert len(new) == (1 if req.num_tokens % bs == 0 else 0)
        # A second call with no new tokens adds nothing.
        assert update_request_block_hashes(req, bs) == []
    assert seen_new == req.block_hashes
    # Appending several tokens at once fills several blocks in one call.
    req.append_output_token_ids(list(range(100, 109)))
    new = update_request_block_hashes(req, bs)
    assert len(new) == req.num_tokens // bs - len(seen_new)
    assert req.block_hashes == hash_request_tokens(bs, req.all_token_ids, cache_salt="s")


# ---------------------------------------------------------------- free queue
def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def check_links(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Walk forward and backward; both directions must agree with num_free_blocks."""
    forward = ids(queue.get_all_free_blocks())
    backward = []
    curr = queue.fake_free_list_tail.prev_free_block
    while curr is not queue.fake_free_list_head:
        backward.append(curr.block_id)
        curr = curr.prev_free_block
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks
    return forward


def test_free_queue_basic_order():
    blocks = make_blocks(5)
    q = FreeKVCacheBlockQueue(blocks)
    assert check_links(q) == [0, 1, 2, 3, 4]
    b0 = q.popleft()
    assert b0.block_id == 0 and b0.prev_free_block is None and b0.next_free_block is None
    assert ids(q.popleft_n(2)) == [1, 2]
    assert check_links(q) == [3, 4]
    q.append(b0)
    assert check_links(q) == [3, 4, 0]
    q.append_n([blocks[2], blocks[1]])
    assert check_links(q) == [3, 4, 0, 2, 1]
    assert q.popleft_n(0) == []


def test_free_queue_remove_head_middle_tail():
    blocks = make_blocks(5)
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert check_links(q) == [0, 1, 3, 4]
    q.remove(blocks[0])
    assert check_links(q) == [1, 3, 4]
    q.remove(blocks[4])
    assert check_links(q) == [1, 3]
    assert blocks[4].prev_free_block is None and blocks[4].next_free_block is None
    q.remove(blocks[1])
    q.remove(blocks[3])
    assert check_links(q) == []
    q.append(blocks[3])
    assert check_links(q) == [3]


def test_free_queue_errors_leave_queue_intact():
    blocks = make_blocks(3)
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.popleft_n(4)
    assert check_links(q) == [0, 1, 2]
    with pytest.raises(RuntimeError):
        q.append(blocks[1])  # already in the queue
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)  # not in the queue
    assert check_links(q) == [1, 2]
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0 and check_links(q) == []


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("popleft"), st.just(0)),
        st.tuples(st.just("popleft_n"), st.integers(0, 6)),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("append"), st.integers(0, 1000)),
        st.tuples(st.just("append_n"), st.integers(0, 6)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 12), ops=_ops)
def test_free_queue_matches_list_model(n, ops):
    blocks = make_blocks(n)
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(n))        # free ids, head first
    out: list[int] = []           # ids not in the queue, in the order they left
    for op, arg in ops:
        if op == "popleft":
            if not model:
                with pytest.raises(ValueError):
                    q.popleft()
                continue
            assert q.popleft().block_id == model[0]
            out.append(model.pop(0))
        elif op == "popleft_n":
            if arg > len(model):
                with pytest.raises(ValueError):
                    q.popleft_n(arg)
                continue
            assert ids(q.popleft_n(arg)) == model[:arg]
            out.extend(model[:arg])
            del model[:arg]
        elif op == "remove":
            if not model:
                continue
            victim = model[arg % len(model)]
            q.remove(blocks[victim])
            model.remove(victim)
            out.append(victim)
        elif op == "append":
            if not out:
                continue
            back = out.pop(arg % len(out))
            q.append(blocks[back])
            model.append(back)
        else:  # append_n: most recently removed first, like a reversed block table
            k = min(arg, len(out))
            back = out[len(out) - k:][::-1]
            del out[len(out) - k:]
            q.append_n([blocks[i] for i in back])
            model.extend(back)
        assert check_links(q) == model
        assert q.num_free_blocks == len(model)
    for i in out:
        assert blocks[i].prev_free_block is None and blocks[i].next_free_block is None


# ---------------------------------------------------------------- stats
def test_prefix_cache_stats_reset():
    s = PrefixCacheStats(requests=2, queries=100, hits=25)
    assert s.hit_rate == 0.25
    s.reset()
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    assert s.hit_rate == 0.0
