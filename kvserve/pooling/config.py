"""Which runner an engine uses, and how its pooler pools (vLLM's --runner / --convert /
--pooler-config, and the checkpoint's sentence-transformers files).

Precedence for each pooler setting: --pooler-config, then the checkpoint's
sentence-transformers config (`modules.json` naming a `Pooling` module whose directory holds
`config.json`, and a `Normalize` module), then the decoder-embedder default (Qwen3-Embedding
style): LAST token, normalised.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from kvserve.config import ModelConfig, PoolerConfig

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")

_ST_POOLING_MODES = {          # sentence-transformers 1_Pooling/config.json key -> ours
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODULE = "sentence_transformers.models."


def resolve_runner(runner: str, convert: str, architecture: str) -> tuple[str, str]:
    """(runner_type, convert_type) from the flags. "auto": a `*Model` / `*EmbeddingModel`
    architecture or `--convert embed` makes a pooling runner, anything else generates."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {list(CONVERTS)}, got {convert!r}.")
    if runner == "auto":
        runner = "pooling" if convert == "embed" or architecture.endswith("Model") else "generate"
    if convert == "embed" and runner != "pooling":
        raise ValueError("--convert embed turns the model into an embedding model: it needs "
                         "--runner pooling (or auto).")
    if convert == "auto":
        convert = "embed" if runner == "pooling" else "none"
    return runner, convert


def read_sentence_transformers_config(model_dir: str) -> Optional[PoolerConfig]:
    """The pooler a checkpoint's sentence-transformers files describe, or None without them.
    Modules the engine cannot reproduce (Dense layers, max / weighted pooling) are errors:
    silently skipping one would return different embeddings than sentence-transformers."""
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    pooling_type: Optional[str] = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_MODULE)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _read_st_pooling(os.path.join(model_dir, module.get("path", "")))
        else:
            raise ValueError(f"{modules_file}: sentence-transformers module {kind!r} is not "
                             f"supported (Transformer, Pooling and Normalize are).")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def _read_st_pooling(pooling_dir: str) -> str:
    cfg_file = os.path.join(pooling_dir, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"sentence-transformers Pooling module without {cfg_file}.")
    with open(cfg_file) as f:
        cfg = json.load(f)
    bad = [k for k in _ST_UNSUPPORTED_MODES if cfg.get(k)]
    modes = [ours for key, ours in _ST_POOLING_MODES.items() if cfg.get(key)]
    if bad or len(modes) != 1:
        raise ValueError(f"{cfg_file}: exactly one of {sorted(_ST_POOLING_MODES)} must be set "
                         f"(got {modes + bad}); other pooling modes are not supported.")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_file}: include_prompt=false (instruction tokens left out of "
                         f"the pooling) is not supported.")
    return modes[0]


def resolve_pooler_config(model_config: ModelConfig, user: PoolerConfig) -> PoolerConfig:
    """The pooling runner's complete settings (no field left None but dimensions)."""
    st = (read_sentence_transformers_config(model_config.model)
          if os.path.isdir(model_config.model) else None)
    st = st or PoolerConfig()
    pooling_type = user.pooling_type or st.pooling_type or "LAST"
    normalize = next(v for v in (user.normalize, st.normalize, True) if v is not None)
    if user.dimensions is not None:
        check_dimensions(model_config, user.dimensions)
    resolved = PoolerConfig(pooling_type=pooling_type, normalize=normalize,
                            dimensions=user.dimensions)
    logger.info("Pooling runner: pooling_type=%s normalize=%s%s", pooling_type, normalize,
                " (sentence-transformers config)" if st.pooling_type else "")
    return resolved


def check_dimensions(model_config: ModelConfig, dimensions: int) -> None:
    """vLLM's rule: `dimensions` only for Matryoshka models, within their sizes."""
    if not model_config.is_matryoshka:
        raise ValueError(f"Model {model_config.served_model_name!r} does not support matryoshka "
                         f"representation, changing output dimensions will lead to poor "
                         f"results.")
    allowed = model_config.hf_config.get("matryoshka_dimensions")
    if allowed and dimensions not in allowed:
        raise ValueError(f"Model {model_config.served_model_name!r} only supports "
                         f"dimensions {list(allowed)}, got {dimensions}.")
    if not 1 <= dimensions <= model_config.hidden_size:
        raise ValueError(f"dimensions must be between 1 and the hidden size "
                         f"{model_config.hidden_size}, got {dimensions}.")
