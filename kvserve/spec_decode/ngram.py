"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n from prompt_lookup_max down to prompt_lookup_min).

Vectorised over the batch and the history: for each n, one sliding-window comparison of every
row's tokens against its own suffix (numpy), no Python scan of the history. The latest match
is taken (vLLM takes the first): recent text predicts the continuation better, and in a loop
the latest occurrence is the one that continues it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, ib: "InputBatch", rows: np.ndarray,
                num_drafts: np.ndarray) -> list[list[int]]:
        num_tokens = ib.num_tokens[rows]
        L = int(num_tokens.max()) if len(rows) else 0
        return self.propose_tokens(ib.token_ids[rows, :L], num_tokens, num_drafts)

    def drop(self, req_ids: set[str]) -> None:
        pass   # stateless

    def propose_tokens(self, token_ids: np.ndarray, num_tokens: np.ndarray,
                       num_drafts: np.ndarray) -> list[list[int]]:
        """token_ids [B, L] (row b valid up to num_tokens[b]); num_drafts [B]: how many
        tokens row b may get (0: none). Returns up to num_drafts[b] tokens per row."""
        B = token_ids.shape[0]
        num_tokens = num_tokens.astype(np.int64)
        L = int(num_tokens.max()) if B else 0
        tokens = token_ids[:, :L]
        match_end = np.full(B, -1, dtype=np.int64)   # index after the matched n-gram
        for n in range(self.max_n, self.min_n - 1, -1):
            todo = (match_end < 0) & (num_drafts > 0) & (num_tokens > n)
            if not todo.any() or L <= n:
                continue
            rows = np.nonzero(todo)[0]
            t, nt = tokens[rows], num_tokens[rows]
            suffix = t[np.arange(len(rows))[:, None], nt[:, None] - n + np.arange(n)]
            windows = sliding_window_view(t, n, axis=1)                    # [b, W, n]
            eq = (windows == suffix[:, None, :]).all(axis=2)               # [b, W]
            # A match must end before the last token: the suffix itself is no match, and a
            # continuation must exist.
            W = eq.shape[1]
            eq &= np.arange(W)[None, :] <= (nt - n - 1)[:, None]
            found = eq.any(axis=1)
            latest = W - 1 - np.argmax(eq[:, ::-1], axis=1)
            match_end[rows[found]] = latest[found] + n
        result: list[list[int]] = [[] for _ in range(B)]
        for b in np.nonzero(match_end >= 0)[0]:
            end = min(int(match_end[b]) + int(num_drafts[b]), int(num_tokens[b]))
            result[b] = tokens[b, match_end[b]:end].tolist()
        return result
