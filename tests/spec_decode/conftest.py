"""Checkpoints for the speculative decoding tests."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="session")
def peaked_llama(make_checkpoint: Callable[..., str],
                 tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny_llama's architecture with its LM head scaled x5: next-token distributions are
    peaked (a few likely tokens), so a wrong sampling rule shows in a chi-square test (a
    random model's near-uniform distribution would hide it)."""
    src = make_checkpoint("llama")
    out = str(tmp_path_factory.mktemp("peaked_llama"))
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 5.0
    save_file(tensors, path, metadata={"format": "pt"})
    return out
