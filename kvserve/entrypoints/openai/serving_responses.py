"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it), `GET /v1/responses/{id}`.

A Responses request is a chat in another shape: `instructions` + `input` (a string, or items:
messages with text parts, earlier `function_call`s and their `function_call_output`s) become
chat messages, flat function tools become chat tools, `text.format` becomes response_format,
and the chat handler renders, checks and submits it (its parsers included: `reasoning`,
`message` and `function_call` output items come from the same ChoiceParser as chat's
reasoning_content / content / tool_calls).

`previous_response_id` continues a stored response: its conversation (input and output) comes
before the new input. Responses are stored (`store`, default true) in memory, at most
`MAX_STORED_RESPONSES`, the oldest dropped first (vLLM's store has no bound).

A stream sends OpenAI's events: response.created, response.in_progress, then per output item
output_item.added, its deltas (reasoning_text.delta / output_text.delta with content_part
added and done around them / function_call_arguments.delta), their done events,
output_item.done, and last response.completed with the whole response.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from contextlib import aclosing
from http import HTTPStatus
from typing import Any, AsyncGenerator, Optional, Union

from kvserve.entrypoints.openai.protocol import (ChatCompletionRequest, ResponsesRequest,
                                                 random_uuid)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_engine import (DisconnectCheck, RequestTracker, ServingError,
                                                       StreamingResult, sse)
from kvserve.entrypoints.openai.tool_parsers import collect_calls

MAX_STORED_RESPONSES = 1000


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                      "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ServingError(f"{where}: content part of type {kind!r} is not supported; "
                                   f"only text parts are.", param="input")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ServingError(f"{where}: content must be a string or a list of parts.", param="input")


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if "role" not in item:
                raise ServingError(f"input[{i}] has no 'role'.", param="input")
            messages.append({"role": item["role"],
                             "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":         # earlier reasoning is not sent back to the model
            raise ServingError(f"input[{i}]: item type {kind!r} is not supported.", param="input")
    return messages


def _chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not tool.get("name"):
            raise ServingError(f"tools[{i}]: only function tools ({{'type': 'function', 'name': "
                               f"...}}) are supported, got type {tool.get('type')!r}.",
                               param="tools")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"),
                                                       "schema": fmt.get("schema")}}
    return {"type": fmt.get("type", "text")}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{random_uuid()}"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        # id -> (response body, the conversation after it as chat messages)
        self.store: "OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]]" = OrderedDict()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.store:
            raise ServingError(f"Response with id '{response_id}' not found.",
                               HTTPStatus.NOT_FOUND, param="response_id", err_type="NotFoundError")
        return self.store[response_id][0]

    def retrieve_json(self, response_id: str) -> "_JSON":
        return _JSON(self.retrieve(response_id))

    def _chat_request(self, request: ResponsesRequest) -> tuple[ChatCompletionRequest,
                                                                list[dict[str, Any]]]:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            self.retrieve(request.previous_response_id)
            history = list(self.store[request.previous_response_id][1])
        messages = history + input_messages(request.input)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        extra = {k: getattr(request, k) for k in ("top_k", "min_p", "repetition_penalty", "seed",
                                                  "stop", "request_id", "priority")
                 if getattr(request, k) is not None}
        try:
            chat = ChatCompletionRequest(
                model=request.model, messages=system + messages, stream=request.stream,
                max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
                top_p=request.top_p, tools=_chat_tools(request.tools),
                tool_choice=_chat_tool_choice(request.tool_choice),
                parallel_tool_calls=request.parallel_tool_calls,
                response_format=_response_format(request.text), **extra)
        except ValueError as e:       # pydantic's, on the converted fields
            raise ServingError(str(e)) from e
        return chat, messages

    async def create_response(self, request: ResponsesRequest, raw_request: Any = None
                              ) -> Union[Any, StreamingResult]:
        chat_request, messages = self._chat_request(request)
        ctx, generator, tracker = await self.chat.start_chat(chat_request, raw_request)
        response_id = f"resp_{random_uuid()}"
        base = self._base(request, response_id, ctx.model_name)
        if request.stream:
            return StreamingResult(self._stream(request, base, messages, ctx, generator, tracker,
                                                raw_request), tracker, done=False)
        final = await self.chat.final_output(ctx, generator, tracker)
        out = final.outputs[0]
        delta, finish = self.chat.choice_parser(ctx).feed(out.text, out.finish_reason, final=True)
        items = []
        if delta.reasoning_content:
            items.append(self._reasoning_item(_item_id("rs"), delta.reasoning_content))
        if delta.content:
            items.append(self._message_item(_item_id("msg"), delta.content))
        items += [self._call_item(c) for c in collect_calls(delta.tool_calls or [])]
        body = self._finish(request, base, messages, items, finish,
                            len(final.prompt_token_ids), len(out.token_ids))
        return _JSON(body)

    # ------------------------------------------------------------------ shapes
    @staticmethod
    def _base(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": model, "status": "in_progress", "output": [], "error": None,
                "incomplete_details": None, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens,
                "previous_response_id": request.previous_response_id,
                "temperature": request.temperature, "top_p": request.top_p,
                "tools": request.tools or [], "tool_choice": request.tool_choice,
                "parallel_tool_calls": request.parallel_tool_calls, "store": request.store,
                "text": request.text or {"format": {"type": "text"}},
                "metadata": request.metadata, "truncation": "disabled", "usage": None}

    @staticmethod
    def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    @staticmethod
    def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": content if status == "completed" else []}

    @staticmethod
    def _call_item(call: dict[str, Any], item_id: Optional[str] = None,
                   status: str = "completed") -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": item_id or _item_id("fc"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn.get("arguments", ""), "status": status}

    def _finish(self, request: ResponsesRequest, body: dict[str, Any],
                messages: list[dict[str, Any]], items: list[dict[str, Any]],
                finish_reason: Optional[str], num_prompt: int, num_output: int) -> dict[str, Any]:
        """The completed response (stored when asked) from its output items."""
        body = {**body, "output": items, "status": "completed"}
        if finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {"input_tokens": num_prompt, "output_tokens": num_output,
                         "total_tokens": num_prompt + num_output,
                         "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}}
        if request.store:
            self.store[body["id"]] = (body, messages + _as_messages(items))
            while len(self.store) > MAX_STORED_RESPONSES:
                self.store.popitem(last=False)
        return body

    # ------------------------------------------------------------------ stream
    async def _stream(self, request: ResponsesRequest, base: dict[str, Any],
                      messages: list[dict[str, Any]], ctx: Any, generator: Any,
                      tracker: RequestTracker, raw_request: Any) -> AsyncGenerator[str, None]:
        events = _EventWriter(base)
        parser = self.chat.choice_parser(ctx)
        num_prompt, num_output, finish = len(ctx.prompt_ids), 0, None
        yield events.event("response.created", response=base)
        yield events.event("response.in_progress", response=base)
        left = DisconnectCheck(raw_request)
        async with aclosing(generator) as stream:
            async for res in stream:
                if await left():
                    return
                if res.finished:
                    tracker.finished(ctx.request_id)
                out = res.outputs[0]
                num_output += len(out.token_ids)
                delta, finish = parser.feed(out.text, out.finish_reason)
                for chunk in events.deltas(delta):
                    yield chunk
        for chunk in events.close_item():
            yield chunk
        body = self._finish(request, base, messages, events.items, finish, num_prompt,
                            num_output)
        yield events.event("response.completed", response=body)


class _EventWriter:
    """The Responses stream's events, one output item open at a time."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[str] = None          # "reasoning" | "message" | call index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(json.dumps(payload, ensure_ascii=False))

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def deltas(self, delta: Any) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            out += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            out += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            key = f"call{call['index']}"
            if self.open != key:
                out += self.close_item()
                self.open = key
                item = OpenAIServingResponses._call_item(
                    {"id": call["id"], "function": {"name": call["function"]["name"]}},
                    status="in_progress")
                self.items.append(item)
                out.append(self.event("response.output_item.added",
                                      output_index=len(self.items) - 1, item=dict(item)))
            args = call["function"].get("arguments", "")
            if args:
                self.items[-1]["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", delta=args,
                                      **self._where()))
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open != kind:
            out += self.close_item()
            self.open = kind
            if kind == "reasoning":
                item = OpenAIServingResponses._reasoning_item(_item_id("rs"), "")
            else:
                item = OpenAIServingResponses._message_item(_item_id("msg"), "", "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=json.loads(json.dumps(item))))
            if kind == "message":
                item["content"] = [{"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}]
                out.append(self.event("response.content_part.added", content_index=0,
                                      part=dict(item["content"][0]), **self._where()))
        part = self.items[-1]["content"][0]
        part["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(f"response.{name}.delta", content_index=0, delta=text,
                              **self._where(), **extra))
        return out

    def close_item(self) -> list[str]:
        if self.open is None:
            return []
        item, where, out = self.items[-1], self._where(), []
        if self.open in ("reasoning", "message"):
            part = item["content"][0]
            name = "reasoning_text" if self.open == "reasoning" else "output_text"
            extra = {"logprobs": []} if self.open == "message" else {}
            out.append(self.event(f"response.{name}.done", content_index=0, text=part["text"],
                                  **where, **extra))
            if self.open == "message":
                out.append(self.event("response.content_part.done", content_index=0,
                                      part=dict(part), **where))
        else:
            out.append(self.event("response.function_call_arguments.done",
                                  arguments=item["arguments"], name=item["name"], **where))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=item))
        self.open = None
        return out


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue the conversation."""
    return input_messages([item for item in items if item["type"] in ("message", "function_call")])


class _JSON:
    """A finished body for the app's `_handle` (which writes `model_dump_json()`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def model_dump_json(self) -> str:
        return json.dumps(self.body, ensure_ascii=False)
