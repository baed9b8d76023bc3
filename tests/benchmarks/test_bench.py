"""`kvserve bench latency | throughput`, the datasets, and the benchmark scripts' arithmetic.

Every mode runs end to end through the bench CLI on the tiny Llama with a handful of short
requests; the checks are on its JSON: every metric present, token counts equal to what was
asked, times positive, percentiles ordered, rates consistent with counts / elapsed time.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
from typing import Any

import pytest
import torch

from kvserve.benchmarks.cli import main as bench_main
from kvserve.benchmarks.datasets import (sample_prefix_requests, sample_random_requests,
                                         sample_sharegpt_requests)
from kvserve.tokenizer import Tokenizer

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
# In-process engine core: a process per engine would double these tests' time. The latency
# test runs the default (engine core in its own process) to cover that path.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(8 << 20),
                "--no-multiprocessing"]


def _load_script(name: str) -> Any:
    """Import a script of benchmarks/ (not a package) by path."""
    sys.path.insert(0, os.path.abspath(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH_DIR, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.abspath(BENCH_DIR))


def _run(tmp_path: Any, argv: list[str]) -> dict[str, Any]:
    out = tmp_path / "result.json"
    assert bench_main([*argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def _check_rates(r: dict[str, Any]) -> None:
    assert r["elapsed_time"] > 0
    assert r["total_num_tokens"] == r["total_prompt_tokens"] + r["total_output_tokens"]
    assert math.isclose(r["requests_per_second"] * r["elapsed_time"], r["num_requests"])
    assert math.isclose(r["tokens_per_second"] * r["elapsed_time"], r["total_num_tokens"])
    assert math.isclose(r["output_tokens_per_second"] * r["elapsed_time"], r["total_output_tokens"])


# ---------------------------------------------------------------------------------------------
# bench latency

@pytest.mark.timeout(120)
def test_latency(tiny_llama: str, tmp_path: Any) -> None:
    r = _run(tmp_path, ["latency", "--model", tiny_llama, *ENGINE_FLAGS[:-1], "--batch-size", "3",
                        "--n", "2", "--input-len", "8", "--output-len", "5",
                        "--num-iters-warmup", "1", "--num-iters", "4"])
    assert len(r["latencies"]) == 4 and all(t > 0 for t in r["latencies"])
    assert math.isclose(r["avg_latency"], sum(r["latencies"]) / 4)
    assert r["std_latency"] >= 0
    p = r["percentiles"]
    assert list(p) == ["10", "25", "50", "75", "90", "99"]
    values = list(p.values())
    assert values == sorted(values)
    assert min(r["latencies"]) <= values[0] and values[-1] <= max(r["latencies"])
    assert r["num_output_tokens_per_iter"] == [3 * 2 * 5] * 4     # batch x n x output_len
    assert r["output_tokens_per_second"] > 0
    assert r["weights"] == "float32"


@pytest.mark.timeout(300)
def test_bench_names_a_gguf_files_quantization(tmp_path: Any, capsys: Any) -> None:
    """The weights' quantization beside the numbers (issue 29 part 5): llama.cpp's name for
    the demo file (general.file_type Q4_1), its types, and how kvserve ran them."""
    r = _run(tmp_path, ["latency", "--model", "demo", "--dtype", "float32",
                        "--max-model-len", "64", "--kv-cache-memory", str(16 << 20),
                        "--no-multiprocessing", "--batch-size", "1", "--input-len", "8",
                        "--output-len", "2", "--num-iters-warmup", "0", "--num-iters", "1"])
    want = "Q4_1 GGUF (210 Q4_1, 1 Q8_0), packed, float32 activations"
    assert r["weights"] == want
    assert f"Weights: {want}" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# bench throughput

RANDOM_ARGS = ["--dataset-name", "random", "--num-prompts", "5", "--random-input-len", "12",
               "--random-output-len", "6", "--random-range-ratio", "0.5", "--seed", "3"]


def _expected_random(tiny_llama: str) -> list[Any]:
    tok = Tokenizer.from_pretrained(tiny_llama)
    vocab = min(1024, tok.vocab_size)
    return sample_random_requests(5, 12, 6, vocab, 0.5, 3, tok.all_special_ids)


@pytest.mark.timeout(120)
def test_throughput_kvserve_and_hf(tiny_llama: str, tmp_path: Any) -> None:
    expected = _expected_random(tiny_llama)
    want_out = sum(r.expected_output_len for r in expected)
    want_in = sum(r.prompt_len for r in expected)
    assert len({r.expected_output_len for r in expected}) > 1      # the range ratio varied them

    ours = _run(tmp_path, ["throughput", "--backend", "kvserve", "--model", tiny_llama,
                           *ENGINE_FLAGS, *RANDOM_ARGS])
    hf = _run(tmp_path, ["throughput", "--backend", "hf", "--model", tiny_llama, *ENGINE_FLAGS,
                         *RANDOM_ARGS, "--hf-max-batch-size", "2"])
    for r, backend in ((ours, "kvserve"), (hf, "hf")):
        assert r["backend"] == backend and r["num_requests"] == 5
        assert r["total_output_tokens"] == want_out
        assert r["total_prompt_tokens"] == want_in
        assert r["dtype"] == "float32" and r["weights"] == "float32"
        _check_rates(r)
    assert hf["hf_max_batch_size"] == 2
    assert ours["num_preemptions"] == 0


@pytest.mark.timeout(120)
def test_throughput_prefix_caching(tiny_llama: str, tmp_path: Any) -> None:
    args = ["throughput", "--model", tiny_llama, *ENGINE_FLAGS, "--dataset-name", "prefix",
            "--num-prompts", "6", "--prefix-len", "48", "--num-prefixes", "2",
            "--random-input-len", "5", "--random-output-len", "3"]
    on = _run(tmp_path, args)
    off = _run(tmp_path, [*args, "--no-enable-prefix-caching"])
    for r in (on, off):
        assert r["total_prompt_tokens"] == 6 * (48 + 5) and r["total_output_tokens"] == 6 * 3
        _check_rates(r)
    assert on["enable_prefix_caching"] and not off["enable_prefix_caching"]
    # 4 of the 6 prompts repeat a prefix seen before: at most their 3 full prefix blocks hit.
    assert 0 < on["prefix_cache_hits"] <= 4 * 48
    assert on["prefix_cache_hit_rate"] == on["prefix_cache_hits"] / on["prefix_cache_queries"]
    assert off["prefix_cache_hits"] == 0


@pytest.mark.timeout(120)
def test_throughput_sharegpt(tiny_llama: str, tmp_path: Any) -> None:
    words = "the river king queen castle dragon robot computer science history".split()
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    data = [{"conversations": [{"from": "human", "value": text(6 + i)},
                               {"from": "gpt", "value": text(3 + i)}]} for i in range(4)]
    data.append({"conversations": [{"from": "human", "value": "one turn only"}]})   # skipped
    data.append({"conversations": [{"from": "human", "value": "hi"},                 # too short
                                   {"from": "gpt", "value": "ok"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tok = Tokenizer.from_pretrained(tiny_llama)

    reqs = sample_sharegpt_requests(str(path), 4, tok)
    assert sorted(r.prompt for r in reqs) == sorted(d["conversations"][0]["value"] for d in data[:4])
    for r in reqs:
        conv = next(d["conversations"] for d in data if d["conversations"][0]["value"] == r.prompt)
        assert r.prompt_token_ids == tok.encode(conv[0]["value"])
        assert r.expected_output_len == len(tok.encode(conv[1]["value"], add_special_tokens=False))

    res = _run(tmp_path, ["throughput", "--model", tiny_llama, *ENGINE_FLAGS,
                          "--dataset-name", "sharegpt", "--dataset-path", str(path),
                          "--num-prompts", "4", "--sharegpt-output-len", "4"])
    assert res["num_requests"] == 4 and res["total_output_tokens"] == 16
    assert res["total_prompt_tokens"] == sum(r.prompt_len for r in reqs)
    _check_rates(res)


def test_bench_rejects_bad_input(tiny_llama: str, tmp_path: Any) -> None:
    assert bench_main(["throughput", "--model", tiny_llama, "--dataset-name", "sharegpt",
                       "--num-prompts", "2"]) == 2       # no --dataset-path
    with pytest.raises(SystemExit):
        bench_main(["throughput", "--dataset-name", "nope"])


# ---------------------------------------------------------------------------------------------
# datasets

def test_random_dataset_lengths_and_ids() -> None:
    reqs = sample_random_requests(200, 100, 20, 1000, range_ratio=0.25, seed=1, special_ids=[0, 1, 2])
    assert {len(r.prompt_token_ids) for r in reqs} <= set(range(75, 126))
    assert min(r.prompt_len for r in reqs) < 85 and max(r.prompt_len for r in reqs) > 115
    assert all(15 <= r.expected_output_len <= 25 for r in reqs)
    assert all(3 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    again = sample_random_requests(200, 100, 20, 1000, range_ratio=0.25, seed=1, special_ids=[0, 1, 2])
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    fixed = sample_random_requests(10, 7, 3, 50)
    assert all(r.prompt_len == 7 and r.expected_output_len == 3 for r in fixed)
    with pytest.raises(ValueError, match="range_ratio"):
        sample_random_requests(1, 10, 10, 100, range_ratio=1.0)


def test_prefix_dataset_shares_prefixes() -> None:
    reqs = sample_prefix_requests(12, prefix_len=32, num_prefixes=3, suffix_len=4,
                                  output_len=2, vocab_size=500, seed=0)
    prefixes = {tuple(r.prompt_token_ids[:32]) for r in reqs}
    assert len(prefixes) == 3
    for p in prefixes:
        assert sum(tuple(r.prompt_token_ids[:32]) == p for r in reqs) == 4
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 12      # own suffixes
    assert all(r.prompt_len == 36 and r.expected_output_len == 2 for r in reqs)


# ---------------------------------------------------------------------------------------------
# benchmarks/ scripts: the arithmetic they report against

def test_roofline_param_count_and_kv_bytes(tiny_llama: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    roofline = _load_script("roofline")
    counts = roofline.decode_param_count(tiny_llama)
    config = AutoConfig.from_pretrained(tiny_llama)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in hf.parameters())
    embed = hf.get_input_embeddings().weight.numel()
    assert counts == {"total": total, "embedding": embed, "decode": total - embed}
    limits = roofline.roofline_limits(tiny_llama, "bfloat16", bandwidth_gb_s=10.0, peak_gflop_s=100.0)
    assert limits["weight_bytes"] == 2 * (total - embed)
    assert math.isclose(limits["batch1_decode_limit_tok_s"], 10e9 / (2 * (total - embed)))
    assert math.isclose(limits["compute_limit_tok_s"], 100e9 / (2 * (total - embed)))
    # 2 layers x (K, V) x 2 kv heads x head_dim 16 x 4 bytes per token; 20 tokens -> 2 blocks + 1.
    assert roofline.kv_cache_bytes_for(tiny_llama, "float32", [20]) == 3 * 16 * 2 * 2 * 2 * 16 * 4


def _rope_hf(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Hugging Face Llama: pairs (i, i + d/2)."""
    d = x.shape[-1]
    freqs = pos[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """llama.cpp's LLAMA rope (normal mode): pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    freqs = pos[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * freqs.cos() - b * freqs.sin()
    out[..., 1::2] = a * freqs.sin() + b * freqs.cos()
    return out


def test_gguf_qk_permutation_preserves_attention_scores() -> None:
    vs = _load_script("vs_llamacpp")
    torch.manual_seed(0)
    n_head, n_kv, d, hidden, seq = 4, 2, 8, 16, 5
    wq = torch.randn(n_head * d, hidden, dtype=torch.float64)
    wk = torch.randn(n_kv * d, hidden, dtype=torch.float64)
    x = torch.randn(seq, hidden, dtype=torch.float64)
    pos = torch.arange(seq, dtype=torch.float64)

    def scores(q_w: torch.Tensor, k_w: torch.Tensor, rope: Any) -> torch.Tensor:
        q = rope((x @ q_w.T).view(seq, n_head, d).transpose(0, 1), pos)
        k = rope((x @ k_w.T).view(seq, n_kv, d).transpose(0, 1), pos)
        k = k.repeat_interleave(n_head // n_kv, 0)
        return q @ k.transpose(1, 2)

    want = scores(wq, wk, _rope_hf)
    got = scores(vs.permute_qk(wq, n_head), vs.permute_qk(wk, n_kv), _rope_interleaved)
    assert torch.allclose(got, want, atol=1e-9)
    assert not torch.allclose(scores(wq, wk, _rope_interleaved), want, atol=1e-3)


@pytest.mark.timeout(120)
def test_gguf_export_round_trip(tiny_llama: str, tmp_path: Any) -> None:
    pytest.importorskip("gguf")
    vs = _load_script("vs_llamacpp")
    num_tensors = len(_load_script("roofline")._safetensors_shapes(tiny_llama))
    for dtype in ("float32", "bfloat16"):
        path = vs.export_gguf(tiny_llama, str(tmp_path / f"m-{dtype}.gguf"), dtype)
        assert vs.check_gguf(path, tiny_llama, dtype) == num_tensors


@pytest.mark.timeout(180)
def test_offline_vs_hf_runs(tiny_llama: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ENABLE_MULTIPROCESSING", "0")
    script = _load_script("offline_vs_hf")
    out = tmp_path / "ovh.json"
    assert script.main(["--model", tiny_llama, "--dtypes", "float32", "--num-prompts", "3",
                        "--min-prompt-len", "4", "--max-prompt-len", "20", "--output-len", "4",
                        "--hf-batch-sizes", "2", "3", "--batch1-prompt-len", "4",
                        "--batch1-tokens", "16", "--num-iters", "2", "--bandwidth-mb", "64",
                        "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    e = r["dtypes"]["float32"]
    assert set(e["hf_output_tok_s_by_batch_size"]) == {"2", "3"}
    assert e["hf_output_tok_s"] == max(e["hf_output_tok_s_by_batch_size"].values())
    assert math.isclose(e["ratio"], e["kvserve_output_tok_s"] / e["hf_output_tok_s"])
    assert e["kvserve_batch1_decode_tok_s"] > 0 and e["hf_batch1_decode_tok_s"] > 0
    assert e["kvserve_num_preemptions"] == 0
    assert math.isclose(e["kvserve_batch1_fraction_of_limit"],
                        e["kvserve_batch1_decode_tok_s"] / e["batch1_decode_limit_tok_s"])
    assert r["memory_bandwidth"]["read_gb_s"] > 0
    before, after = e["read_gb_s_around_batch1"]
    assert before > 0 and after > 0


def test_median_confidence_interval() -> None:
    # spec_decode.py's distribution-free 95% interval of the median: the order statistics of
    # the binomial table (n = 9: 2nd and 8th; n = 100: 40th and 61st), none below 6 samples,
    # and it covers the true median of a skewed distribution in about 95% of trials.
    ci = _load_script("spec_decode").median_ci95
    assert ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert ci([float(x) for x in range(1, 10)]) == (2.0, 8.0)
    assert ci([float(x) for x in range(1, 101)]) == (40.0, 61.0)
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        lo, hi = ci([rng.expovariate(1.0) for _ in range(30)])
        hits += lo <= math.log(2) <= hi
    assert 0.92 * 400 <= hits <= 0.995 * 400, hits
