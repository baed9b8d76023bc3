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
from kvserve.entrypoints.openai.serving_engine import (DisconnectCheck, OpenAIServing, RequestTracker,
                                                       StreamingResult, clamp_logprob,
                                                       merge_async_iterators, now, raise_if_failed,
                                                       sse, to_serving_error)
from kvserve.entrypoints.beam_search import BeamSearchSequence, beam_search_async
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
        beam_max_tokens = self.max_model_len
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
            if request.use_beam_search:
                beam_max_tokens = min(beam_max_tokens, default_max_tokens)
            else:
                params.append(self.sampling_params(request, default_max_tokens))
            prompt_texts.append(text)
            prompt_ids.append(ids)
        if request.use_beam_search:
            max_tokens = request.max_tokens if request.max_tokens is not None else beam_max_tokens
            ctx = _Context(request, request_id, self.models.response_model_name(request.model),
                           now(), [], prompt_texts, prompt_ids)
            return await self._beam_search(ctx, max_tokens)

        engine_ids = [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        tracker = RequestTracker(self.engine_client,
                                 self.load.admit(request.n * len(prompt_ids)), engine_ids)
        generators = [
            self.engine_client.generate(
                {"prompt_token_ids": ids, **({"prompt": text} if text is not None else {})},
                sp, rid, priority=request.priority, cache_salt=request.cache_salt,
                lora_request=self.models.lora_request(request.model))
            for ids, text, sp, rid in zip(prompt_ids, prompt_texts, params, engine_ids)]
        ctx = _Context(request, request_id, self.models.response_model_name(request.model), now(), engine_ids,
                       prompt_texts, prompt_ids)
        if request.stream:
            return StreamingResult(self._stream(ctx, generators, tracker, raw_request), tracker)
        final: list[Optional[RequestOutput]] = await tracker.collect(generators, engine_ids)
        for res in final:
            raise_if_failed(res.outputs if res is not None else ())
        return self._full_response(ctx, final)

    # ------------------------------------------------------------------ beam search
    async def _beam_search(self, ctx: "_Context", max_tokens: int) -> CompletionResponse:
        """`use_beam_search`: best_of (default n) beams per prompt, the best n returned, best
        first; choice j of prompt i has index i * n + j."""
        request, n = ctx.request, ctx.request.n
        beam_width = request.best_of or n
        params = self.beam_search_params(request, beam_width, max_tokens)
        self.check_num_sequences(beam_width, len(ctx.prompt_ids))
        admission = self.load.admit(beam_width * len(ctx.prompt_ids))
        try:
            results = await beam_search_async(
                self.engine_client, ctx.prompt_ids, params, ctx.request_id,
                cache_salt=request.cache_salt, priority=request.priority,
                lora_request=self.models.lora_request(request.model))
        except Exception as e:
            raise to_serving_error(e) from e
        finally:
            admission.release()
        choices: list[CompletionResponseChoice] = []
        num_generated = 0
        for i, result in enumerate(results):
            for j, beam in enumerate(result.sequences[:n]):
                choices.append(self._beam_choice(ctx, i, i * n + j, beam))
                num_generated += len(beam.output_token_ids)
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name, choices=choices,
            usage=UsageInfo.of(sum(len(ids) for ids in ctx.prompt_ids), num_generated))

    def _beam_choice(self, ctx: "_Context", i: int, index: int,
                     beam: BeamSearchSequence) -> CompletionResponseChoice:
        request = ctx.request
        token_ids = beam.output_token_ids
        text = beam.text or ""
        lps: list[Optional[dict[int, Logprob]]] = [
            _top_logprobs(step, tok, request.logprobs or 0)
            for step, tok in zip(beam.logprobs, token_ids)]
        if request.echo:
            text = self._prompt_text(ctx, i) + text
            lps = [None] * len(ctx.prompt_ids[i]) + lps
            token_ids = ctx.prompt_ids[i] + token_ids
        logprobs = self._logprobs(token_ids, lps, 0) if request.logprobs is not None else None
        return CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason,
            prompt_token_ids=ctx.prompt_ids[i] if request.return_token_ids else None,
            token_ids=beam.output_token_ids if request.return_token_ids else None)

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
        left = DisconnectCheck(raw_request)
        async with aclosing(merge_async_iterators(*generators)) as stream:
            async for i, res in stream:
                if await left():
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


def _top_logprobs(step: dict[int, Logprob], chosen: int, k: int) -> dict[int, Logprob]:
    """A beam step's candidates cut to the k most likely, plus the chosen token (the shape
    plain requests return)."""
    ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:k]
    out = dict(ranked)
    out[chosen] = step[chosen]
    return out


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

