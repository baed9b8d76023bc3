"""`kvserve bench serve` and `kvserve bench sweep` against a real `kvserve serve` subprocess.

The server runs the tiny Llama; the benchmarks run in-process through the bench CLI with a
handful of short requests. Checks: every vLLM result key is there, counts equal what was asked
(`ignore_eos`), TTFT <= E2E, percentiles ordered, goodput against SLOs that every / no request
meets, the arrival schedule is kept, and the summary statistics equal those recomputed from the
saved per-request lists. The metric arithmetic and the arrival process are also checked on
their own against hand-computed values.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from kvserve.benchmarks import serve as bench_serve
from kvserve.benchmarks.cli import main as bench_main
from kvserve.benchmarks.datasets import SampleRequest
# The live-server fixture of the server tests (module-scoped, killed at teardown).
from tests.entrypoints.conftest import RemoteServer, server  # noqa: F401

NUM_PROMPTS = 6
INPUT_LEN = 16
OUTPUT_LEN = 8
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
TOP_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
            "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency")


def _serve_flags(server: RemoteServer, num_prompts: int = NUM_PROMPTS) -> list[str]:
    return ["--base-url", server.base_url, "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(num_prompts), "--ignore-eos", "--disable-tqdm"]


def _run_serve(tmp_path: Any, argv: list[str], expect_rc: int = 0) -> dict[str, Any]:
    assert bench_main(["serve", *argv, "--save-result", "--save-detailed",
                       "--result-dir", str(tmp_path), "--result-filename", "r.json"]) == expect_rc
    return json.loads((tmp_path / "r.json").read_text())


def _check_result(r: dict[str, Any], num_prompts: int = NUM_PROMPTS) -> None:
    for key in TOP_KEYS:
        assert key in r, key
    for m in METRICS:
        for stat in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            key = f"{stat}_{m}_ms"
            assert key in r and math.isfinite(r[key]) and r[key] >= 0, key
        assert r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], m
        assert math.isclose(r[f"p50_{m}_ms"], r[f"median_{m}_ms"])
    assert r["completed"] == num_prompts and r["failed"] == 0, r["errors"]
    assert r["num_prompts"] == num_prompts
    assert r["total_output_tokens"] == num_prompts * OUTPUT_LEN          # ignore_eos
    assert r["output_lens"] == [OUTPUT_LEN] * num_prompts
    assert r["total_input_tokens"] == sum(r["input_lens"]) == num_prompts * INPUT_LEN
    assert r["duration"] > 0
    assert math.isclose(r["request_throughput"], num_prompts / r["duration"])
    assert math.isclose(r["output_throughput"], r["total_output_tokens"] / r["duration"])
    assert math.isclose(r["total_token_throughput"],
                        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
    assert r["max_output_tokens_per_s"] > 0 and 1 <= r["max_concurrent_requests"] <= num_prompts
    # Latencies: positive, TTFT before the end; the summary equals the saved per-request data.
    ttfts = np.array(r["ttfts"]) * 1000
    assert (ttfts > 0).all()
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"]
    assert r["p99_ttft_ms"] <= r["p99_e2el_ms"] <= r["duration"] * 1000
    assert math.isclose(r["mean_ttft_ms"], ttfts.mean())
    assert math.isclose(r["p90_ttft_ms"], np.percentile(ttfts, 90))
    # The server merges the tokens a client has not read yet into one chunk (as vLLM's output
    # collector does), so how many chunks (ITLs + 1) a request gets depends on timing: with a
    # tiny model and 3 concurrent streams most of the 8 tokens can come in one chunk.
    itls = np.concatenate([np.zeros(0), *(np.array(i) for i in r["itls"])]) * 1000
    assert all(len(i) <= OUTPUT_LEN - 1 for i in r["itls"])
    assert (itls > 0).all()
    assert math.isclose(r["mean_itl_ms"], itls.mean() if itls.size else 0.0)
    assert all(t for t in r["generated_texts"]) and not any(r["errors"])


# ---------------------------------------------------------------------------------------------
# End to end against the server

@pytest.mark.timeout(120)
def test_bench_serve_rate_inf(server: RemoteServer, tmp_path: Any) -> None:
    r = _run_serve(tmp_path, [*_serve_flags(server), "--request-rate", "inf",
                              "--max-concurrency", "3", "--num-warmups", "1",
                              "--metric-percentiles", "50,90,99",
                              "--goodput", "ttft:600000", "tpot:600000", "e2el:600000"])
    _check_result(r)
    assert r["request_rate"] == "inf" and r["max_concurrency"] == 3
    assert 2 <= r["max_concurrent_requests"] <= 3   # they overlap; the semaphore holds
    assert r["model_id"] == server.model            # the first of GET /v1/models
    assert r["weights"] is None                     # a checkpoint directory, not a GGUF file
    # SLOs every request meets: goodput is the request throughput.
    assert math.isclose(r["request_goodput"], r["request_throughput"])


@pytest.mark.timeout(120)
def test_bench_serve_finite_rate(server: RemoteServer, tmp_path: Any) -> None:
    rate, seed = 25.0, 3
    r = _run_serve(tmp_path, [*_serve_flags(server), "--request-rate", str(rate),
                              "--burstiness", "0.5", "--seed", str(seed),
                              "--max-concurrency", "4", "--metric-percentiles", "50,90,99",
                              "--goodput", "ttft:0"])
    _check_result(r)
    assert r["request_rate"] == rate and r["burstiness"] == 0.5
    assert r["max_concurrent_requests"] <= 4
    # The last request is sent only after all the scheduled gaps before it.
    gaps = bench_serve.arrival_intervals(NUM_PROMPTS, rate, 0.5, seed)
    assert r["duration"] >= gaps[:-1].sum()
    assert r["request_goodput"] == 0.0             # no TTFT is 0 ms


@pytest.mark.timeout(60)
def test_bench_serve_unknown_model_fails(server: RemoteServer, tmp_path: Any) -> None:
    r = _run_serve(tmp_path, [*_serve_flags(server, 2), "--model", "no-such-model",
                              "--tokenizer", server.model], expect_rc=1)
    assert r["completed"] == 0 and r["failed"] == 2
    assert r["total_output_tokens"] == 0 and r["request_throughput"] == 0
    assert all("404" in e for e in r["errors"])


@pytest.mark.timeout(120)
def test_bench_sweep(server: RemoteServer, tmp_path: Any, capsys: Any) -> None:
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = bench_main(["sweep", *_serve_flags(server, 4), "--request-rates", "30,inf",
                     "--max-concurrency", "4", "--output-json", str(out_json),
                     "--plot", str(out_png)])
    assert rc == 0
    sweep = json.loads(out_json.read_text())
    assert sweep["request_rates"] == [30.0, "inf"]
    assert [r["request_rate"] for r in sweep["results"]] == [30.0, "inf"]
    for i, r in enumerate(sweep["results"]):
        assert r["completed"] == 4 and r["total_output_tokens"] == 4 * OUTPUT_LEN
        assert r["seed"] == i                        # fresh prompts at every rate
        for m in ("ttft", "tpot"):                   # what the plot needs, p99 added
            assert r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"]
        assert "ttfts" not in r                      # per-request lists stay out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not out_png.exists()
        assert "pip install matplotlib" in capsys.readouterr().err
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# The arithmetic on its own

def test_calculate_metrics_by_hand() -> None:
    reqs = [SampleRequest([1] * 10, 4), SampleRequest([1] * 20, 4), SampleRequest([1] * 5, 4)]
    outs = [
        bench_serve.RequestFuncOutput(success=True, output_tokens=4, ttft=0.1,
                                      itl=[0.02, 0.03, 0.05], latency=0.2, start_time=0.0),
        # no usage from the server: the text is tokenized ("ab" -> 2 tokens here)
        bench_serve.RequestFuncOutput(success=True, generated_text="ab", ttft=0.3,
                                      itl=[0.1], latency=0.5, start_time=0.5),
        bench_serve.RequestFuncOutput(success=False, error="boom"),
    ]

    class CharTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    m, lens = bench_serve.calculate_metrics(reqs, outs, 2.0, CharTokenizer(), METRICS, (50, 99),
                                            {"ttft": 200.0, "tpot": 40.0})
    assert lens == [4, 2, 0]
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert math.isclose(m["request_throughput"], 1.0)
    assert math.isclose(m["output_throughput"], 3.0)
    assert math.isclose(m["total_token_throughput"], 18.0)
    # TPOT: (0.2 - 0.1) / 3 and (0.5 - 0.3) / 1
    tpots = np.array([0.1 / 3, 0.2]) * 1000
    assert math.isclose(m["mean_tpot_ms"], tpots.mean())
    assert math.isclose(m["std_tpot_ms"], tpots.std())
    assert math.isclose(m["p99_tpot_ms"], np.percentile(tpots, 99))
    assert math.isclose(m["mean_ttft_ms"], 200.0) and math.isclose(m["median_e2el_ms"], 350.0)
    assert math.isclose(m["mean_itl_ms"], np.mean([20, 30, 50, 100]))
    # Only the first request meets TTFT <= 200 ms and TPOT <= 40 ms.
    assert math.isclose(m["request_goodput"], 0.5)
    # Chunks at 0.1, 0.12, 0.15, 0.2 (second 0) and 0.8, 0.9 (second 0): 6 in second 0.
    # Requests in flight over [0, 0.2] and [0.5, 1.0]: never two at once.
    assert m["max_output_tokens_per_s"] == 6.0 and m["max_concurrent_requests"] == 1


def test_arrival_intervals() -> None:
    assert (bench_serve.arrival_intervals(5, float("inf")) == 0).all()
    for burstiness in (0.5, 1.0, 4.0):
        gaps = bench_serve.arrival_intervals(20000, 8.0, burstiness, seed=1)
        assert abs(gaps.mean() - 1 / 8) < 0.01                    # the rate whatever the shape
        cv2 = gaps.var() / gaps.mean() ** 2                       # gamma: CV^2 = 1 / shape
        assert abs(cv2 - 1 / burstiness) < 0.1 * (1 / burstiness)
    same = bench_serve.arrival_intervals(10, 2.0, 1.0, seed=7)
    assert np.array_equal(same, bench_serve.arrival_intervals(10, 2.0, 1.0, seed=7))
    with pytest.raises(ValueError):
        bench_serve.arrival_intervals(3, 0.0)


def test_parse_flags() -> None:
    assert bench_serve.parse_goodput(["ttft:500", "e2el:1.5"]) == {"ttft": 500.0, "e2el": 1.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            bench_serve.parse_goodput(bad)
    assert bench_serve.parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert bench_serve.percentile_key(99.0) == "99" and bench_serve.percentile_key(99.9) == "99.9"
    with pytest.raises(ValueError):
        bench_serve.parse_percentile_metrics("ttft,foo")
