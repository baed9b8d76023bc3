"""SharedStorageConnector: KV reuse across engines in other processes, corrupt files never
used, and bad connector settings rejected before anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.utils import random_prompts

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 24, block_size=16)


def _kv_config(path: str, role: str = "kv_both", name: str = "SharedStorageConnector") -> dict:
    return {"kv_connector": name, "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path}}


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}, "Unknown KV connector"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_sender"}, "kv_role must be one of"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "shared_storage_path"),
    ({"kv_role": "kv_both"}, "needs 'kv_connector'"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "nope": 1}, "Unknown kv_transfer_config key"),
    ({"kv_connector": "kvserve.config:CacheConfig", "kv_role": "kv_both"}, "not a KVConnectorBase"),
    ({"kv_connector": "no_such_module:Conn", "kv_role": "kv_both"}, "cannot import"),
    ("{not json", "not valid JSON"),
])
def test_bad_kv_transfer_config(tiny_llama: str, config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_llama, kv_transfer_config=config).create_engine_config()


def test_cli_rejects_bad_config_before_start(tiny_llama: str, tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    bad = json.dumps(_kv_config(str(a_file)))
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", tiny_llama, "--port", "1",
         "--kv-transfer-config", bad], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "is not a directory" in proc.stderr
    assert "Engine core ready" not in proc.stderr + proc.stdout


def _stats(llm: LLM) -> dict:
    return llm.get_stats()


def test_shared_storage_across_engines(tiny_llama: str, tmp_path) -> None:
    store = str(tmp_path / "kv")
    # Distinct prompts (no shared prefix): each one's blocks come from its own files.
    prompts = random_prompts(6, 20, 70, 1024, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    with LLM(tiny_llama, multiprocessing=False, **ENGINE) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    ref_ids = [o.outputs[0].token_ids for o in ref]
    full_blocks = sum(min(len(p) - 1, len(p)) // 16 for p in prompts)

    kv = _kv_config(store)
    with LLM(tiny_llama, kv_transfer_config=kv, disable_log_stats=False, **ENGINE) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref_ids
        stats = _stats(llm)
        assert stats["external_prefix_cache_hits"] == 0
    files = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
    assert len(files) == sum(len(p) // 16 for p in prompts)

    # A fresh engine core process (the LLM's) reads them instead of computing.
    with LLM(tiny_llama, kv_transfer_config=kv, disable_log_stats=False, **ENGINE) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref_ids
        for o, r in zip(out, ref):
            for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
                assert {t: round(lp.logprob, 4) for t, lp in a.items()} == pytest.approx(
                    {t: round(lp.logprob, 4) for t, lp in b.items()}, abs=1e-3)
        stats = _stats(llm)
        assert stats["external_prefix_cache_hits"] == full_blocks * 16
        assert stats["external_prefix_cache_queries"] == sum(len(p) for p in prompts)
        assert stats["kv_transfers"] == len(prompts)
        assert stats["kv_transfer_bytes"] > 0 and stats["kv_local_fallbacks"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_corrupt_or_truncated_file_is_recomputed(tiny_llama: str, tmp_path) -> None:
    store = str(tmp_path / "kv")
    prompts = random_prompts(3, 40, 60, 1024, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    kv = _kv_config(store)
    first_file = []
    with LLM(tiny_llama, kv_transfer_config=kv, disable_log_stats=False, **ENGINE) as llm:
        ref_ids = []
        for prompt in prompts:   # one at a time: each prompt's files are told apart
            before = {os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs}
            ref_ids.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            new = {os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs} - before
            assert len(new) == len(prompt) // 16
            first_file.append(min(new, key=os.path.getmtime))
    # One of prompt 0's blocks: a run of payload bytes overwritten (same size); one of prompt
    # 2's: cut short. Prompt 1's files stay intact.
    size = os.path.getsize(first_file[0])
    with open(first_file[0], "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x7f" * 2048)
    os.truncate(first_file[2], os.path.getsize(first_file[2]) - 100)
    with LLM(tiny_llama, kv_transfer_config=kv, disable_log_stats=False, **ENGINE) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref_ids
        stats = _stats(llm)
        assert stats["kv_local_fallbacks"] == 2
        assert stats["kv_transfers"] == 1
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        # A rejected prefix is not cached for later requests either: the same prompts again
        # (prefix cache or intact files) give the same tokens.
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == ref_ids


def test_bad_kv_transfer_params_rejected(tiny_llama: str, tmp_path) -> None:
    bad = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_prefill": True}})
    with LLM(tiny_llama, multiprocessing=False, **ENGINE) as llm:
        with pytest.raises(ValueError, match="no KV connector"):
            llm.generate([[5, 6, 7]], bad, use_tqdm=False)
    with LLM(tiny_llama, multiprocessing=False, kv_transfer_config=_kv_config(str(tmp_path)),
             **ENGINE) as llm:
        with pytest.raises(ValueError, match="needs"):
            llm.generate([[5, 6, 7]], bad, use_tqdm=False)
        with pytest.raises(ValueError, match="Unknown kv_transfer_params"):
            llm.generate([[5, 6, 7]], SamplingParams(
                extra_args={"kv_transfer_params": {"remote_blocks": [1]}}), use_tqdm=False)
        # The engine still serves.
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
