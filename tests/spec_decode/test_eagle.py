"""EAGLE speculation: a random EAGLE-Llama head gives greedy outputs identical to a plain run
(chunked prefill, preemption, prefix caching); heads built to predict a "counting" target
exactly accept every draft, one through the hidden-state path and one through the token
embedding path; bad EAGLE checkpoints fail before any process starts."""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.model.eagle import eagle_weight_shapes
from tests.spec_decode.conftest import BASE, GREEDY, prompts
from tests.spec_decode.test_spec_decode import assert_all_blocks_free, assert_spec_metrics_add_up
from tests.utils import random_prompts

K = 3
CHUNKED_PREEMPT = dict(max_num_batched_tokens=64, num_gpu_blocks_override=64, block_size=8)


def eagle_config(path: str, **kw) -> dict:
    # Adaptive rule off: every request drafts every step.
    return {"method": "eagle", "model": path, "num_speculative_tokens": K,
            "disable_by_batch_size": None, "min_acceptance_rate": 0.0, **kw}


def write_eagle_head(out: str, target: str, tensors: dict[str, torch.Tensor]) -> str:
    """An EAGLE-Llama checkpoint in vLLM's layout: the target's Llama config with one layer,
    `fc.weight`, `layers.0.*` (no `model.` prefix), optional own embed_tokens / lm_head."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def layer_tensors(target: str, gen: torch.Generator, zero_out: bool) -> dict[str, torch.Tensor]:
    """Decoder layer 0 with the target's shapes: random, or with o_proj and down_proj zero
    (attention and MLP add nothing: the layer is the identity on its input)."""
    src = load_file(os.path.join(target, "model.safetensors"))
    out = {}
    for name, t in src.items():
        if not name.startswith("model.layers.0."):
            continue
        short = name[len("model."):]
        if "norm" in short:
            out[short] = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
        elif zero_out and ("o_proj" in short or "down_proj" in short):
            out[short] = torch.zeros(t.shape)
        else:
            out[short] = 0.1 * torch.randn(t.shape, generator=gen)
    return out


# Half the baseline's tokens (a random head drafts K tokens per step for nothing: slow).
SHORT = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens // 2, ignore_eos=True)


def assert_same_prefix(baseline: list, outs: list, what: str) -> None:
    """Greedy tokens equal to the first SHORT.max_tokens of the plain run's."""
    assert len(baseline) == len(outs)
    for i, (b, o) in enumerate(zip(baseline, outs)):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids[:SHORT.max_tokens], \
            f"{what}: request {i} differs"


@pytest.fixture(scope="module")
def random_head(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random head for tiny_llama, with fc.bias and an (unused) layer-0 input_layernorm."""
    gen = torch.Generator().manual_seed(3)
    h = 64
    tensors = layer_tensors(tiny_llama, gen, zero_out=False)
    tensors["fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    tensors["fc.bias"] = 0.1 * torch.randn(h, generator=gen)
    return write_eagle_head(str(tmp_path_factory.mktemp("eagle_random")), tiny_llama, tensors)


@pytest.mark.parametrize("kw", [dict(), CHUNKED_PREEMPT], ids=["plain-prefix", "chunked-preempt"])
def test_random_head_greedy_identical(tiny_llama: str, random_head: str, baseline: list,
                                      kw: dict) -> None:
    llm = LLM(tiny_llama, **BASE, **kw, speculative_config=eagle_config(random_head))
    outs = llm.generate(prompts(), SHORT, use_tqdm=False)
    assert_same_prefix(baseline, outs, f"random EAGLE head {kw}")
    if not kw:   # prefix cache hits (a pool small enough to preempt keeps no prefixes)
        second = llm.generate(prompts(), SHORT, use_tqdm=False)
        assert_same_prefix(baseline, second, f"random EAGLE head {kw} (again)")
    spec = assert_spec_metrics_add_up(llm, min_accepted=0)
    # Every step drafted K tokens (fewer only where max_tokens / max_model_len cut them).
    assert spec["num_draft_tokens"] > 0.9 * K * spec["num_drafts"], spec
    stats = llm.get_stats()
    if kw:
        assert stats["num_preemptions"] > 0, stats
    else:
        assert stats["prefix_cache_hits"] > 0, stats
    assert_all_blocks_free(llm)
    llm.shutdown()


# ---------------------------------------------------------------- heads that must accept
V, H = 1024, 64
OMEGA = 2 * math.pi * torch.arange(1, H // 2 + 1, dtype=torch.float64) / V


def rotary_embeddings() -> torch.Tensor:
    """E[t] = (cos w_j t, sin w_j t)_j: E[t] . E[s] is maximal (H / 2) exactly when s == t."""
    t = torch.arange(V, dtype=torch.float64)[:, None]
    return torch.stack([torch.cos(OMEGA * t), torch.sin(OMEGA * t)], dim=-1).reshape(V, H)


def shift(by: int) -> torch.Tensor:
    """R with R @ E[t] = E[t + by] (a rotation per (cos, sin) pair)."""
    c, s = torch.cos(OMEGA * by), torch.sin(OMEGA * by)
    r = torch.zeros(H, H, dtype=torch.float64)
    r[0::2, 0::2] = torch.diag(c)
    r[0::2, 1::2] = torch.diag(-s)
    r[1::2, 0::2] = torch.diag(s)
    r[1::2, 1::2] = torch.diag(c)
    return r


@pytest.fixture(scope="module")
def counting_llama(make_checkpoint: Callable[..., str],
                   tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer Llama whose greedy next token is always token + 1 (mod vocab): attention
    and MLP add nothing (o_proj, down_proj zero), the final norm is 1, the embedding is
    E above and lm_head row s is E[s - 1]. Its final hidden state at p is sqrt(2) E[t_p]."""
    src = make_checkpoint("llama", num_hidden_layers=1)
    out = str(tmp_path_factory.mktemp("counting_llama"))
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), out)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    emb = rotary_embeddings()
    t["model.embed_tokens.weight"] = emb.float()
    t["lm_head.weight"] = torch.roll(emb, 1, dims=0).float()
    t["model.layers.0.self_attn.o_proj.weight"].zero_()
    t["model.layers.0.mlp.down_proj.weight"].zero_()
    t["model.norm.weight"].fill_(1.0)
    save_file(t, path, metadata={"format": "pt"})
    return out


