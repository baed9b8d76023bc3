"""The start-up fit check of the hybrid KV cache (kv_cache_utils.blocks_per_request): one
max_model_len request needs every block in a full-attention group, only its window plus one
step's tokens in a sliding-window group, plus the pool's null block. A pool of exactly that
many blocks runs such a request to the end in every chunking; one block fewer does not (for
some chunking), and an engine given fewer blocks refuses to start."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import KVCacheGroupSpec
from kvserve.core.kv_cache_coordinator import HybridKVCacheManager
from kvserve.core.kv_cache_utils import blocks_per_request
from kvserve.core.request import Request
from tests.utils import random_prompts

BS = 4
GROUPS = [KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), 8), KVCacheGroupSpec((2,), 5)]


def _run(num_blocks: int, max_len: int, step: int, prompt_len: int, first: int = 0) -> bool:
    """One request of `max_len` tokens (`prompt_len` of prompt in chunks of `step`, the first
    `first` long if set -- a step budget shared with other requests -- then one token a step)
    in a pool of `num_blocks`: True when every allocation succeeded."""
    mgr = HybridKVCacheManager(GROUPS, num_blocks=num_blocks, block_size=BS,
                               enable_caching=False, max_model_len=max_len)
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=max_len))
    while req.num_computed_tokens < max_len:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([7])
        n = min(first or step, req.num_tokens - req.num_computed_tokens)
        first = 0
        if mgr.allocate_slots(req, n) is None:
            return False
        req.num_computed_tokens += n
    mgr.free(req)
    return True


@pytest.mark.parametrize("max_len", [9, 40, 61])
@pytest.mark.parametrize("step", [1, 3, 8, 64])
def test_a_pool_of_blocks_per_request_always_suffices(max_len: int, step: int) -> None:
    need = blocks_per_request(GROUPS, max_len, BS, step)
    assert need <= 1 + 3 * -(-max_len // BS)          # never more than all-full attention
    for prompt_len in range(1, max_len + 1):
        for first in {0, 1, 2, step - 1}:
            assert _run(need, max_len, step, prompt_len, first), (prompt_len, first, need)


def test_the_bound_is_tight() -> None:
    """For each step size some request needs every block the bound counts: the groups'
    peaks coincide when the last prefill chunk is a whole step, off the block edges, ending
    at max_model_len."""
    for step in (1, 3, 8):
        assert any(not _run(blocks_per_request(GROUPS, max_len, BS, step) - 1, max_len, step,
                            max_len, first)
                   for max_len in range(20, 62) for first in range(1, step + 1)), step


def test_no_groups_is_one_table_of_the_whole_request() -> None:
    assert blocks_per_request([], 61, BS, 8) == 16
    # A window longer than the request: its group holds every block too.
    assert blocks_per_request([KVCacheGroupSpec((0,), 100)], 61, BS, 8) == 1 + 16


def test_engine_checks_the_groups_at_start(make_checkpoint) -> None:
    """Gemma 3 (5 sliding groups of window 16, 1 full; 128 tokens, steps of 24): 1 null +
    8 full + 5 x 4 = 29 blocks. 28 is refused at start; 29 runs a 128-token request
    (122 prompt tokens in chunks of 24, 6 generated)."""
    path = make_checkpoint("gemma3_text", num_hidden_layers=6, head_dim=16,
                           query_pre_attn_scalar=24, sliding_window=16)
    kw = dict(dtype="float32", max_model_len=128, seed=0, multiprocessing=False,
              block_size=16, max_num_batched_tokens=24)
    with pytest.raises(ValueError, match="needs 29 blocks of 16 tokens over 6 KV cache groups, "
                                         "the cache holds 28"):
        LLM(path, num_gpu_blocks_override=28, **kw)
    llm = LLM(path, num_gpu_blocks_override=29, **kw)
    prompt = random_prompts(1, 122, 122, vocab=1024, seed=1)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.get_stats()["num_preemptions"] == 0
