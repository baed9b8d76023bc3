"""The `kvserve` command (also `python -m kvserve`): generate | serve | chat | proxy
(kvserve/entrypoints/cli.py) and bench (kvserve/benchmarks/cli.py), joined here above both."""
from __future__ import annotations

import sys
from typing import Optional

from kvserve.benchmarks.cli import add_bench_subparsers
from kvserve.engine.arg_utils import run_command
from kvserve.entrypoints.cli import make_parser


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(lambda: make_parser(more_subcommands=(add_bench_subparsers,)), argv)


if __name__ == "__main__":
    sys.exit(main())
