"""Building blocks of the KV cache manager: block hashes, blocks, the free block queue, stats.

Nothing here knows about tensors: a `KVCacheBlock` is only the bookkeeping for one page of the
paged KV cache that the worker owns (its `block_id` indexes the worker's KV tensors).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    from kvserve.config import KVCacheGroupSpec
    from kvserve.core.request import Request

# Parent hash of a request's first block. A fixed value (rather than hash(None), which is
# address-based before Python 3.12) keeps int-token hashes identical across processes.
NONE_HASH: int = int.from_bytes(hashlib.sha256(b"kvserve-none-hash").digest()[:8], "big")


class BlockHash(NamedTuple):
    """Identity of a full block of tokens in the prefix cache.

    `hash_value` chains the parent block's hash with this block's tokens and extra keys, so
    equal hashes mean "same tokens at the same place after the same prefix". The tokens and
    extra keys are kept as well: `cached_block_hash_to_block` compares them on lookup, so a
    collision of `hash_value` alone never yields a false hit on different tokens.
    """
    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: Optional[tuple] = None

    # Dict lookups hash the key; reuse the precomputed chain hash instead of rehashing the
    # token tuple every time. Equality is still the full tuple comparison.
    def __hash__(self) -> int:  # type: ignore[override]
        return self.hash_value


def hash_block_tokens(
    parent_hash_value: Optional[int],
    token_ids: Sequence[int],
    extra_keys: Optional[tuple] = None,
) -> BlockHash:
    """Hash one full block: (parent hash, this block's tokens, extra keys) -> BlockHash.

    `parent_hash_value` is None for a request's first block. `extra_keys` carries whatever
    else changes the block's KV besides the tokens (here: the request's cache_salt, in the
    first block only, which makes every later block differ through the chain).
    """
    if parent_hash_value is None:
        parent_hash_value = NONE_HASH
    token_ids = tuple(token_ids)
    return BlockHash(hash((parent_hash_value, token_ids, extra_keys)), token_ids, extra_keys)


def _first_block_extra_keys(cache_salt: Optional[str],
                            lora_key: Optional[tuple] = None) -> Optional[tuple]:
    """The salt and the LoRA adapter (two adapters' KV of one prompt differ) of the chain."""
    if lora_key is None:
        return None if cache_salt is None else (cache_salt,)
    return (cache_salt, *lora_key) if cache_salt is not None else lora_key


def lora_hash_key(lora_request: Optional[object]) -> Optional[tuple]:
    """A LoRARequest's part of the block hashes: its id, name and path."""
    if lora_request is None:
        return None
    return ("lora", getattr(lora_request, "lora_int_id"), getattr(lora_request, "lora_name"),
            getattr(lora_request, "lora_path"))


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    cache_salt: Optional[str] = None,
    lora_request: Optional[object] = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a partial tail block is skipped)."""
    hashes: list[BlockHash] = []
    parent: Optional[int] = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (_first_block_extra_keys(cache_salt, lora_hash_key(lora_request))
                 if start == 0 else None)
        block_hash = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(block_hash)
        parent = block_hash.hash_value
    return hashes


def update_request_block_hashes(request: "Request", block_size: int) -> list[BlockHash]:
    """Append to `request.block_hashes` the hashes of its blocks that became full since the
    last call, and return just those. Incremental and cheap when nothing changed, so callers
    may invoke it after every token append (the KV cache manager also calls it itself)."""
    block_hashes = request.block_hashes
    num_hashed = len(block_hashes)
    num_full = request.num_tokens // block_size
    if num_full <= num_hashed:
        return []
    token_ids = request.all_token_ids
    parent: Optional[int] = block_hashes[-1].hash_value if num_hashed else None
    new_hashes: list[BlockHash] = []
    for i in range(num_hashed, num_full):
        start = i * block_size
        extra = (_first_block_extra_keys(request.cache_salt, lora_hash_key(request.lora_request))
                 if i == 0 else None)
        block_hash = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        new_hashes.append(block_hash)
        parent = block_hash.hash_value
    block_hashes.extend(new_hashes)
    return new_hashes


class KVCacheBlock:
    """Bookkeeping for one KV cache block.

    `ref_cnt` counts the running requests whose block table holds the block; at 0 the block
    sits in the free queue but keeps its `block_hash` (and its KV) until it is reused, so a
    later request with the same prefix can still hit it.
    """
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache map.
        self.block_hash: Optional[BlockHash] = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"hashed={self.block_hash is not None})")


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first.

    A doubly linked list threaded through the blocks' own `prev_free_block`/`next_free_block`
    fields, between two sentinel blocks, so that

        head <-> b7 <-> b2 <-> ... <-> b5 <-> tail

    `remove` takes a block out of the middle in O(1) (a prefix hit on a freed block), and no
    operation allocates list nodes. Freed blocks are appended at the tail, so the head holds
    the least recently freed blocks (LRU).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Pop the head (least recently freed) block."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        assert nxt is not None
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the `n` head blocks, in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        if n <= 0:
            return []
        result: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert curr is not None
            result.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        # Relink the head sentinel to the first block left.
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return result

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"append() called on a block already in the free queue: {block}")
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append `blocks` at the tail, in the given order."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        n = 0
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"append_n() got a block already in the free queue: {block}")
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head to tail (O(n); for tests and debugging)."""
        result: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            result.append(curr)
            curr = curr.next_free_block
        return result


@dataclass
class PrefixCacheStats:
    """Prefix cache counters since the last reset: requests looked up, prompt tokens queried,
    tokens found in the cache."""
    requests: int = 0
    queries: int = 0
    hits: int = 0

    def reset(self) -> None:
        self.requests = 0
        self.queries = 0
        self.hits = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def blocks_per_request(groups: Sequence["KVCacheGroupSpec"], max_model_len: int,
                       block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks one request of max_model_len tokens holds at once, summed over the KV
    cache groups (vLLM's per-spec max_memory_usage_bytes), the hybrid pool's null block
    included: a full-attention group every block of the request; a sliding-window group W
    only the positions a step touches, the first query's window plus the step's other new
    tokens: n = min(W - 1 + step, L) positions, on at most cdiv(n - 1, bs) + 1 blocks (a
    misaligned run straddles one more block edge). No groups (one table, every layer full
    attention): cdiv(L, bs)."""
    full = -(-max_model_len // block_size)
    if not groups:
        return full
    total = 1                                       # HybridKVCacheManager's null block
    for group in groups:
        if group.sliding_window is None:
            total += full
        else:
            positions = min(group.sliding_window - 1 + max_num_batched_tokens, max_model_len)
            total += min(full, -(-(positions - 1) // block_size) + 1)
    return total
