"""Checkpoints with a sentence-transformers config written next to a tiny HF checkpoint."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import pytest
import torch


def write_st_config(out_dir: str, base_dir: str, pooling: Optional[str], normalize: bool,
                    config_extra: Optional[dict[str, Any]] = None) -> str:
    """`base_dir`'s files (linked) plus modules.json / 1_Pooling/config.json (pooling: "mean",
    "cls", "lasttoken"; None: no sentence-transformers files) and a Normalize module."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(base_dir):
        if name == "config.json" and config_extra:
            with open(os.path.join(base_dir, name)) as f:
                cfg = json.load(f)
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump({**cfg, **config_extra}, f)
        elif not os.path.exists(os.path.join(out_dir, name)):
            os.symlink(os.path.join(base_dir, name), os.path.join(out_dir, name))
    if pooling is None:
        return out_dir
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    with open(os.path.join(out_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    pool_cfg = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": pooling == "lasttoken", "include_prompt": True}
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump(pool_cfg, f)
    return out_dir


@pytest.fixture(scope="session")
def st_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    def make(base_dir: str, pooling: Optional[str], normalize: bool,
             config_extra: Optional[dict[str, Any]] = None) -> str:
        out = str(tmp_path_factory.mktemp(f"st_{pooling}_{int(normalize)}"))
        return write_st_config(out, base_dir, pooling, normalize, config_extra)
    return make


def hf_pooled(model_dir: str, prompts: list[list[int]], pooling: str,
              normalize: bool, dimensions: Optional[int] = None) -> list[torch.Tensor]:
    """transformers' reference: AutoModel's last_hidden_state, one unpadded prompt at a time,
    pooled as sentence-transformers pools (mean over all tokens, first, or last)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0].float()
            v = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[pooling]
            if dimensions is not None:
                v = v[:dimensions]
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out
