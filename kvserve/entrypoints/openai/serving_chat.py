"""`POST /v1/chat/completions`: a conversation rendered with the chat template, then generated.

The template is the request's `chat_template`, else the server's `--chat-template`, else the
tokenizer's. A stream sends, per choice, a role delta first, then content deltas, then a
finish chunk (empty delta + finish_reason); with `stream_options.include_usage` a last chunk
carries the usage and no choices. This is the order OpenAI's API uses.

With `--reasoning-parser`, the text up to `</think>` is `reasoning_content` (a message field,
a delta field in streams), and structured outputs (forced tool calls included) constrain only
what follows it: the request's grammar waits in the engine for the `</think>` token id. Tool
calls are parsed out of the content after the reasoning. A stream and a whole response go
through the same parsers (`ChoiceParser`), so they say the same thing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from contextlib import aclosing
from typing import Any, AsyncGenerator, Optional, Union

from jinja2 import TemplateError

from kvserve.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                 ChatCompletionLogProbsContent,
                                                 ChatCompletionRequest, ChatCompletionResponse,
                                                 ChatCompletionResponseChoice,
                                                 ChatCompletionResponseStreamChoice,
                                                 ChatCompletionStreamResponse, ChatMessage,
                                                 DeltaMessage, UsageInfo)
from kvserve.entrypoints.openai.reasoning_parsers import (ReasoningParser, ReasoningStreamer,
                                                          get_reasoning_parser)
from kvserve.entrypoints.openai.serving_engine import (DisconnectCheck, LoadTracker, OpenAIServing,
                                                       RequestTracker,
                                                       ServingError, StreamingResult,
                                                       clamp_logprob, large_messages, now,
                                                       raise_if_failed, sse, to_serving_error)
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.tool_calls import named_tool
from kvserve.entrypoints.openai.tool_parsers import (NamedToolParser, RequiredToolParser,
                                                     ToolCallStreamer, ToolParser,
                                                     collect_calls, get_tool_parser)
from kvserve.entrypoints.beam_search import beam_search_stream
from kvserve.outputs import Logprob, RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams
from kvserve.tokenizer import Tokenizer


def load_chat_template(chat_template: Optional[str]) -> Optional[str]:
    """`--chat-template`: a file path or the template itself (vLLM accepts both)."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(c in chat_template for c in "{}\n"):
        return chat_template          # looks like a Jinja template
    raise ValueError(f"--chat-template {chat_template!r} is neither an existing file nor a "
                     f"Jinja template string.")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content parts ([{"type": "text", "text": ...}, ...]) become one string, joined
    with newlines as vLLM does; anything but text is refused (no multimodal inputs here)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ServingError(f"messages[{i}]: content part of type {kind!r} is not "
                                       f"supported; only 'text' parts are.", param="messages")
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ServingError(f"messages[{i}].content must be a string or a list of content "
                               f"parts, got {type(content).__name__}.", param="messages")
        out.append(m)
    return out


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, chat_template: Optional[str],
                add_generation_prompt: bool, continue_final_message: bool,
                tools: Optional[list] = None, documents: Optional[list] = None,
                chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            tokenize=False, continue_final_message=continue_final_message, tools=tools,
            documents=documents, **(chat_template_kwargs or {}))
    # TypeError: kwargs that clash with ours; the others: a template that fails on this input
    # (the Jinja sandbox raises OverflowError for ranges over its limit).
    except (ValueError, TypeError, OverflowError, RecursionError, TemplateError) as e:
        raise ServingError(str(e) or type(e).__name__, param="messages") from e
    assert isinstance(text, str)
    return text


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def __init__(self, engine_client: Any, models: OpenAIServingModels, load: LoadTracker,
                 default_sampling_params: Optional[dict[str, Any]] = None,
                 chat_template: Optional[str] = None, response_role: str = "assistant",
                 enable_auto_tools: bool = False, tool_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None) -> None:
        super().__init__(engine_client, models, load, default_sampling_params)
        self.chat_template = chat_template
        self.response_role = response_role
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = tool_parser
        if tool_parser is not None:
            get_tool_parser(tool_parser)         # an unknown name fails at start
        # Raises (at start) when the tokenizer lacks the parser's <think> / </think> tokens.
        self.reasoning_parser: Optional[ReasoningParser] = (
            get_reasoning_parser(reasoning_parser)(self.tokenizer) if reasoning_parser else None)

    def _tool_mode(self, request: ChatCompletionRequest) -> Optional[str]:
        """How this request's tool calls are produced: "named", "required", "auto" or None."""
        choice = request.tool_choice
        if named_tool(choice) is not None:
            return "named"
        if choice == "required":
            return "required"
        if choice == "auto" and request.tools:
            if not (self.enable_auto_tools and self.tool_parser):
                raise ServingError('"auto" tool choice requires --enable-auto-tool-choice and '
                                   '--tool-call-parser to be set', param="tool_choice")
            return "auto"
        return None

    def _tool_parser(self, request: ChatCompletionRequest, mode: Optional[str]) -> Optional[ToolParser]:
        if mode == "named":
            return NamedToolParser(str(named_tool(request.tool_choice)))
        if mode == "required":
            return RequiredToolParser()
        if mode == "auto":
            return get_tool_parser(str(self.tool_parser))(request.tools)
        return None

    def _reasons(self, request: ChatCompletionRequest, prompt_ids: list[int]) -> bool:
        """Whether this request's output starts inside the reasoning (the template may have
        closed it in the prompt, or the request turned thinking off)."""
        parser = self.reasoning_parser
        return (parser is not None and parser.thinks(request.chat_template_kwargs)
                and not parser.is_reasoning_end(prompt_ids))

    def choice_parser(self, ctx: "_ChatContext") -> "ChoiceParser":
        request = ctx.request
        tools = self._tool_parser(request, ctx.tool_mode)
        return ChoiceParser(
            ReasoningStreamer(self.reasoning_parser)
            if ctx.reasons and self.reasoning_parser is not None else None,
            ToolCallStreamer(tools.parse, tools.make_id,
                             max_calls=1 if request.parallel_tool_calls is False else None)
            if tools is not None else None, ctx.tool_mode)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Any = None
                                     ) -> Union[ChatCompletionResponse, StreamingResult]:
        ctx, generator, tracker = await self.start_chat(request, raw_request)
        if request.stream:
            return StreamingResult(self._stream(ctx, generator, tracker, raw_request), tracker)
        final = await self.final_output(ctx, generator, tracker)
        return self._full_response(ctx, final)

    async def start_chat(self, request: ChatCompletionRequest, raw_request: Any = None
                   ) -> tuple["_ChatContext", Any, RequestTracker]:
        """Render, check and submit a chat request: its context, the engine's output stream
        and the tracker that aborts it (the Responses API starts its requests here too)."""
        self.check_model(request.model)
        self.check_engine()
        request_id = self.make_request_id(request, raw_request)
        tool_mode = self._tool_mode(request)
        self.check_num_sequences(request.n, 1)
        self.check_request_chat_template(request.chat_template)
        messages = normalize_messages(request.messages)
        text = await self.run_maybe_in_thread(
            large_messages(messages), render_chat,
            self.tokenizer, messages, chat_template=request.chat_template or self.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tools=request.tools,
            documents=request.documents, chat_template_kwargs=request.chat_template_kwargs)
        # The template writes BOS itself: no special tokens unless asked for.
        truncating = request.truncate_prompt_tokens is not None
        ids = self.truncate(await self.encode(text, request.add_special_tokens, "messages",
                                              truncating), request.truncate_prompt_tokens)
        default_max_tokens = self.check_length(len(ids), request.requested_max_tokens(), "messages")
        beam: Optional[BeamSearchParams] = None
        if request.use_beam_search:     # n beams, one final output (entrypoints/beam_search.py)
            if tool_mode in ("named", "required"):
                raise ServingError(f"use_beam_search does not support tool_choice={tool_mode}.",
                                   param="tool_choice")
            beam = self.beam_search_params(request, request.n,
                                           request.requested_max_tokens() or default_max_tokens)
            params = SamplingParams(max_tokens=1)   # only read for the parser settings below
        else:
            params = self.sampling_params(request, default_max_tokens)
        reasons = self._reasons(request, ids)
        if reasons and params.structured_outputs is not None:
            assert self.reasoning_parser is not None
            # The grammar starts after the reasoning (the engine waits for this token).
            params.structured_outputs.reasoning_end_token_id = self.reasoning_parser.end_token_id
        if tool_mode == "auto" and get_tool_parser(str(self.tool_parser)).needs_special_tokens:
            params.skip_special_tokens = False   # its markers are special tokens

        role = self.response_role if request.add_generation_prompt else messages[-1]["role"]
        echo_text = ""
        if request.echo and messages[-1].get("role") == role:
            echo_text = messages[-1].get("content") or ""
        tracker = RequestTracker(self.engine_client, self.load.admit(request.n), [request_id])
        lora = self.models.lora_request(request.model)
        if beam is not None:
            generator = beam_search_stream(self.engine_client, ids, beam, request_id, request.n,
                                           cache_salt=request.cache_salt, priority=request.priority,
                                           lora_request=lora)
        else:
            generator = self.engine_client.generate(
                {"prompt_token_ids": ids, "prompt": text}, params, request_id,
                priority=request.priority, cache_salt=request.cache_salt, lora_request=lora)
        ctx = _ChatContext(request, request_id, self.models.response_model_name(request.model),
                           now(), role, echo_text, ids, tool_mode, reasons)
        return ctx, generator, tracker

    @staticmethod
    async def final_output(ctx: "_ChatContext", generator: Any, tracker: RequestTracker
                           ) -> RequestOutput:
        final: Optional[RequestOutput] = None
        try:
            async with aclosing(generator) as stream:
                async for res in stream:
                    final = res
            if final is not None and final.finished:
                tracker.finished(ctx.request_id)
        except Exception as e:
            raise to_serving_error(e) from e
        finally:
            tracker.close()
        assert final is not None, "the request finished without output"
        raise_if_failed(final.outputs)
        return final

    # ------------------------------------------------------------------ whole response
    def _full_response(self, ctx: "_ChatContext", res: RequestOutput) -> ChatCompletionResponse:
        request = ctx.request
        choices = []
        num_generated = 0
        for out in res.outputs:
            num_generated += len(out.token_ids)
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = self._logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            parser = self.choice_parser(ctx)
            delta, finish_reason = parser.feed(out.text, out.finish_reason, final=True)
            content: Optional[str] = ctx.echo_text + (delta.content or "")
            if parser.parses and not content:
                content = None                      # the reasoning or the calls are all
            message = ChatMessage(role=ctx.role, content=content,
                                  reasoning_content=delta.reasoning_content,
                                  tool_calls=collect_calls(delta.tool_calls or []))
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=message,
                logprobs=logprobs, finish_reason=finish_reason, stop_reason=out.stop_reason,
                token_ids=out.token_ids if request.return_token_ids else None))
        num_prompt = len(res.prompt_token_ids)
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model_name, choices=choices,
            usage=UsageInfo.of(num_prompt, num_generated),
            prompt_token_ids=res.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=res.kv_transfer_params)

    # ------------------------------------------------------------------ stream
    async def _stream(self, ctx: "_ChatContext", generator: Any, tracker: RequestTracker,
                      raw_request: Any) -> AsyncGenerator[str, None]:
        request, n = ctx.request, ctx.request.n
        num_tokens = [0] * n
        num_prompt = len(ctx.prompt_ids)
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = include_usage and bool(opts and opts.continuous_usage_stats)

        def chunk(index: int, delta: DeltaMessage, logprobs: Optional[ChatCompletionLogProbs] = None,
                  finish_reason: Optional[str] = None, stop_reason: Any = None,
                  token_ids: Optional[list[int]] = None) -> str:
            choice = ChatCompletionResponseStreamChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            if stop_reason is not None:
                choice.stop_reason = stop_reason
            if token_ids is not None:
                choice.token_ids = token_ids
            resp = ChatCompletionStreamResponse(id=ctx.request_id, object="chat.completion.chunk",
                                                created=ctx.created, model=ctx.model_name,
                                                choices=[choice])
            if continuous_usage:
                resp.usage = UsageInfo.of(num_prompt, sum(num_tokens))
            return sse(resp.model_dump_json(exclude_unset=True))

        parsers = [self.choice_parser(ctx) for _ in range(n)]
        for j in range(n):
            yield chunk(j, DeltaMessage(role=ctx.role, content=""))
            if ctx.echo_text:
                yield chunk(j, DeltaMessage(content=ctx.echo_text))
        left = DisconnectCheck(raw_request)
        async with aclosing(generator) as stream:
            async for res in stream:
                if await left():
                    return   # `finally` aborts the request
                if res.finished:
                    tracker.finished(ctx.request_id)
                for out in res.outputs:
                    j = out.index
                    num_tokens[j] += len(out.token_ids)
                    logprobs = None
                    if request.logprobs and out.logprobs:
                        logprobs = self._logprobs(out.token_ids, out.logprobs,
                                                  request.top_logprobs or 0)
                    delta, finish_reason = parsers[j].feed(out.text, out.finish_reason)
                    if (delta.content or delta.reasoning_content or delta.tool_calls
                            or logprobs is not None):
                        yield chunk(j, delta, logprobs,
                                    token_ids=out.token_ids if request.return_token_ids else None)
                    if finish_reason is not None:
                        yield chunk(j, DeltaMessage(), finish_reason=finish_reason,
                                    stop_reason=out.stop_reason)
        if include_usage:
            total = sum(num_tokens)
            resp = ChatCompletionStreamResponse(
                id=ctx.request_id, object="chat.completion.chunk", created=ctx.created,
                model=ctx.model_name, choices=[],
                usage=UsageInfo.of(num_prompt, total))
            yield sse(resp.model_dump_json(exclude_unset=True))

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids: list[int], top_logprobs: list[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
        """OpenAI's chat shape: per token its logprob and bytes, and the `num_top` most likely
        tokens by rank (the chosen one is among them only if it ranks there)."""
        content = []
        for tid, step in zip(token_ids, top_logprobs):
            chosen = step.get(tid)
            token = self.token_str(tid, chosen)
            tops = []
            if num_top:
                ranked = sorted((lp.rank, t, lp) for t, lp in step.items()
                                if lp.rank is not None and 1 <= lp.rank <= num_top)
                for _, t, lp in ranked:
                    s = self.token_str(t, lp)
                    tops.append(ChatCompletionLogProb(token=s, logprob=clamp_logprob(lp.logprob),
                                                      bytes=list(s.encode("utf-8", "replace"))))
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=clamp_logprob(chosen.logprob) if chosen is not None else -9999.0,
                bytes=list(token.encode("utf-8", "replace")), top_logprobs=tops))
        return ChatCompletionLogProbs(content=content)


class ChoiceParser:
    """One choice's text, delta by delta: reasoning first, then tool calls in the content.
    The whole response feeds its text once; a stream feeds each delta."""

    def __init__(self, reasoning: Optional[ReasoningStreamer], tools: Optional[ToolCallStreamer],
                 tool_mode: Optional[str]) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.tool_mode = tool_mode

    @property
    def parses(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str, finish_reason: Optional[str], final: bool = False
             ) -> tuple[DeltaMessage, Optional[str]]:
        final = final or finish_reason is not None
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            # vLLM's: parsed calls finish with "tool_calls", a named call with "stop".
            if finish_reason == "stop" and self.tools.num_calls and self.tool_mode != "named":
                finish_reason = "tool_calls"
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                            tool_calls=calls or None), finish_reason


@dataclass
class _ChatContext:
    request: ChatCompletionRequest
    request_id: str
    model_name: str
    created: int
    role: str
    echo_text: str
    prompt_ids: list[int]
    tool_mode: Optional[str] = None
    reasons: bool = False         # the output starts inside the reasoning
