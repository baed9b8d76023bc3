"""The Pooler's index rules on their own (no model): pooling a prompt computed in chunks over
several steps, beside other requests, equals pooling it whole; and the sentence-transformers
config reader."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig, PoolerConfig
from kvserve.core.sched_output import NewRequestData, SchedulerOutput, CachedRequestData
from kvserve.pooling.config import read_sentence_transformers_config, resolve_runner
from kvserve.pooling.pooler import Pooler
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from tests.pooling.conftest import write_st_config

H = 8


def _pooler(pooling_type: str, normalize: bool = False) -> Pooler:
    mc = ModelConfig(model="x", tokenizer="x", served_model_name="x",
                     hf_config={"hidden_size": H}, dtype=torch.float32, max_model_len=512,
                     runner_type="pooling",
                     pooler_config=PoolerConfig(pooling_type=pooling_type, normalize=normalize))
    return Pooler(mc)


def _add(pooler: Pooler, rids: list[str]) -> None:
    pooler.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(r, [1], 1, SamplingParams(), [], 0,
                                           pooling_params=PoolingParams()) for r in rids],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, finished_req_ids=set()))


def _reference(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"MEAN": states.mean(0), "CLS": states[0], "LAST": states[-1], "ALL": states}[pooling_type]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS", "ALL"])
def test_chunked_equals_whole(pooling_type: str) -> None:
    """Three prompts (lengths 7, 20, 3) fed with a budget of 8 tokens a step: the 20-token one
    spans three steps (8 + 8 + 4 minus what the others take), beside whole ones."""
    torch.manual_seed(0)
    lens = {"a": 7, "b": 20, "c": 3}
    states = {r: torch.randn(n, H) for r, n in lens.items()}
    pooler = _pooler(pooling_type)
    _add(pooler, list(lens))
    done: dict[str, torch.Tensor] = {}
    computed = dict.fromkeys(lens, 0)
    for _ in range(10):
        budget, rows, plan = 8, [], []
        for r in lens:
            n = min(lens[r] - computed[r], budget)
            if n > 0 and r not in done:
                plan.append((r, n))
                budget -= n
        if not plan:
            break
        qlens = np.array([n for _, n in plan])
        starts = np.cumsum(qlens) - qlens
        ctx = np.array([computed[r] for r, _ in plan])
        hidden = torch.cat([states[r][computed[r]:computed[r] + n] for r, n in plan])
        out = pooler.pool([r for r, _ in plan], hidden, starts, qlens, ctx,
                          np.array([lens[r] for r, _ in plan]))
        for (r, n), v in zip(plan, out):
            computed[r] += n
            assert (v is not None) == (computed[r] == lens[r]), (r, computed[r])
            if v is not None:
                done[r] = v
    assert set(done) == set(lens)
    for r in lens:
        torch.testing.assert_close(done[r], _reference(states[r], pooling_type))
    assert not pooler._partial            # nothing kept once the prompts are pooled


def test_normalize_and_dimensions_per_request() -> None:
    pooler = _pooler("LAST", normalize=True)
    pooler.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1], 1, SamplingParams(), [], 0,
                                           pooling_params=PoolingParams(dimensions=4)),
                            NewRequestData("b", [1], 1, SamplingParams(), [], 0,
                                           pooling_params=PoolingParams(normalize=False))],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, finished_req_ids=set()))
    hidden = torch.randn(5, H)
    a, b = pooler.pool(["a", "b"], hidden, np.array([0, 2]), np.array([2, 3]),
                       np.array([0, 0]), np.array([2, 3]))
    torch.testing.assert_close(a, torch.nn.functional.normalize(hidden[1, :4], dim=0))
    torch.testing.assert_close(b, hidden[4])


def test_sentence_transformers_config(tmp_path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"hidden_size": 8}))
    for mode, normalize, want in [("mean", True, "MEAN"), ("cls", False, "CLS"),
                                  ("lasttoken", True, "LAST")]:
        d = write_st_config(str(tmp_path / f"{mode}{normalize}"), str(base), mode, normalize)
        cfg = read_sentence_transformers_config(d)
        assert cfg is not None and (cfg.pooling_type, cfg.normalize) == (want, normalize)
    assert read_sentence_transformers_config(str(base)) is None
    d = str(tmp_path / "meanTrue")
    with open(os.path.join(d, "1_Pooling", "config.json")) as f:
        cfg = json.load(f)
    cfg["pooling_mode_max_tokens"] = True
    with open(os.path.join(d, "1_Pooling", "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="pooling modes are not supported"):
        read_sentence_transformers_config(d)


def test_runner_flags() -> None:
    assert resolve_runner("auto", "auto", "Qwen3ForCausalLM") == ("generate", "none")
    assert resolve_runner("auto", "embed", "Qwen3ForCausalLM") == ("pooling", "embed")
    assert resolve_runner("pooling", "auto", "LlamaForCausalLM") == ("pooling", "embed")
    with pytest.raises(ValueError, match="--runner pooling"):
        resolve_runner("generate", "embed", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig.parse('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