def oracle_head(path: str, target: str, via: str) -> str:
    """A head whose drafts are the counting target's next tokens, through one input only.

    via="hidden": fc = [0 | R / sqrt(2)] maps the target's hidden state at p (sqrt(2) E[t_p])
      to E[t_p + 1]; the identity layer and the target's lm_head then draft t_p + 2 = the
      token after t_{p+1}. Its own embed_tokens is random (fc ignores it).
    via="embed": fc = [R^-1 | 0] maps embed(t_{p+1}) to E[t_{p+1} - 1]; its own lm_head (row
      s = E[s - 2]) drafts t_{p+1} + 1.
    Either way a wrong hidden state / token / position in the head's input, a skipped fc, or
    the wrong input for drafts 2..k makes drafts wrong."""
    gen = torch.Generator().manual_seed(5)
    tensors = layer_tensors(target, gen, zero_out=True)
    fc = torch.zeros(H, 2 * H, dtype=torch.float64)
    emb = rotary_embeddings()
    if via == "hidden":
        fc[:, H:] = shift(1) / math.sqrt(2)
        tensors["embed_tokens.weight"] = torch.randn(V, H, generator=gen)
    else:
        fc[:, :H] = shift(-1)
        tensors["lm_head.weight"] = torch.roll(emb, 2, dims=0).float()
    tensors["fc.weight"] = fc.float()
    return write_eagle_head(path, target, tensors)


