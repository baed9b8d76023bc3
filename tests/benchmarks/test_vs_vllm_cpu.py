"""benchmarks/vs_vllm_cpu.py without vLLM: the script imports in kvserve's venv, its prompts are
valid for both engines, and its timing worker (the code that also times vLLM) runs kvserve's
`LLM.generate` end to end on the tiny Llama and reports what it measured."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.benchmarks.test_bench import _load_script


def test_prompts_use_ids_both_engines_accept(tiny_llama: str) -> None:
    vs = _load_script("vs_vllm_cpu")
    ids = vs.prompt_token_ids(tiny_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert ids and max(ids) < len(tok) and not set(ids) & set(tok.all_special_ids)
    prompts = vs.make_prompts(50, 3, 9, ids, seed=5)
    assert prompts == vs.make_prompts(50, 3, 9, ids, seed=5)          # seeded
    assert all(3 <= len(p) <= 9 for p in prompts) and {len(p) for p in prompts} == set(range(3, 10))
    assert set(t for p in prompts for t in p) <= set(ids)


@pytest.mark.timeout(180)
def test_worker_times_kvserve_and_reports(tiny_llama: str, tmp_path: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ENABLE_MULTIPROCESSING", "0")
    vs = _load_script("vs_vllm_cpu")
    ids = vs.prompt_token_ids(tiny_llama)
    spec = dict(engine="kvserve", model=tiny_llama, dtype="float32", max_model_len=64,
                kv_cache_bytes=8 << 20, vllm_gpu_memory_utilization=0.5,
                parts=["offline", "batch1"], offline_output_len=5, batch1_tokens=24,
                offline_prompts=vs.make_prompts(3, 4, 12, ids, seed=1),
                batch1_prompts=vs.make_prompts(3, 8, 8, ids, seed=2))
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    assert vs.worker_main(str(spec_path), str(out_path)) == 0
    got = json.loads(out_path.read_text())
    off, b1 = got["offline"], got["batch1"]
    assert off["output_tokens"] == 3 * 5
    assert off["prompt_tokens"] == sum(map(len, spec["offline_prompts"]))
    assert off["output_tok_s"] == pytest.approx(off["output_tokens"] / off["elapsed_s"])
    assert b1["decode_tok_s"] > 0 and b1["step_ms"] == pytest.approx(1000.0 / b1["decode_tok_s"])

    result = {"machine": "test", "generate": {"kvserve": got},
              "vllm": {"versions": {}, "env": vs.vllm_env_overrides(2, "0-1")},
              "config": {"model": tiny_llama, "kvserve_dtype": "float32", "vllm_dtype": "float32",
                         "smoke": True, "request_rates": ["4", "inf"]}}
    report = vs.format_report(result)
    assert f"| offline output | {off['output_tok_s']:.1f} tok/s | - | - |" in report
    assert f"| batch-1 decode | {b1['decode_tok_s']:.1f} tok/s | - | - |" in report
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0" in report
    assert os.path.basename(vs.SHIM) == "vllm_cpu_shim.py" and os.path.isfile(vs.SHIM)
