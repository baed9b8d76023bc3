"""`kvserve chat`: a small terminal chat, streaming the reply as it is generated.

    kvserve chat --url http://localhost:8000/v1      # a running server (the `openai` client)
    kvserve chat /path/to/model [engine flags...]    # an engine in this process (AsyncLLM)

Type a message and press Enter; `/exit` (or `/quit`, or EOF: Ctrl-D) ends the session,
`/clear` forgets the conversation. `-q MESSAGE` sends one message and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

# reply(messages) -> the assistant's text, piece by piece.
ReplyFn = Callable[[list[dict[str, str]]], AsyncIterator[str]]
ReadLineFn = Callable[[str], Awaitable[str]]
WriteFn = Callable[[str], None]

EXIT_COMMANDS = ("/exit", "/quit")


async def _read_line(prompt: str) -> str:
    """input() in a daemon thread, so the event loop (and the engine) keeps going meanwhile,
    and Ctrl-C does not wait for a pending input() (asyncio.to_thread's pool would)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()

    def settle(value: Optional[str], error: Optional[BaseException]) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value or "")

    def read() -> None:
        try:
            line = input(prompt)
        except BaseException as e:   # EOFError on Ctrl-D
            loop.call_soon_threadsafe(settle, None, e)
            return
        loop.call_soon_threadsafe(settle, line, None)

    threading.Thread(target=read, daemon=True, name="kvserve-chat-input").start()
    return await future


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


async def _say(reply: ReplyFn, messages: list[dict[str, str]], write: WriteFn) -> str:
    pieces = []
    async for piece in reply(messages):
        pieces.append(piece)
        write(piece)
    write("\n")
    return "".join(pieces)


async def chat_loop(reply: ReplyFn, *, system_prompt: Optional[str] = None,
                    quick: Optional[str] = None, read_line: ReadLineFn = _read_line,
                    write: WriteFn = _write) -> list[dict[str, str]]:
    """Run the conversation; returns it (the messages, system prompt included)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    if quick is not None:
        messages.append({"role": "user", "content": quick})
        messages.append({"role": "assistant", "content": await _say(reply, messages, write)})
        return messages
    while True:
        try:
            line = await read_line("> ")
        except EOFError:
            write("\n")
            break
        text = line.strip()
        if text in EXIT_COMMANDS:
            break
        if text == "/clear":
            messages = list(system)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": await _say(reply, messages, write)})
    return messages


# ---------------------------------------------------------------------- backends
async def server_reply_fn(url: str, api_key: Optional[str], model_name: Optional[str],
                          max_tokens: Optional[int], temperature: Optional[float]) -> ReplyFn:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key or "EMPTY")
    if model_name is None:
        models = await client.models.list()
        if not models.data:
            raise ValueError(f"The server at {url} serves no model.")
        model_name = models.data[0].id
    extra: dict[str, Any] = {}
    if max_tokens is not None:
        extra["max_completion_tokens"] = max_tokens
    if temperature is not None:
        extra["temperature"] = temperature

    async def reply(messages: list[dict[str, str]]) -> AsyncIterator[str]:
        stream = await client.chat.completions.create(
            model=model_name, messages=messages, stream=True, **extra)  # type: ignore[arg-type]
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content

    return reply


def engine_reply_fn(engine: Any, max_tokens: Optional[int], temperature: Optional[float]) -> ReplyFn:
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    tokenizer = engine.tokenizer
    gen_cfg = engine.model_config.generation_config or {}
    params = SamplingParams(
        max_tokens=max_tokens,   # None: until the context is full
        temperature=temperature if temperature is not None else gen_cfg.get("temperature", 1.0),
        top_p=gen_cfg.get("top_p", 1.0), top_k=gen_cfg.get("top_k", 0),
        output_kind=RequestOutputKind.DELTA)

    async def reply(messages: list[dict[str, str]]) -> AsyncIterator[str]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes BOS itself.
        ids = tokenizer.encode(text, add_special_tokens=False)
        async for out in engine.generate({"prompt_token_ids": ids, "prompt": text}, params,
                                         f"chat-{uuid.uuid4().hex}"):
            if out.outputs and out.outputs[0].text:
                yield out.outputs[0].text

    return reply


async def _run(args: argparse.Namespace, read_line: ReadLineFn, write: WriteFn) -> None:
    kwargs = dict(system_prompt=args.system_prompt, quick=args.quick, read_line=read_line,
                  write=write)
    if args.url:
        reply = await server_reply_fn(args.url, args.api_key, args.model_name, args.max_tokens,
                                      args.temperature)
        await chat_loop(reply, **kwargs)
        return
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        await chat_loop(engine_reply_fn(engine, args.max_tokens, args.temperature), **kwargs)
    finally:
        engine.shutdown()


def run_chat(args: argparse.Namespace, read_line: ReadLineFn = _read_line,
             write: WriteFn = _write) -> int:
    if not args.url and not args.model:
        raise ValueError("kvserve chat needs a MODEL to load or --url of a running server.")
    if args.url and args.model:
        raise ValueError("Give either a MODEL or --url, not both.")
    try:
        asyncio.run(_run(args, read_line, write))
    except KeyboardInterrupt:
        write("\n")
    return 0
