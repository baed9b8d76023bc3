"""GGUF mixture-of-experts files: tiny random Mixtral / Qwen3-MoE checkpoints written as
llama.cpp's converter writes them (experts stacked into ffn_{gate,up,down}_exps [E, ...], the
router ffn_gate_inp kept F32, expert_count / expert_used_count / expert_feed_forward_length
metadata, Mixtral as "llama" with its q/k rows permuted), loaded by kvserve, against
Hugging Face float32 on the same (for Q8_0: round-tripped) weights.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, envs
from kvserve.model.gguf import iterate_gguf_weights, read_gguf_config
from tests.model.gguf_files import (_add_tokenizer, add_model_header, llamacpp_permute, roundtrip,
                                    store_tensor)
from tests.model.test_moe import (MOE_CONFIG, MOE_OVERRIDES, _generate, _prompts,
                                  assert_matches_hf)
from tests.utils import hf_greedy

ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0,
                 multiprocessing=False)
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
# Per-expert checkpoint projection -> llama.cpp's stacked tensor.
EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "down_proj": "ffn_down_exps"}


def write_moe_gguf(ckpt: str, out: str, arch: str, qtype: str = "F32",
                   num_experts: int | None = None,
                   expert_types: dict[str, str] | None = None) -> str:
    """`ckpt` as llama.cpp's convert_hf_to_gguf.py writes an MoE model: per layer, each
    projection's experts stacked in expert order ([E, I, H] / [E, H, I]), matrices stored as
    `qtype`, norms and the router F32. `num_experts` overrides expert_count (a bad file);
    `expert_types` ({"ffn_gate_exps": "Q8_0", ...}) the stacks' types."""
    import gguf

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg["num_key_value_heads"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w = gguf.GGUFWriter(out, GGUF_ARCH[arch])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    # transformers >= 5 writes rope_theta inside rope_parameters (Mixtral's is 1e6).
    rope = cfg.get("rope_parameters") or {}
    add_model_header(w, cfg, n_kv, head_dim,
                     float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    w.add_expert_count(num_experts or experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_tokenizer(w, ckpt, "default")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[arch].upper()], n_layers)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in load_file(os.path.join(ckpt, "model.safetensors")).items():
        if ".experts." in name:
            # model.layers.L.<block>.experts.E.<proj>.weight
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{EXPERT_PARTS[parts[6]]}.weight"
            stacks.setdefault(gguf_name, {})[int(parts[5])] = t
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch == "mixtral" and "q_proj" in name:
            t = llamacpp_permute(t, n_head)
        elif arch == "mixtral" and "k_proj" in name:
            t = llamacpp_permute(t, n_kv)
        router = gguf_name.endswith("ffn_gate_inp.weight")   # llama.cpp keeps it F32
        store_tensor(w, gguf_name, t, qtype if t.dim() == 2 and not router else "F32")
    for gguf_name, by_expert in stacks.items():
        part = gguf_name.split(".")[2]
        store_tensor(w, gguf_name, torch.stack([by_expert[e] for e in range(experts)]),
                     (expert_types or {}).get(part, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def roundtripped_checkpoint(ckpt: str, out: str, qtype: str) -> str:
    """A copy of `ckpt` whose weights are what the `qtype` GGUF file reads back (per row
    blocks: quantizing an expert alone equals quantizing its rows of the stacked tensor)."""
    shutil.copytree(ckpt, out, dirs_exist_ok=True)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({n: (t if ".gate.weight" in n and ".experts." not in n else roundtrip(t, qtype))
               .contiguous() for n, t in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def moe_gguf(make_checkpoint: Callable[..., str], tmp_path_factory) -> Callable[..., str]:
    root = tmp_path_factory.mktemp("gguf_moe")

    def get(arch: str, qtype: str = "F32", **kw) -> str:
        ckpt = make_checkpoint(arch, **MOE_CONFIG, **MOE_OVERRIDES[arch])
        path = str(root / f"{arch}-{qtype}-{len(kw)}.gguf")
        if not os.path.isfile(path):
            write_moe_gguf(ckpt, path, arch, qtype, **kw)
        return path

    return get


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_config_and_expert_tensors_read_back(arch: str, moe_gguf, make_checkpoint) -> None:
    """The metadata becomes the checkpoint's MoE config; every expert matrix reads back as
    the checkpoint's own (Q8_0: round-tripped), under its per-expert name."""
    ckpt = make_checkpoint(arch, **MOE_CONFIG, **MOE_OVERRIDES[arch])
    with open(os.path.join(ckpt, "config.json")) as f:
        want_cfg = json.load(f)
    path = moe_gguf(arch, "Q8_0")
    cfg = read_gguf_config(path)
    assert cfg["architectures"] == want_cfg["architectures"]
    # transformers >= 5 writes num_local_experts for Qwen too; either key is read.
    experts = [c.get("num_experts") or c.get("num_local_experts") for c in (cfg, want_cfg)]
    assert experts[0] == experts[1] == 8
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "intermediate_size"):
        if key in want_cfg:
            assert cfg[key] == want_cfg[key], key
    want = load_file(os.path.join(ckpt, "model.safetensors"))
    got = dict(iterate_gguf_weights(path, cfg))
    renamed = {n.replace(".block_sparse_moe.", ".mlp."): t for n, t in want.items()}
    assert got.keys() == renamed.keys()
    for name, t in got.items():
        if ".experts." in name:
            assert torch.equal(t, roundtrip(renamed[name], "Q8_0")), name
    router = "model.layers.1.mlp.gate.weight"
    assert torch.equal(got[router], renamed[router])          # F32, not quantized


@pytest.mark.parametrize("arch,qtype", [
    ("qwen3_moe", "Q8_0"),
    # Mixtral's file (q/k permuted, "llama" + expert_count) runs with KVSERVE_TEST_FULL=1;
    # CI reads its tensors back in test_config_and_expert_tensors_read_back.
    pytest.param("mixtral", "F16", marks=pytest.mark.skipif(
        not envs.get("KVSERVE_TEST_FULL"), reason="long variant: KVSERVE_TEST_FULL=1"))])
def test_greedy_matches_transformers(arch: str, qtype: str, moe_gguf, make_checkpoint,
                                     tmp_path) -> None:
    ckpt = make_checkpoint(arch, **MOE_CONFIG, **MOE_OVERRIDES[arch])
    same_weights = roundtripped_checkpoint(ckpt, str(tmp_path / "rt"), qtype)
    refs = hf_greedy(same_weights, _prompts(), 10)
    # Dequantized at load, the attention and LM head too: the same float32 math as HF (the
    # packed int8 path quantizes activations; test_gguf_packed.py covers it).
    llm = LLM(moe_gguf(arch, qtype), quantization="gguf-dequantized", **ENGINE_KW)
    assert_matches_hf(refs, _generate(llm), f"{arch} gguf {qtype}")


def test_expert_count_mismatch_is_a_clear_error(moe_gguf) -> None:
    """expert_count says 6, the stacked tensors hold 8 experts."""
    with pytest.raises(ValueError, match=r"ffn_gate_inp.weight has shape \(8, 64\), the "
                                         r"metadata says \(6, 64\)"):
        LLM(moe_gguf("qwen3_moe", num_experts=6), **ENGINE_KW)


def test_expert_parallel_rank_reads_only_its_experts(moe_gguf, monkeypatch) -> None:
    """As EP rank 0 of 2, the file's experts 4-7 are never dequantized (nor yielded)."""
    from kvserve.distributed import parallel_state
    from kvserve.model.moe import Qwen3MoeForCausalLM
    from kvserve.engine.arg_utils import EngineArgs

    path = moe_gguf("qwen3_moe", "Q8_0")
    config = EngineArgs(model=path, device="cpu").create_engine_config().model_config
    monkeypatch.setattr(parallel_state._TP_STATE, "world_size", 2)
    monkeypatch.setattr(parallel_state._TP_STATE, "expert_parallel", True)
    skip = Qwen3MoeForCausalLM.checkpoint_skip(config)
    names = [n for n, _ in iterate_gguf_weights(path, config.hf_config, skip=skip)]
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
    assert experts == {0, 1, 2, 3}
    assert sum(".experts." in n for n in names) == 2 * 4 * 3     # 2 layers x 4 x gate/up/down
