"""StructuredOutputManager: grammars for the engine core, never compiled on the busy loop.

    add_request ─► grammar_init: look up (kind, spec) in the cache of compile futures, else
                   submit a compile to the thread pool; the request waits (WAITING_FOR_FSM)
    schedule    ─► take_ready: requests whose future is done become WAITING (or fail)
    after schedule ► grammar_bitmask: one int32 [rows, ceil(V/32)] for the constrained requests
                   that sample this step, shipped to the workers with the SchedulerOutput
    update      ─► accept_tokens per sampled token; a terminated matcher ends the request

A request that reasons first (`reasoning_end_token_id` set by a server with
--reasoning-parser) keeps its matcher aside until that token is generated: until then it
has no grammar, so no bitmask row, draft check or jump-forward applies to the reasoning.

The backend (xgrammar) and its tokenizer info are built once, on the first structured request,
inside the pool as well.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from kvserve.config import KVServeConfig
from kvserve.structured_output.request import StructuredOutputRequest, grammar_key

if TYPE_CHECKING:
    from kvserve.core.request import Request

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, config: KVServeConfig, stop_token_ids: Optional[list[int]] = None) -> None:
        self.config = config
        self.so_config = config.structured_outputs_config
        self.vocab_size = config.model_config.vocab_size
        self._stop_token_ids = stop_token_ids
        self._executor = ThreadPoolExecutor(max_workers=self.so_config.max_compile_threads,
                                            thread_name_prefix="kvserve-grammar")
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._tokenizer: Any = None
        # (kind, spec) -> Future of the compiled grammar; failed compiles are dropped.
        self._compiled: dict[tuple[str, Any], Future] = {}
        self._bitmask: Optional[np.ndarray] = None
        self._num_active = 0
        # request id -> when it started waiting for its grammar (the compile time limit).
        self._waiting_since: dict[str, float] = {}

    # ------------------------------------------------------------------ compile
    @property
    def backend(self) -> Any:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _make_backend(self) -> Any:
        from kvserve.structured_output.backend_xgrammar import XgrammarBackend, import_xgrammar
        from kvserve.tokenizer import Tokenizer
        if self.so_config.backend == "guidance":
            raise ValueError("The 'guidance' structured outputs backend is not available in "
                             "kvserve yet; use 'xgrammar' (or 'auto').")
        import_xgrammar()
        self._tokenizer = Tokenizer.from_pretrained(self.config.model_config.tokenizer)
        stop = self._stop_token_ids
        if stop is None:
            stop = sorted(self._tokenizer.eos_token_ids)
        return XgrammarBackend(self._tokenizer, self.vocab_size, stop,
                               max_threads=self.so_config.max_compile_threads)

    def grammar_init(self, request: "Request") -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params, self.so_config.disable_any_whitespace)
        so_req = StructuredOutputRequest(params=params, key=key)
        future = self._compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(self._compile, key)
            self._compiled[key] = future
        so_req.future = future
        request.structured_output_request = so_req
        self._waiting_since[request.request_id] = time.monotonic()

    def _compile(self, key: tuple[str, Any]) -> Any:
        return self.backend.compile_grammar(*key)

    def take_ready(self, request: "Request") -> bool:
        """True once the request's grammar is compiled (its matcher is then set) or failed
        (`error` is then set)."""
        so_req = request.structured_output_request
        assert so_req is not None
        if not so_req.is_ready():
            limit = self.so_config.grammar_compile_timeout_s
            if time.monotonic() - self._waiting_since.get(request.request_id, time.monotonic()) <= limit:
                return False
            so_req.error = (f"the grammar did not compile within {limit:g} s "
                            f"(structured_outputs_config.grammar_compile_timeout_s)")
        self._waiting_since.pop(request.request_id, None)
        if so_req.grammar is None and so_req.waiting_grammar is None and so_req.error is None:
            assert so_req.future is not None
            exc = so_req.future.exception()
            if exc is not None:
                self._compiled.pop(so_req.key, None)
                so_req.error = f"{type(exc).__name__}: {exc}" if not isinstance(
                    exc, ValueError) else str(exc)
            elif so_req.params.reasoning_end_token_id is not None:
                so_req.waiting_grammar = self.backend.make_grammar(so_req.future.result())
            else:
                so_req.grammar = self.backend.make_grammar(so_req.future.result())
                self._num_active += 1
        return True

    def drop(self, request: "Request") -> None:
        """A finished or aborted request: a compile nobody else waits for is cancelled when it
        has not started (a started one finishes into the cache)."""
        so_req = request.structured_output_request
        if so_req is None:
            return
        self._waiting_since.pop(request.request_id, None)
        if so_req.future is not None and not so_req.future.done():
            if self._compiled.get(so_req.key) is so_req.future and so_req.future.cancel():
                self._compiled.pop(so_req.key, None)
        if so_req.grammar is not None:
            self._num_active -= 1
            so_req.grammar = None
        so_req.waiting_grammar = None

    @property
    def num_active(self) -> int:
        """Requests holding a matcher (the step computes a bitmask only when some do)."""
        return self._num_active

    def wait_for_any(self, requests: list["Request"], timeout: float) -> None:
        futures = [r.structured_output_request.future for r in requests
                   if r.structured_output_request is not None
                   and r.structured_output_request.future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ per step
    def grammar_bitmask(self, requests: dict[str, "Request"], scheduled: Iterable[str],
                        spec_tokens: Optional[dict[str, list[int]]] = None
                        ) -> tuple[Optional[np.ndarray], list[str]]:
        """The bitmask rows of the constrained requests that sample this step (their computed
        tokens have caught up with their tokens), and the request id of each request's rows.

        A request with k draft tokens gets k + 1 consecutive rows: row j allows what may follow
        its drafts 0..j-1 (row k: the bonus position). Its matcher is advanced over the drafts
        one position at a time to fill them, then rolled back: it advances over the tokens
        actually accepted when the step's output comes back."""
        spec_tokens = spec_tokens or {}
        ids: list[str] = []
        grammars = []
        drafts: list[list[int]] = []
        for rid in scheduled:
            req = requests[rid]
            so_req = req.structured_output_request
            if so_req is None or so_req.grammar is None or req.num_computed_tokens < req.num_tokens:
                continue
            ids.append(rid)
            grammars.append(so_req.grammar)
            drafts.append(spec_tokens.get(rid, []))
        if not ids:
            return None, ids
        backend = self.backend
        num_rows = len(ids) + sum(map(len, drafts))
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            rows = max(num_rows, self.config.scheduler_config.max_num_seqs)
            self._bitmask = np.empty((rows, backend.num_bitmask_words()), dtype=np.int32)
        if num_rows == len(ids):
            backend.fill_bitmasks(grammars, self._bitmask)
        else:
            self._fill_with_drafts(grammars, drafts, self._bitmask)
        # A copy: the buffer is refilled next step while the workers may still hold this one.
        return self._bitmask[:num_rows].copy(), ids

    def _fill_with_drafts(self, grammars: list[Any], drafts: list[list[int]],
                          bitmask: np.ndarray) -> None:
        """Rows per request: one per draft position + the bonus one (see grammar_bitmask).
        Position j is filled for every request at once (one batched fill per position)."""
        backend = self.backend
        starts = np.cumsum([len(d) + 1 for d in drafts]) - [len(d) + 1 for d in drafts]
        advanced = [0] * len(grammars)
        live = list(range(len(grammars)))        # requests whose drafts so far were accepted
        for j in range(max(map(len, drafts)) + 1):
            active = [i for i in live if j <= len(drafts[i])]
            backend.fill_bitmasks([grammars[i] for i in active], bitmask,
                                  [int(starts[i]) + j for i in active])
            live = []
            for i in active:
                if j < len(drafts[i]) and grammars[i].accept_tokens("", [drafts[i][j]]):
                    advanced[i] += 1
                    live.append(i)
                elif j < len(drafts[i]):
                    # Refused (drafts are validated on arrival, so only a defence): the
                    # target cannot accept this draft; later rows just repeat this one.
                    end = int(starts[i]) + len(drafts[i]) + 1
                    bitmask[int(starts[i]) + j + 1:end] = bitmask[int(starts[i]) + j]
        for grammar, n in zip(grammars, advanced):
            if n:
                grammar.rollback(n)

    def accept_tokens(self, request: "Request", tokens: list[int]) -> bool:
        so_req = request.structured_output_request
        assert so_req is not None
        if so_req.grammar is None:
            tokens = self._end_reasoning(so_req, tokens)
            if so_req.grammar is None or not tokens:
                return True
        return so_req.grammar.accept_tokens(request.request_id, tokens)

    def _end_reasoning(self, so_req: StructuredOutputRequest, tokens: list[int]) -> list[int]:
        """A reasoning request: its grammar starts once the reasoning-end token is among the
        new tokens. Returns the tokens after it, for the grammar."""
        end = so_req.params.reasoning_end_token_id
        if so_req.waiting_grammar is None or end not in tokens:
            return []
        so_req.grammar, so_req.waiting_grammar = so_req.waiting_grammar, None
        self._num_active += 1
        rest = tokens[tokens.index(end) + 1:]
        # Tokens after it in the same step (speculative decoding) were sampled free: the
        # grammar takes them only if it accepts them all, else it starts after them (vLLM's).
        if rest and len(so_req.grammar.validate_tokens(rest)) != len(rest):
            return []
        return rest

    def refusal_reason(self, request: "Request") -> str:
        """Why a sampled token could be refused: the bitmask left nothing to sample when the
        grammar allows only the end while min_tokens forbids it (a contradiction in the request,
        reported as such rather than forced either way)."""
        min_tokens = request.sampling_params.min_tokens
        so_req = request.structured_output_request
        accepted = so_req.grammar.num_processed_tokens if so_req and so_req.grammar else 0
        if accepted < min_tokens:
            return (f"the constraint allows only the end of the output after {accepted} tokens, "
                    f"but min_tokens={min_tokens}: lower min_tokens or loosen the constraint")
        return "a sampled token was refused by the grammar"

    def is_terminated(self, request: "Request") -> bool:
        so_req = request.structured_output_request
        return so_req is not None and so_req.grammar is not None and so_req.grammar.is_terminated()

    def jump_forward_tokens(self, request: "Request") -> list[int]:
        """The tokens the grammar forces next, accepted into the matcher.

        Tokenization: the forced string is encoded on its own (no merge with the token before
        it), and only the prefix of that encoding the matcher accepts is kept, so the output
        always stays inside the grammar; the model then continues from exactly these tokens.
        """
        so_req = request.structured_output_request
        if so_req is None or so_req.grammar is None or so_req.grammar.is_terminated():
            return []
        text = so_req.grammar.jump_forward_string()
        if not text:
            return []
        tokens = self._tokenizer.encode(text, add_special_tokens=False)
        # The last token may be one that a longer string would merge with: leave it to the model.
        tokens = tokens[:-1]
        kept = []
        for t in tokens:
            if not so_req.grammar.accept_tokens(request.request_id, [t]):
                break
            kept.append(t)
        return kept

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
