"""The proxy's instance choice and request rewriting (no servers needed)."""
from __future__ import annotations

import pytest

from kvserve.entrypoints.proxy import InstancePool, _prefill_body, _splittable


def test_round_robin_takes_turns() -> None:
    pool = InstancePool(["http://a/", "http://b", "http://c"], "round_robin")
    assert [pool.pick() for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2


def test_least_loaded_prefers_idle_and_rotates_ties() -> None:
    pool = InstancePool(["http://a", "http://b"], "least_loaded")
    with pool.acquire() as first:
        with pool.acquire() as second:
            assert {first, second} == {"http://a", "http://b"}   # the busy one is avoided
        assert pool.pick() != first
        assert pool.pick() != first
    assert pool.in_flight == {"http://a": 0, "http://b": 0}
    assert {pool.pick(), pool.pick()} == {"http://a", "http://b"}   # ties rotate


def test_pool_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        InstancePool([], "round_robin")
    with pytest.raises(ValueError, match="policy"):
        InstancePool(["http://a"], "random")


def test_prefill_request_is_one_token_and_not_streamed() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    pre = _prefill_body(body, chat=False)
    assert pre["max_tokens"] == 1 and "stream" not in pre and "min_tokens" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body   # left as it was
    assert _prefill_body({"messages": [], "max_completion_tokens": 9}, chat=True)[
        "max_completion_tokens"] == 1


@pytest.mark.parametrize("body, chat, expected", [
    ({"prompt": "x"}, False, True),
    ({"prompt": [1, 2, 3]}, False, True),
    ({"prompt": ["a", "b"]}, False, False),          # several prompts: decode instance alone
    ({"prompt": [[1], [2]]}, False, False),
    ({"prompt": "x", "n": 2}, False, False),
    ({"prompt": "x", "kv_transfer_params": {}}, False, False),
    ({"messages": [{"role": "user", "content": "x"}]}, True, True),
])
def test_which_requests_are_split(body: dict, chat: bool, expected: bool) -> None:
    assert _splittable(body, chat) is expected
