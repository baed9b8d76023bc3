"""`kvserve bench <mode>`: the benchmark subcommands (latency, throughput; serve and sweep to come).

`add_bench_subparsers(subparsers)` adds `bench` to the `kvserve` command's subparsers; each
mode registers its flags through its module's `add_cli_args` and runs through its `main`.
`python -m kvserve.benchmarks.cli latency ...` runs a mode without the `kvserve` command.
The benchmarks drive `LLM` and the server, so this package sits above kvserve.entrypoints and
never the other way round (kvserve/__main__.py joins the two into one command).
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Any, Optional

from kvserve.benchmarks import latency, serve, sweep, throughput
from kvserve.engine.arg_utils import run_command

# (name, module with add_cli_args(parser) and main(args) -> exit code, help)
BENCH_MODES: tuple[tuple[str, ModuleType, str], ...] = (
    ("latency", latency, "Latency of one fixed batch (avg, std, percentiles)."),
    ("throughput", throughput,
     "Offline throughput with all prompts submitted at once (kvserve or hf backend)."),
    ("serve", serve,
     "Online serving benchmark against a running OpenAI-compatible server (TTFT, TPOT, ITL)."),
    ("sweep", sweep, "bench serve at several request rates; latency vs throughput plot."),
)


def add_bench_subparsers(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench latency` and `bench throughput` under `subparsers` (the object
    `ArgumentParser.add_subparsers()` returned); the parsed args' `func(args)` runs the mode."""
    bench = subparsers.add_parser("bench", help="Benchmark kvserve (latency, throughput).",
                                  description="Benchmark kvserve with vLLM's benchmark modes.")
    modes = bench.add_subparsers(dest="bench_command", required=True, metavar="MODE")
    for name, module, help_text in BENCH_MODES:
        sub = modes.add_parser(name, help=help_text, description=help_text)
        module.add_cli_args(sub)
        sub.set_defaults(func=module.main)
    return bench


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_bench_subparsers(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run one bench mode; argv is `[MODE, flags...]` (without the leading `bench`)."""
    return run_command(make_parser, ["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
