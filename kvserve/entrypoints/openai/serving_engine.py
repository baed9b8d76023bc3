"""What the completion and chat handlers share: errors, prompt checks, admission, streaming.

Error bodies have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
vLLM's type names. Handlers raise `ServingError`; the app turns it into the response.

Admission control ("do better" than vLLM's unbounded queue): with `--max-num-queued-requests
N`, a request is refused with 503 when admitting it would leave more than N sequences
waiting. The waiting count is estimated at once, without a round trip to the engine core:
`max(in_flight - max_num_seqs, waiting in the engines' last reports)` (max_num_seqs summed
over the data-parallel engines), where `in_flight` counts
the sequences this server has admitted and not yet finished (n per prompt). The first term is
exact whenever the batch size, not KV memory, is what keeps requests waiting; the second
catches the KV-bound case one engine step late.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import (Any, AsyncGenerator, AsyncIterator, Callable, Iterable, Optional, Sequence,
                    TypeVar, Union)

from kvserve.entrypoints.beam_search import check_beam_width
from kvserve.engine.exceptions import EngineDeadError, EngineGenerateError
from kvserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.outputs import Logprob
from kvserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Logprobs of -inf cannot be written as JSON; vLLM clamps them to this.
MIN_LOGPROB = -9999.0

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


def create_error_response(message: str, status_code: int = HTTPStatus.BAD_REQUEST,
                          err_type: Optional[str] = None,
                          param: Optional[str] = None) -> ErrorResponse:
    status = HTTPStatus(status_code)
    return ErrorResponse(error=ErrorInfo(
        message=message, type=err_type or _ERROR_TYPES.get(status, status.phrase.replace(" ", "")),
        param=param, code=int(status)))


class ServingError(Exception):
    """An error a handler reports to the client (400 unless said otherwise)."""

    def __init__(self, message: str, status_code: int = HTTPStatus.BAD_REQUEST,
                 param: Optional[str] = None, err_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        self.err_type = err_type

    def to_response(self) -> ErrorResponse:
        return create_error_response(self.message, self.status_code, self.err_type, self.param)


def is_engine_dead_error(e: BaseException) -> bool:
    return isinstance(e, EngineDeadError)


# ---------------------------------------------------------------------- admission
class LoadTracker:
    """Sequences in flight and the engines' last reported queue lengths (module docstring).

    With data parallelism every engine reports its own counts; `engine_running` and
    `engine_waiting` are their sums. `recorder(i)` is engine i's stat logger: it sees every
    scheduler report of that engine.
    """

    def __init__(self, max_num_seqs: int, max_num_queued_requests: Optional[int]) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_queued_requests = max_num_queued_requests
        self.num_in_flight = 0           # sequences admitted and not finished
        self.num_requests = 0            # HTTP requests being served (/load's server_load)
        self.engine_running = 0
        self.engine_waiting = 0
        self._per_engine: dict[int, tuple[int, int]] = {}     # engine -> (running, waiting)

    def recorder(self, engine_index: int) -> Callable[[Optional[dict], Any], None]:
        def record(scheduler_stats: Optional[dict], iteration_stats: Any = None) -> None:
            if scheduler_stats:
                self.update(scheduler_stats, engine_index)
        return record

    def update(self, scheduler_stats: dict, engine_index: int = 0) -> None:
        self._per_engine[engine_index] = (int(scheduler_stats.get("num_running_reqs", 0)),
                                          int(scheduler_stats.get("num_waiting_reqs", 0)))
        self._sum()

    def update_all(self, stats_per_engine: dict[int, dict]) -> None:
        """A fresh snapshot of every live engine (a dead engine's counts are dropped)."""
        self._per_engine = {i: (int(s.get("num_running_reqs", 0)), int(s.get("num_waiting_reqs", 0)))
                            for i, s in stats_per_engine.items()}
        self._sum()

    def _sum(self) -> None:
        self.engine_running = sum(r for r, _ in self._per_engine.values())
        self.engine_waiting = sum(w for _, w in self._per_engine.values())

    @property
    def estimated_waiting(self) -> int:
        return max(self.num_in_flight - self.max_num_seqs, self.engine_waiting, 0)

    def admit(self, num_seqs: int) -> "Admission":
        limit = self.max_num_queued_requests
        if limit is not None:
            after = max(self.num_in_flight + num_seqs - self.max_num_seqs, self.engine_waiting, 0)
            if after > limit:
                raise ServingError(
                    f"The server is overloaded: {self.estimated_waiting} requests are waiting "
                    f"(limit {limit}, --max-num-queued-requests). Retry later.",
                    HTTPStatus.SERVICE_UNAVAILABLE)
        self.num_in_flight += num_seqs
        self.num_requests += 1
        return Admission(self, num_seqs)


class Admission:
    """One admitted HTTP request: gives its sequences back exactly once."""

    def __init__(self, tracker: LoadTracker, num_seqs: int) -> None:
        self._tracker = tracker
        self._num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._tracker.num_in_flight -= self._num_seqs
            self._tracker.num_requests -= 1


# ---------------------------------------------------------------------- streams
async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Closing or cancelling the merged generator cancels the pending reads (AsyncLLM aborts a
    request whose consumer is cancelled).
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            # Let each cancelled read unwind inside its generator (that is where the engine
            # request is aborted) before the generators are dropped.
            await asyncio.gather(*pending, return_exceptions=True)


class RequestTracker:
    """The engine request ids of one HTTP request: which are still running, and the abort
    for the rest when the client goes away. `close()` is idempotent and synchronous, so it is
    safe from `finally` blocks of cancelled tasks (where an `await` would be cancelled again)."""

    def __init__(self, engine_client: Any, admission: Admission, request_ids: Iterable[str]) -> None:
        self._engine = engine_client
        self._admission = admission
        self.unfinished = set(request_ids)
        self._closed = False

    def finished(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    async def collect(self, generators: Sequence[AsyncIterator[Any]],
                      engine_ids: Sequence[str]) -> list[Any]:
        """Each generator's last output (None where it yielded none); closes the tracker
        (aborting what is unfinished) however it ends. Engine errors become ServingErrors."""
        final: list[Any] = [None] * len(generators)
        try:
            async with aclosing(merge_async_iterators(*generators)) as stream:
                async for i, res in stream:
                    final[i] = res
                    if res.finished:
                        self.finished(engine_ids[i])
        except Exception as e:
            raise to_serving_error(e) from e
        finally:
            self.close()
        return final

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._admission.release()
        if self.unfinished:
            ids, self.unfinished = sorted(self.unfinished), set()
            _spawn(self._abort(ids))

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self._engine.abort(request_ids)
        except Exception as e:  # the engine may be dead; nothing left to free then
            logger.debug("abort of %s failed: %s", request_ids, e)


_BACKGROUND_TASKS: set[asyncio.Task] = set()


def _spawn(coro: Any) -> None:
    # Keep a reference: the event loop holds only weak references to tasks.
    task = asyncio.ensure_future(coro)
    _BACKGROUND_TASKS.add(task)
    task.add_done_callback(_BACKGROUND_TASKS.discard)


class StreamingResult:
    """A streaming response to be: the SSE body and the tracker to close when the response
    ends however it ends (the body may never start if the client leaves at once). `events`
    yields the SSE frames; an exception becomes an error frame, then `[DONE]` where `done`."""

    def __init__(self, events: AsyncGenerator[str, None], tracker: RequestTracker,
                 done: bool = True) -> None:
        self.body = self._body(events, tracker, done)
        self.tracker = tracker

    @staticmethod
    async def _body(events: AsyncGenerator[str, None], tracker: RequestTracker,
                    done: bool) -> AsyncGenerator[str, None]:
        try:
            async with aclosing(events):
                async for frame in events:
                    yield frame
        except Exception as e:
            yield sse(error_payload(e))
        finally:
            tracker.close()
        if done:
            yield SSE_DONE


class DisconnectCheck:
    """Whether a streaming client has left, asked at most every `interval` seconds. Starlette's
    StreamingResponse already cancels the body when the client disconnects (uvicorn's ASGI
    spec 2.3 runs its listener; 2.4 fails the next send): this is only a backstop, and one
    ask costs ~0.2 ms (anyio's cancel scope formats the task's repr), which on every chunk
    was a quarter of the API server's CPU with 256 streams (py-spy)."""

    def __init__(self, raw_request: Any, interval: float = 2.0) -> None:
        self.raw_request = raw_request
        self.interval = interval
        self._next = 0.0

    async def __call__(self) -> bool:
        if self.raw_request is None:
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval
        return await self.raw_request.is_disconnected()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------------- limits
@dataclass
class RequestLimits:
    """What one request may ask for (the server's flags; vLLM's names where it has them)."""
    max_n_sequences: int = 1024               # n x prompts (vLLM: VLLM_MAX_N_SEQUENCES)
    trust_request_chat_template: bool = False   # vLLM's --trust-request-chat-template


# Texts longer than this are tokenized in a thread (the tokenizer releases the GIL), so that
# a long prompt does not stall the event loop (and /health) while it is encoded.
_ENCODE_IN_THREAD_CHARS = 1 << 16
# A text this many times longer than max_model_len (in characters) cannot fit in the context
# with any real tokenizer; it is refused before the CPU is spent tokenizing it.
MAX_CHARS_PER_TOKEN = 64


def check_unicode(text: str, param: str) -> None:
    """JSON lets a request carry lone UTF-16 surrogates ("\\ud800"), which are not text: the
    tokenizer would fail on them with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ServingError(f"{param} is not valid Unicode: a lone surrogate "
                           f"{text[e.start]!r} at position {e.start}.", param=param) from None


def large_messages(messages: list[dict[str, Any]]) -> bool:
    """Whether rendering these chat messages may take long enough to stall the event loop."""
    if len(messages) > 64:
        return True
    return sum(len(m["content"]) for m in messages
               if isinstance(m.get("content"), str)) > _ENCODE_IN_THREAD_CHARS


# ---------------------------------------------------------------------- handler base
class OpenAIServing:
    """Base of the completion and chat handlers: the checks every generation request gets."""

    request_id_prefix = "cmpl"
    limits = RequestLimits()      # the server replaces it with its flags' values

    def __init__(self, engine_client: Any, models: OpenAIServingModels, load: LoadTracker,
                 default_sampling_params: Optional[dict[str, Any]] = None) -> None:
        self.engine_client = engine_client
        self.models = models
        self.load = load
        self.tokenizer = engine_client.tokenizer
        model_config = engine_client.model_config
        self.max_model_len: int = model_config.max_model_len
        self.max_logprobs: int = model_config.max_logprobs
        self.model_vocab_size: int = model_config.vocab_size
        # Ids are valid if either vocabulary knows them (padded embedding tables).
        self.max_input_id = max(self.model_vocab_size, self.tokenizer.vocab_size) - 1
        self.default_sampling_params = dict(default_sampling_params or {})

    # ------------------------------------------------------------------ checks
    def check_model(self, model: Optional[str]) -> None:
        if not self.models.is_base_model(model):
            raise ServingError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND,
                               param="model", err_type="NotFoundError")

    def check_engine(self) -> None:
        if getattr(self.engine_client, "errored", False):
            dead = getattr(self.engine_client, "dead_error", None)
            raise ServingError(f"The engine is dead: {dead or 'engine core stopped'}.",
                               HTTPStatus.SERVICE_UNAVAILABLE)

    def make_request_id(self, request: Any, raw_request: Any) -> str:
        rid = getattr(request, "request_id", None)
        if not rid and raw_request is not None:
            rid = raw_request.headers.get("X-Request-Id")
        return f"{self.request_id_prefix}-{rid or random_uuid()}"

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt",
                     truncating: bool = False) -> list[int]:
        """Tokenize; `truncating`: the request cuts the prompt to fit (truncate_prompt_tokens),
        so its length is not checked here."""
        check_unicode(text, param)
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if not truncating and len(text) > limit:
            raise ServingError(f"This model's maximum context length is {self.max_model_len} "
                               f"tokens. However, your request has {len(text)} characters of "
                               f"input, more than that context can hold (at most {limit}). "
                               f"Please reduce the length of the {param}.", param=param)
        if len(text) > _ENCODE_IN_THREAD_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text,
                                           add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_request_chat_template(self, chat_template: Optional[str]) -> None:
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise ServingError("Chat template is passed with request, but "
                               "--trust-request-chat-template is not set. Refused request with "
                               "untrusted chat template.", param="chat_template")

    @staticmethod
    async def run_maybe_in_thread(large: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), in a thread when the input is large (the event loop keeps
        answering meanwhile), inline otherwise (a thread hop costs more than a small call)."""
        if large:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def check_num_sequences(self, n: int, num_prompts: int) -> None:
        limit = self.limits.max_n_sequences
        if n * num_prompts > limit:
            what = f"n={n}" if num_prompts == 1 else f"n={n} x {num_prompts} prompts"
            raise ServingError(f"The request asks for {what} = {n * num_prompts} sequences; "
                               f"at most {limit} are allowed (--max-n-sequences).", param="n")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ServingError(f"{param} must not be empty.", param=param)
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi > self.max_input_id:
            raise ServingError(f"Token id {lo if lo < 0 else hi} is out of vocabulary "
                               f"(vocabulary size {self.max_input_id + 1}).", param=param)

    def truncate(self, ids: list[int], truncate_prompt_tokens: Optional[int]) -> list[int]:
        if truncate_prompt_tokens is None:
            return ids
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return ids[-keep:]

    def check_length(self, num_prompt_tokens: int, max_tokens: Optional[int],
                     prompt_param: str) -> int:
        """vLLM's context-length rule and message; returns the max_tokens to use."""
        max_len = self.max_model_len
        if max_tokens is not None and max_tokens >= 1 and num_prompt_tokens + max_tokens > max_len:
            raise ServingError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion.", param="max_tokens")
        if num_prompt_tokens >= max_len:
            raise ServingError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"request has {num_prompt_tokens} input tokens, which leaves no room for the "
                f"completion. Please reduce the length of the messages.", param=prompt_param)
        return max_len - num_prompt_tokens

    def sampling_params(self, request: Any, default_max_tokens: int) -> SamplingParams:
        try:
            params = request.to_sampling_params(default_max_tokens, self.default_sampling_params)
            params.verify_against_vocab(self.model_vocab_size, self.max_logprobs)
        except ValueError as e:
            raise ServingError(str(e)) from e
        return params

    def beam_search_params(self, request: Any, beam_width: int, max_tokens: int
                           ) -> BeamSearchParams:
        """`use_beam_search`: its params, or a 400 for what beam search cannot do."""
        try:
            params = request.beam_search_params(beam_width, max_tokens)
            check_beam_width(params, self.max_logprobs)
        except ValueError as e:
            raise ServingError(str(e)) from e
        self.check_num_sequences(beam_width, 1)
        return params

    # ------------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, logprob: Optional[Logprob]) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode_tokens([token_id])[0]


def raise_if_failed(outputs: Iterable[Any]) -> None:
    """A request the engine ended with finish_reason "error" gets an error response, not a 200
    with a half answer: 400 when its constraint could not be compiled (the request's fault),
    500 otherwise."""
    for out in outputs:
        if out.finish_reason == "error":
            reason = str(out.stop_reason or "The request failed in the engine.")
            bad_input = reason.startswith(("grammar compilation failed", "the constraint "))
            raise ServingError(reason, HTTPStatus.BAD_REQUEST if bad_input
                               else HTTPStatus.INTERNAL_SERVER_ERROR,
                               param="structured_outputs" if bad_input else None)


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def now() -> int:
    return int(time.time())


def error_payload(e: BaseException) -> str:
    """An error in a stream that already started: one SSE event with the error body."""
    if isinstance(e, ServingError):
        resp = e.to_response()
    elif is_engine_dead_error(e):
        resp = create_error_response(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    elif isinstance(e, ValueError):
        resp = create_error_response(str(e))
    elif isinstance(e, EngineGenerateError):
        resp = create_error_response(str(e), HTTPStatus.INTERNAL_SERVER_ERROR)
    else:
        logger.exception("Error in a streaming response")
        resp = create_error_response(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
    return resp.model_dump_json()


def to_serving_error(e: BaseException) -> Union[ServingError, BaseException]:
    """ValueErrors from the engine (bad input) are 400s; a dead engine is a 503."""
    if isinstance(e, ServingError):
        return e
    if is_engine_dead_error(e):
        return ServingError(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(e, ValueError):
        return ServingError(str(e))
    return e
