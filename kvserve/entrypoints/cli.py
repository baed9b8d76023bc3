"""`kvserve generate | serve | chat | proxy`. The `kvserve` command (kvserve/__main__.py) adds
`bench` (kvserve/benchmarks/cli.py), which sits above this package: its benchmarks drive `LLM`
and the server, so this module does not import them."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional, Sequence

from kvserve import envs
from kvserve.engine.arg_utils import EngineArgs, run_command
from kvserve.entrypoints.openai.reasoning_parsers import reasoning_parser_names
from kvserve.entrypoints.openai.tool_parsers import tool_parser_names


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    engine_args = EngineArgs.from_cli_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, n=args.n, seed=args.sampling_seed, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    prompts = args.prompt or ["Hello, my name is"]
    llm = LLM(**vars(engine_args))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outputs:
        print(f"Prompt: {out.prompt!r}")
        for c in out.outputs:
            print(f"  [{c.index}] {c.text!r}  (finish_reason={c.finish_reason}, tokens={len(c.token_ids)})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.utils.memory import configure_process_memory
    configure_process_memory("API server")

    if args.headless:       # engines only: they serve the front node's API server
        from kvserve.engine.launch import run_headless
        if not args.data_parallel_address:
            raise ValueError("--headless needs --data-parallel-address: the front node's "
                             "address (where `kvserve serve` without --headless runs).")
        return run_headless(EngineArgs.from_cli_args(args).create_engine_config())
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}.")
    if args.api_server_count > 1:
        from kvserve.entrypoints.openai.multi_server import run_api_servers
        return run_api_servers(args)
    from kvserve.entrypoints.openai.api_server import run_server
    try:
        return asyncio.run(run_server(args))
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it handled, after shutting down
        return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`kvserve serve` flags (vLLM's names), then every engine flag."""
    parser.add_argument("model", help="Path to a Hugging Face checkpoint directory or .gguf file, "
                                      "or 'demo' / 'demo-random'.")
    g = parser.add_argument_group("server")
    g.add_argument("--host", type=str, default=None,
                   help="Address to listen on (default: all interfaces).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument("--api-key", type=str, default=envs.get("KVSERVE_API_KEY"),
                   help="Require 'Authorization: Bearer <key>' on /v1/* (default: "
                        f"$KVSERVE_API_KEY, {'' if envs.is_set('KVSERVE_API_KEY') else 'not '}"
                        "set; the key itself is not shown).")
    g.add_argument("--chat-template", type=str, default=None,
                   help="Chat template: a file path or the Jinja template itself "
                        "(default: the tokenizer's).")
    g.add_argument("--lora-modules", type=str, nargs="+", default=None,
                   help="LoRA adapters served as models (with --enable-lora): name=path or JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'.")
    g.add_argument("--response-role", type=str, default="assistant",
                   help="Role of the generated message when add_generation_prompt is true.")
    g.add_argument("--root-path", type=str, default=None,
                   help="ASGI root path, when the server runs behind a path-based proxy.")
    g.add_argument("--uvicorn-log-level", type=str, default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="Do not log every HTTP request.")
    g.add_argument("--keep-alive-on-engine-death", action="store_true",
                   default=envs.get("KVSERVE_KEEP_ALIVE_ON_ENGINE_DEATH"),
                   help="When the engine core dies, keep the server up answering 503 instead of "
                        "exiting with status 1 so that an orchestrator restarts it; with data "
                        "parallelism, when one engine dies the others keep serving and /health "
                        "answers 503 (default: "
                        "%(default)s, from KVSERVE_KEEP_ALIVE_ON_ENGINE_DEATH, like vLLM's "
                        "variable).")
    g.add_argument("--log-stats-interval", type=float, default=5.0,
                   help="Seconds between throughput log lines (default: 5).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let the model call tools on its own (tool_choice='auto'); needs "
                        "--tool-call-parser.")
    g.add_argument("--tool-call-parser", type=str, default=None, choices=tool_parser_names(),
                   help="How tool calls are written in the model's text (vLLM's names): hermes "
                        "(<tool_call>{...}</tool_call>), llama3_json ({\"name\", "
                        "\"parameters\"}), mistral ([TOOL_CALLS][...]), pythonic "
                        "([f(a=1)]), qwen3_coder (<tool_call><function=f>...).")
    g.add_argument("--reasoning-parser", type=str, default=None,
                   choices=reasoning_parser_names(),
                   help="Return the model's <think>...</think> reasoning as reasoning_content "
                        "(vLLM's names); structured outputs apply after the reasoning.")
    lim = parser.add_argument_group("request limits")
    lim.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                     help="Request bodies larger than this get 413 without being read "
                          "(default: 16 MiB; 0: no limit).")
    lim.add_argument("--limit-concurrency", type=int, default=0,
                     help="Open connections and requests at once before new requests get 503 "
                          "(uvicorn's limit, idle connections included; default: 0, no limit: "
                          "connections that send no complete request within 5 s are closed).")
    lim.add_argument("--max-n-sequences", type=int, default=1024,
                     help="Most sequences one request may ask for: n times the number of "
                          "prompts (vLLM's VLLM_MAX_N_SEQUENCES; default: 1024).")
    lim.add_argument("--trust-request-chat-template", action="store_true",
                     help="Accept a chat_template in requests (a request's Jinja template runs "
                          "in the server; off by default, as in vLLM).")
    g.add_argument("--headless", action="store_true",
                   help="Run this node's data-parallel engines only (no API server); they "
                        "connect to the front node at --data-parallel-address / "
                        "--data-parallel-rpc-port.")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes sharing the port, each with its own client to "
                        "the engine(s) (default: 1).")
    EngineArgs.add_cli_args(parser, skip=("model",))
    # A server logs throughput and exports metrics unless told not to.
    parser.set_defaults(disable_log_stats=False)


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.chat import run_chat
    return run_chat(args)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Model to load in this process (omit with --url).")
    g = parser.add_argument_group("chat")
    g.add_argument("--url", type=str, default=None,
                   help="Base URL of a running server, e.g. http://localhost:8000/v1.")
    g.add_argument("--model-name", type=str, default=None,
                   help="Model name to ask the server for (default: its first model).")
    g.add_argument("--api-key", type=str, default=None, help="API key for --url.")
    g.add_argument("--system-prompt", type=str, default=None)
    g.add_argument("-q", "--quick", type=str, default=None, metavar="MESSAGE",
                   help="Send one message, print the reply and exit.")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    EngineArgs.add_cli_args(parser, skip=("model",))


def make_parser(more_subcommands: Sequence[Callable[[Any], Any]] = ()
                ) -> argparse.ArgumentParser:
    """This module's subcommands, then each of `more_subcommands(subparsers)` (`bench`)."""
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate text for one or more prompts (offline).")
    gen.add_argument("--prompt", action="append", help="Prompt text (repeatable).")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server.")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    chat = sub.add_parser("chat", help="Chat in the terminal with a server (--url) or a model.")
    add_chat_args(chat)
    chat.set_defaults(func=cmd_chat)
    proxy = sub.add_parser("proxy", help="Front a prefill and a decode instance "
                                         "(disaggregated prefill/decode).")
    from kvserve.entrypoints.proxy import add_proxy_args, run_proxy
    add_proxy_args(proxy)
    proxy.set_defaults(func=run_proxy)
    for add in more_subcommands:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(make_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
