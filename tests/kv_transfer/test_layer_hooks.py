"""The KV connector's per-layer hooks: with a connector, every attention layer calls
`wait_for_layer_load` then `save_kv_layer` once per step, in layer order, and the
SharedStorageConnector saves each layer's blocks from its own hook; outputs do not change."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from kvserve.entrypoints.llm import LLM
from kvserve.kv_transfer.base import KVConnectorMetadata
from kvserve.kv_transfer.shared_storage import SharedStorageConnector
from kvserve.model.layers.attention import Attention
from kvserve.sampling_params import SamplingParams
from tests.utils import random_prompts

# A small step budget: prompts are prefilled (and saved) over several steps.
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 24, block_size=16,
              max_num_batched_tokens=48, multiprocessing=False)


class LayerRecordingConnector(SharedStorageConnector):
    """The shared-storage connector, also keeping its per-layer hook calls step by step
    (loaded by module path, as a user's own connector would be)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[list[tuple[str, str]]] = []

    def bind_connector_metadata(self, metadata: Optional[KVConnectorMetadata]) -> None:
        super().bind_connector_metadata(metadata)
        self.steps.append([])

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.steps[-1].append(("load", layer_name))
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.steps[-1].append(("save", layer_name))
        super().save_kv_layer(layer_name, kv_layer)


def test_per_layer_hooks_once_per_layer_per_step(tiny_llama: str, tmp_path) -> None:
    store = str(tmp_path / "kv")
    prompts = random_prompts(3, 60, 120, 1024, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(tiny_llama, **ENGINE) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        model = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model
        assert all(m.kv_connector is None for m in model.modules() if isinstance(m, Attention))

    kv = {"kv_connector": f"{__name__}:LayerRecordingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": store}}
    with LLM(tiny_llama, kv_transfer_config=kv, **ENGINE) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        worker = llm.llm_engine.engine_core.engine_core.model_executor.worker
        connector = worker.kv_connector
        names = [n for n, m in worker.model_runner.model.named_modules()
                 if isinstance(m, Attention)]
    assert out == ref
    assert isinstance(connector, LayerRecordingConnector)
    assert len(names) == len(connector.kv_caches) and len(set(names)) == len(names)
    expected = [(hook, name) for name in names for hook in ("load", "save")]
    forward_steps = [s for s in connector.steps if s]
    # Prefill chunks (48-token budget for 60-120-token prompts) then 5 decode steps at least.
    assert len(forward_steps) >= sum(len(p) for p in prompts) // 48 + 5
    assert all(s == expected for s in forward_steps), forward_steps[:2]
    # Every full prompt block was saved, from the layers' own save_kv_layer calls.
    files = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
    assert len(files) == sum(len(p) // 16 for p in prompts)

    # A fresh engine loads those files instead of computing: same tokens.
    with LLM(tiny_llama, kv_transfer_config=kv, disable_log_stats=False, **ENGINE) as llm:
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
    assert again == ref
    assert stats["kv_transfers"] == len(prompts) and stats["kv_local_fallbacks"] == 0
