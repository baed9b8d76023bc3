"""The `kvserve` command: generate | serve | chat | bench."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from kvserve.engine.arg_utils import EngineArgs


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate text for one or more prompts (offline).")
    gen.add_argument("--prompt", action="append", help="Prompt text (repeatable).")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
