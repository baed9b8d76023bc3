"""Speculative decoding counters (vLLM's names) and their periodic log line.

The scheduler keeps cumulative counts; they travel in SchedulerStats.spec_decoding as a dict:
    num_drafts                  requests x steps that carried drafts
    num_draft_tokens            draft tokens verified
    num_accepted_tokens         draft tokens accepted
    num_accepted_tokens_per_pos accepted count at draft position 0, 1, ... (non-increasing)
"""
from __future__ import annotations

from typing import Optional


class SpecDecodingStats:
    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):   # accepted drafts are a prefix: positions 0..a-1
            self.num_accepted_tokens_per_pos[i] += 1

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}


class SpecDecodingLogging:
    """vLLM's line, over the interval since the last one:

    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted throughput: 31.2 tokens/s,
    Drafted throughput: 52.0 tokens/s, Accepted: 156 tokens, Drafted: 260 tokens,
    Per-position acceptance rate: 0.800, 0.600, 0.400, Avg Draft acceptance rate: 60.0%
    """

    def __init__(self) -> None:
        self._last: Optional[dict] = None

    def make_line(self, totals: Optional[dict], elapsed: float) -> Optional[str]:
        if not totals:
            return None
        last = self._last or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                              "num_accepted_tokens_per_pos": [0] * len(
                                  totals["num_accepted_tokens_per_pos"])}
        drafts = totals["num_drafts"] - last["num_drafts"]
        if drafts <= 0:
            return None
        self._last = totals
        drafted = totals["num_draft_tokens"] - last["num_draft_tokens"]
        accepted = totals["num_accepted_tokens"] - last["num_accepted_tokens"]
        per_pos = [(a - b) / drafts for a, b in zip(totals["num_accepted_tokens_per_pos"],
                                                    last["num_accepted_tokens_per_pos"])]
        elapsed = max(elapsed, 1e-9)
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%")