def attention_oracle_head(path: str, target: str, dist: int) -> str:
    """A head whose draft comes through its attention to the KV `dist` positions back (the
    text counts up from the prompt's first token, so t_{p+1} = t_{p+1-dist} + dist).

    fc = [eps R^-5 | 0]: x[p] = eps E[t_{p+1} - 5], whose argmax alone is a wrong draft.
    q and k are constant (biases only); rotary turns their dot product into
    lam * sum_i cos(theta_i (p - j - dist)), largest at j = p - dist: each head attends there
    only. v = R^5 / eps x = E[t_{j+1}], so the attention returns E[t_{p+1-dist}]; o_proj =
    R^dist makes it E[t_{p+1}], and the target's lm_head drafts t_{p+1} + 1.
    dist 1: drafts 2..k read the KV the previous draft wrote; dist 5: the step's last
    position reads KV of an earlier step (a step accepts at most 4). A KV slot written at the
    wrong place, a wrong context length or position makes drafts wrong."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    heads, hd = cfg["num_attention_heads"], H // cfg["num_attention_heads"]
    base = float(cfg.get("rope_theta", 10000.0))
    theta = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    d = torch.arange(0, 512, dtype=torch.float64)
    score = torch.cos(theta[None, :] * (d[:, None] - dist)).sum(dim=1)
    gap = float(hd // 2 - torch.cat([score[:dist], score[dist + 1:]]).max())   # runner-up
    assert gap > 0.3, gap
    a = math.sqrt(30.0 / gap * math.sqrt(hd))        # lam * gap = 30 (scale 1 / sqrt(hd))
    half = hd // 2
    q_head, k_head = torch.zeros(hd, dtype=torch.float64), torch.zeros(hd, dtype=torch.float64)
    q_head[:half], q_head[half:] = a * torch.cos(-dist * theta), a * torch.sin(-dist * theta)
    k_head[:half] = a
    eps = 0.1
    gen = torch.Generator().manual_seed(6)
    tensors = layer_tensors(target, gen, zero_out=True)
    zeros = torch.zeros(H, H, dtype=torch.float64)
    tensors.update({
        "layers.0.self_attn.q_proj.weight": zeros, "layers.0.self_attn.k_proj.weight": zeros,
        "layers.0.self_attn.q_proj.bias": q_head.repeat(heads),
        "layers.0.self_attn.k_proj.bias": k_head.repeat(heads),
        "layers.0.self_attn.v_proj.weight": shift(5) / eps,
        "layers.0.self_attn.v_proj.bias": torch.zeros(H),
        "layers.0.self_attn.o_proj.weight": shift(dist),
        "layers.0.self_attn.o_proj.bias": torch.zeros(H),
        "fc.weight": torch.cat([eps * shift(-5), zeros], dim=1)})
    tensors = {k: v.float() for k, v in tensors.items()}
    write_eagle_head(path, target, tensors)
    with open(os.path.join(path, "config.json")) as f:   # one KV head per query head
        cfg = json.load(f)
    cfg.update(num_key_value_heads=heads, attention_bias=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("via", ["hidden", "embed", "attention1", "attention5"])
def test_oracle_head_accepts_every_draft(counting_llama: str, via: str, tmp_path) -> None:
    head = (attention_oracle_head(str(tmp_path / "head"), counting_llama, int(via[-1]))
            if via.startswith("attention") else
            oracle_head(str(tmp_path / "head"), counting_llama, via))
    # A pool of 24 blocks (192 tokens) for 8 requests of up to 83: preemption.
    llm = LLM(counting_llama, **dict(BASE, max_model_len=128),
              **dict(CHUNKED_PREEMPT, num_gpu_blocks_override=24),
              speculative_config=eagle_config(head))
    # Counting prompts: the whole text counts up (the attention heads look back into it).
    ps = [[(p[0] + i) % V for i in range(len(p))]
          for p in random_prompts(8, 10, 60, vocab=V, seed=7)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SHORT, use_tqdm=False)
    for p, o in zip(ps, outs):   # the target counts up from the prompt's last token
        want = [(p[-1] + i) % V for i in range(1, SHORT.max_tokens + 1)]
        assert o.outputs[0].token_ids == want
    spec = assert_spec_metrics_add_up(llm, min_accepted=50)
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], spec
    assert spec["num_accepted_tokens_per_pos"][0] == spec["num_drafts"], spec
    assert llm.get_stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


# ---------------------------------------------------------------- bad input
def test_bad_eagle_configs_fail_before_start(tiny_llama: str, random_head: str,
                                             make_checkpoint: Callable[..., str],
                                             tmp_path) -> None:
    narrow = make_checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1)
    gen = torch.Generator().manual_seed(0)
    own_vocab = dict(layer_tensors(tiny_llama, gen, zero_out=False),
                     **{"fc.weight": torch.zeros(64, 128),
                        "embed_tokens.weight": torch.zeros(512, 64)})
    bad_vocab = write_eagle_head(str(tmp_path / "vocab"), tiny_llama, own_vocab)
    no_config = str(tmp_path / "no_config")
    shutil.copytree(random_head, no_config)
    os.remove(os.path.join(no_config, "config.json"))
    no_weights = str(tmp_path / "no_weights")
    shutil.copytree(random_head, no_weights)
    os.remove(os.path.join(no_weights, "model.safetensors"))
    cases = [
        ({"method": "eagle"}, "needs 'model'"),
        (eagle_config(str(tmp_path / "missing")), "EAGLE checkpoint .* not found"),
        (eagle_config(no_config), "not found: .* has no config.json"),
        (eagle_config(no_weights), "No weights"),
        (eagle_config(narrow), "hidden_size \\(32\\) differs"),
        (eagle_config(tiny_llama), "no fc.weight"),           # a plain Llama, not a head
        (eagle_config(bad_vocab), "embed_tokens.weight has 512 rows"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama, **BASE, speculative_config=cfg)
    # EAGLE's own releases ship pytorch_model.bin: read the same (headers only at validation).
    as_bin = str(tmp_path / "bin")
    shutil.copytree(random_head, as_bin)
    os.remove(os.path.join(as_bin, "model.safetensors"))
    tensors = load_file(os.path.join(random_head, "model.safetensors"))
    torch.save(tensors, os.path.join(as_bin, "pytorch_model.bin"))
    config = EngineArgs(model=tiny_llama, max_model_len=512,
                        speculative_config=eagle_config(as_bin)).create_engine_config()
    assert config.speculative_config.method == "eagle"
    assert eagle_weight_shapes(as_bin) == eagle_weight_shapes(random_head)
