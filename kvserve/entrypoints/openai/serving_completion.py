"""`POST /v1/completions`: prompts in, completions out, whole or streamed.

Several prompts run concurrently as separate engine requests `{id}-{i}`; choice `j` of prompt
`i` is reported with `index = i * n + j`, as OpenAI lays them out.
"""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional, Union

from kvserve.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest,
                                                 CompletionResponse, CompletionResponseChoice,
                                                 CompletionResponseStreamChoice,
                                                 CompletionStreamResponse, UsageInfo)
from kvserve.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, RequestTracker,
                                                       StreamingResult, clamp_logprob,
                                                       error_payload, merge_async_iterators, now,
                                                       raise_if_failed, sse, to_serving_error)
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Any = None
                                ) -> Union[CompletionResponse, StreamingResult]:
        """Raises ServingError (400 / 404 / 503) before anything is generated."""
        self.check_model(request.model)
        self.check_engine()
        request_id = self.make_request_id(request, raw_request)

        prompt_texts: list[Optional[str]] = []
        prompt_ids: list[list[int]] = []
        params = []
        prompts = request.prompts()
        self.check_num_sequences(request.n, len(prompts))
        for p in prompts:
            if isinstance(p, str):
                ids = await self.encode(p, request.add_special_tokens,
                                        truncating=request.truncate_prompt_tokens is not None)
                text = p
            else:
                ids, text = list(p), None
                self.check_token_ids(ids, "prompt")
            truncated = self.truncate(ids, request.truncate_prompt_tokens)
            if len(truncated) != len(ids):
                ids, text = truncated, None   # the text no longer matches the ids
            default_max_tokens = self.check_length(len(ids), request.max_tokens, "prompt")
            params.append(self.sampling_params(request, default_max_tokens))
            prompt_texts.append(text)
            prompt_ids.append(ids)

        engine_ids = [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        tracker = RequestTracker(self.engine_client,
                                 self.load.admit(request.n * len(prompt_ids)), engine_ids)
        generators = [
            self.engine_client.generate(
                {"prompt_token_ids": ids, **({"prompt": text} if text is not None else {})},
                sp, rid, priority=request.priority, cache_salt=request.cache_salt)
            for ids, text, sp, rid in zip(prompt_ids, prompt_texts, params, engine_ids)]
        ctx = _Context(request, request_id, self.models.response_model_name(request.model), now(), engine_ids,
                       prompt_texts, prompt_ids)
        if request.stream:
            return StreamingResult(self._stream(ctx, generators, tracker, raw_request), tracker)
        try:
            final: list[Optional[RequestOutput]] = [None] * len(generators)
            async with aclosing(merge_async_iterators(*generators)) as stream:
                async for i, res in stream:
                    final[i] = res
                    if res.finished:
                        tracker.finished(engine_ids[i])
        except Exception as e:
            raise to_serving_error(e) from e
        finally:
            tracker.close()
        for res in final:
            raise_if_failed(res.outputs if res is not None else ())
        return self._full_response(ctx, final)

    # ------------------------------------------------------------------ whole response
    def _full_response(self, ctx: "_Context", final: list[Optional[RequestOutput]]) -> CompletionResponse:
        request, n = ctx.request, ctx.request.n
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated_tokens = 0
        for i, res in enumerate(final):
            assert res is not None, "a prompt finished without output"
            prompt_token_ids = res.prompt_token_ids
            num_prompt_tokens += len(prompt_token_ids)
            for out in res.outputs:
                num_generated_tokens += len(out.token_ids)
                text, token_ids, lps = out.text, out.token_ids, out.logprobs
                if request.echo:
                    text = self._prompt_text(ctx, i) + text
                    token_ids = prompt_token_ids + token_ids
                    if lps is not None:
                        lps = list(res.prompt_logprobs or [None] * len(prompt_token_ids)) + lps
                logprobs = None
                if request.logprobs is not None and lps is not None:
                    logprobs = self._logprobs(token_ids, lps, 0)
                choices.append(CompletionResponseChoice(
                    index=i * n + out.index, text=text, logprobs=logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    prompt_token_ids=prompt_token_ids if request.return_token_ids else None,
                    token_ids=out.token_ids if request.return_token_ids else None))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name, choices=choices,
            usage=UsageInfo.of(num_prompt_tokens, num_generated_tokens),
            kv_transfer_params=final[0].kv_transfer_params if final else None)

    # ------------------------------------------------------------------ stream
    async def _stream(self, ctx: "_Context", generators: list, tracker: RequestTracker,
                      raw_request: Any) -> AsyncGenerator[str, None]:
        request, n = ctx.request, ctx.request.n
        state = _StreamState(n * len(generators), len(generators))
        num_prompt_tokens = [len(ids) for ids in ctx.prompt_ids]
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = include_usage and bool(opts and opts.continuous_usage_stats)
        try:
            async with aclosing(merge_async_iterators(*generators)) as stream:
                async for i, res in stream:
                    if raw_request is not None and await raw_request.is_disconnected():
                        return   # `finally` aborts what is still running
                    if res.finished:
                        tracker.finished(ctx.engine_ids[i])
                    if res.prompt_logprobs is not None and state.prompt_logprobs[i] is None:
                        state.prompt_logprobs[i] = res.prompt_logprobs
                    for out in res.outputs:
                        chunk = self._stream_chunk(ctx, state, i, res, out)
                        if chunk is None:
                            continue
                        if continuous_usage:
                            chunk.usage = UsageInfo.of(num_prompt_tokens[i],
                                                 state.num_tokens[i * n + out.index])
                        yield sse(chunk.model_dump_json(exclude_unset=True))
            if include_usage:
                chunk = CompletionStreamResponse(
                    id=ctx.request_id, object="text_completion", created=ctx.created,
                    model=ctx.model_name, choices=[],
                    usage=UsageInfo.of(sum(num_prompt_tokens), sum(state.num_tokens)))
                yield sse(chunk.model_dump_json(exclude_unset=True))
        except Exception as e:
            yield sse(error_payload(e))
        finally:
            tracker.close()
        yield SSE_DONE

    def _stream_chunk(self, ctx: "_Context", state: "_StreamState", i: int, res: RequestOutput,
                      out: CompletionOutput) -> Optional[CompletionStreamResponse]:
        """One delta of choice (prompt i, sample out.index) as a stream chunk; None when there
        is nothing new. Like vLLM, a chunk goes out for every step with new tokens, even when
        their text is still an incomplete character (so clients measure true inter-token
        latency)."""
        request = ctx.request
        idx = i * request.n + out.index
        text, token_ids, lps = out.text, out.token_ids, out.logprobs
        if request.echo and not state.echoed[idx]:
            state.echoed[idx] = True   # the first delta of a choice carries the prompt
            text = self._prompt_text(ctx, i) + text
            token_ids = res.prompt_token_ids + token_ids
            if lps is not None:
                plp = state.prompt_logprobs[i] or [None] * len(res.prompt_token_ids)
                lps = list(plp) + lps
        logprobs = None
        if request.logprobs is not None and lps is not None:
            logprobs = self._logprobs(token_ids, lps, state.text_offsets[idx])
        state.text_offsets[idx] += len(text)
        state.num_tokens[idx] += len(out.token_ids)
        if not text and not out.token_ids and out.finish_reason is None:
            return None
        choice = CompletionResponseStreamChoice(
            index=idx, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason)
        if request.return_token_ids:
            choice.token_ids = out.token_ids
        return CompletionStreamResponse(id=ctx.request_id, object="text_completion",
                                        created=ctx.created, model=ctx.model_name, choices=[choice])

    # ------------------------------------------------------------------ helpers
    def _prompt_text(self, ctx: "_Context", i: int) -> str:
        text = ctx.prompt_texts[i]
        if text is None:  # token-id prompt: decode it, special tokens kept (as vLLM does)
            text = self.tokenizer.decode(ctx.prompt_ids[i], skip_special_tokens=False)
            ctx.prompt_texts[i] = text
        return text

    def _logprobs(self, token_ids: list[int], top_logprobs: list[Optional[dict[int, Logprob]]],
                  initial_text_offset: int) -> CompletionLogProbs:
        """OpenAI's completions shape. Each position's dict holds the chosen token and the
        requested top-k (so up to k + 1 entries, as vLLM returns)."""
        tokens: list[str] = []
        token_logprobs: list[Optional[float]] = []
        tops: list[Optional[dict[str, float]]] = []
        offsets: list[int] = []
        offset = initial_text_offset
        for pos, tid in enumerate(token_ids):
            step = top_logprobs[pos] if pos < len(top_logprobs) else None
            if step is None:   # the first prompt token has no logprob
                token = self.token_str(tid, None)
                token_logprobs.append(None)
                tops.append(None)
            else:
                chosen = step.get(tid)
                token = self.token_str(tid, chosen)
                token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
                tops.append({self.token_str(t, lp): clamp_logprob(lp.logprob)
                             for t, lp in step.items()})
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        return CompletionLogProbs(text_offset=offsets, token_logprobs=token_logprobs,
                                  tokens=tokens, top_logprobs=tops)


class _StreamState:
    """Per-choice progress of a completion stream."""

    def __init__(self, num_choices: int, num_prompts: int) -> None:
        self.text_offsets = [0] * num_choices   # characters sent (logprobs text_offset)
        self.num_tokens = [0] * num_choices     # tokens generated
        self.echoed = [False] * num_choices
        self.prompt_logprobs: list[Optional[list]] = [None] * num_prompts


@dataclass
class _Context:
    """The per-request values both response shapes need."""
    request: CompletionRequest
    request_id: str
    model_name: str
    created: int
    engine_ids: list[str]
    prompt_texts: list[Optional[str]]
    prompt_ids: list[list[int]]

