"""`kvserve bench sweep`: `bench serve` at several request rates, and the latency/throughput plot.

    kvserve bench sweep --base-url http://127.0.0.1:8000 --request-rates 1,2,4,inf \\
        --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 100 \\
        --ignore-eos --output-json sweep.json --plot sweep.png

Every rate runs against the same server through one HTTP client, with all of `bench serve`'s
flags. Rate i draws its prompts with seed `--seed + i`: re-sending the previous rate's prompts
would find them in the server's prefix cache and flatter every rate after the first.

The JSON holds one `bench serve` result per rate (vLLM's keys). The PNG plots TTFT and TPOT
(p50 and p99) against output token throughput, one point per rate, labelled with the rate:
the knee where latency climbs while throughput stops growing is the server's capacity.
Without matplotlib the JSON is still written and the sweep says how to install it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import datetime
from typing import Any, Optional, Sequence

from kvserve.benchmarks import serve

PLOT_METRICS = ("ttft", "tpot")


def parse_request_rates(text: str) -> list[float]:
    """"1,2,4,inf" -> [1.0, 2.0, 4.0, inf]."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--request-rates {text!r}: comma-separated numbers or inf.") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates {text!r}: each rate must be > 0 (or inf).")
    return rates


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--request-rates", type=str, required=True,
                        help="Comma-separated request rates (req/s) to run, e.g. 1,2,4,inf.")
    parser.add_argument("--output-json", type=str, default=None,
                        help="Write every rate's result here (default: "
                             "sweep-{model}-{date}.json in --result-dir).")
    parser.add_argument("--plot", type=str, default=None,
                        help="PNG of TTFT / TPOT (p50, p99) against output throughput "
                             "(default: the JSON's path with .png).")
    parser.add_argument("--result-dir", type=str, default=None,
                        help="Directory for the default output files (default: the current one).")
    serve.add_cli_args(parser, sweep=True)
    return parser


def _with_plot_metrics(args: argparse.Namespace) -> argparse.Namespace:
    """The plot needs TTFT and TPOT at p99 (p50 is the median, always reported)."""
    metrics = serve.parse_percentile_metrics(args.percentile_metrics)
    percentiles = serve.parse_percentiles(args.metric_percentiles)
    metrics += [m for m in PLOT_METRICS if m not in metrics]
    if 99.0 not in percentiles:
        percentiles.append(99.0)
    return argparse.Namespace(**{
        **vars(args), "percentile_metrics": ",".join(metrics),
        "metric_percentiles": ",".join(serve.percentile_key(p) for p in percentiles)})


async def run_sweep(args: argparse.Namespace, rates: Sequence[float]) -> list[dict[str, Any]]:
    """`bench serve` at each rate in turn; the results without the per-request lists."""
    results = []
    async with serve.BenchSession(args) as session:
        for i, rate in enumerate(rates):
            print(f"\n=== Sweep {i + 1}/{len(rates)}: request rate {rate:g} req/s ===")
            result = await session.run(rate, args.seed + i)
            print(serve.format_summary(result, session.selected_percentile_metrics,
                                       session.selected_percentiles))
            results.append(serve.strip_detailed(result))
    return results


def _rate_label(rate: Any) -> str:
    return "inf" if rate == "inf" else f"{float(rate):g}"


def format_sweep_table(results: Sequence[dict[str, Any]]) -> str:
    header = (f"{'rate':>6} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    rows = [header]
    for r in results:
        rows.append(f"{_rate_label(r['request_rate']):>6} {r['completed']:>5} "
                    f"{r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
                    f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} "
                    f"{r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f}")
    return "\n".join(rows)


def plot_sweep(results: Sequence[dict[str, Any]], path: str, title: Optional[str] = None) -> bool:
    """Write the latency-vs-throughput PNG; False (and a hint) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")   # files only: no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: `pip install matplotlib` for the plot "
              "(the JSON results are written anyway).", file=sys.stderr)
        return False
    order = sorted(results, key=lambda r: r["output_throughput"])
    xs = [r["output_throughput"] for r in order]
    fig, axes = plt.subplots(1, len(PLOT_METRICS), figsize=(11, 4.2))
    for ax, name in zip(axes, PLOT_METRICS):
        ax.plot(xs, [r[f"median_{name}_ms"] for r in order], "o-", label="p50")
        ax.plot(xs, [r[f"p99_{name}_ms"] for r in order], "s--", label="p99")
        for x, r in zip(xs, order):
            ax.annotate(f"{_rate_label(r['request_rate'])} req/s", (x, r[f"p99_{name}_ms"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_title(serve.METRIC_HEADERS[name][0])
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(args: argparse.Namespace) -> int:
    rates = parse_request_rates(args.request_rates)
    args = _with_plot_metrics(args)
    try:
        results = asyncio.run(run_sweep(args, rates))
    except RuntimeError as e:   # server unreachable, warm-up failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n" + format_sweep_table(results))
    model_id = results[0]["model_id"]
    json_path = args.output_json
    if json_path is None:
        name = os.path.basename(str(model_id).rstrip("/")) or "model"
        json_path = f"sweep-{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        if args.result_dir:
            json_path = os.path.join(args.result_dir, json_path)
    serve.write_json(json_path, {"model_id": model_id, "base_url": results[0]["base_url"],
                                 "request_rates": [r["request_rate"] for r in results],
                                 "results": results})
    print(f"Saved the sweep results to {json_path}")
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    title = (f"{os.path.basename(str(model_id).rstrip('/'))}, {args.dataset_name} dataset, "
             f"{results[0]['num_prompts']} requests per rate")
    if plot_sweep(results, plot_path, title):
        print(f"Saved the plot to {plot_path}")
    return 0 if all(r["completed"] > 0 for r in results) else 1


if __name__ == "__main__":
    from kvserve.benchmarks.cli import main as _bench_main
    sys.exit(_bench_main(["sweep", *sys.argv[1:]]))
