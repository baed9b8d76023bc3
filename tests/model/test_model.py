"""kvserve's model code against Hugging Face transformers on the same checkpoint directories.

Every comparison runs the kvserve model through the paged-attention path the engine uses
(flattened tokens, slot mapping, block tables) and checks the logits at every position
against `AutoModelForCausalLM` run on the whole sequence.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.attention.backends.cpu import AttentionMetadata, CpuAttentionBackend
from kvserve.config import ModelConfig
from kvserve.model import demo
from kvserve.model.layers.attention import bind_attention_backend
from kvserve.model.loader import get_kv_cache_shape, load_model, num_kv_heads_per_rank
from kvserve.model.registry import get_model_class
from kvserve.ops import cpu_weight as cw
from kvserve.ops.linear import pack_weight
from kvserve.ops.prefill_attention import stack_block_tables

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 40


# --------------------------------------------------------------------------------------------
# Helpers


def model_config(path: str, dtype: str = "float32") -> ModelConfig:
    return ModelConfig.from_path(path, tokenizer=None, served_model_name=None, dtype=dtype,
                                 max_model_len=None, seed=0, max_logprobs=20, device="cpu")


def load(path: str, dtype: str = "float32",
         plan: "cw.WeightPlan | None" = None) -> tuple[torch.nn.Module, ModelConfig]:
    """The model on CPU; `plan`: the weights' variant (None: the policy's choice)."""
    cfg = model_config(path, dtype)
    model = load_model(cfg, torch.device("cpu"), plan)
    bind_attention_backend(model, CpuAttentionBackend(torch.device("cpu")))
    return model, cfg


@torch.inference_mode()
def hf_logits(path: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf(s[None]).logits[0].float() for s in seqs]


def kv_caches(cfg: ModelConfig, dtype: torch.dtype, fill: str = "zeros",
              tp_size: int = 1) -> list[torch.Tensor]:
    shape = get_kv_cache_shape(cfg, NUM_BLOCKS, BLOCK_SIZE, tp_size)
    gen = torch.Generator().manual_seed(1)
    if fill == "zeros":
        return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
    # Garbage in unused slots, as in a reused block: reading past a sequence's end shows up.
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(cfg.num_layers)]


@dataclass
class Seq:
    tokens: torch.Tensor      # every token the sequence will ever hold (prompt + continuation)
    blocks: list[int]         # its block table

    def slots(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(self.blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


@torch.inference_mode()
def assert_steps_bit_identical(fused: torch.nn.Module, plain: torch.nn.Module,
                               cfg: ModelConfig, cache_dtype: torch.dtype,
                               schedule: list) -> None:
    """Run `schedule` ([(decodes, prefill chunks)] as run_step takes them) on both models from
    the same garbage-filled KV caches: logits and every layer's cache equal bit for bit."""
    caches_f = kv_caches(cfg, cache_dtype, fill="garbage")
    caches_p = [t.clone() for t in caches_f]
    for step, (decodes, prefills) in enumerate(schedule):
        out_f = run_step(fused, caches_f, decodes=decodes, prefills=prefills)
        out_p = run_step(plain, caches_p, decodes=decodes, prefills=prefills)
        assert torch.equal(out_f, out_p), (step, (out_f - out_p).abs().max().item())
        assert all(torch.equal(x, y) for x, y in zip(caches_f, caches_p)), step


def run_step(model: torch.nn.Module, caches: list[torch.Tensor],
             decodes: list[tuple[Seq, int]] = (),
             prefills: list[tuple[Seq, int, int]] = ()) -> torch.Tensor:
    """One engine step. decodes: (seq, position of its one new token); prefills: (seq, start,
    end) chunks. Tokens are laid out decodes first, then prefill chunks. Returns logits [T, V]."""
    ids, positions, slots = [], [], []
    for seq, p in decodes:
        ids.append(seq.tokens[p:p + 1])
        positions.append(torch.tensor([p]))
        slots.append(seq.slots(p, p + 1))
    starts, offset = [], len(decodes)
    for seq, s, e in prefills:
        ids.append(seq.tokens[s:e])
        positions.append(torch.arange(s, e))
        slots.append(seq.slots(s, e))
        starts.append(offset)
        offset += e - s
    meta = AttentionMetadata(
        num_decode_tokens=len(decodes), slot_mapping=torch.cat(slots), block_size=BLOCK_SIZE,
        **prefill_metadata(starts, prefills))
    if decodes:
        # Pad block tables with block 0, which belongs to another sequence: the seq_lens mask
        # must hide it.
        width = max(len(seq.blocks) for seq, _ in decodes)
        tables = torch.zeros(len(decodes), width, dtype=torch.long)
        for i, (seq, _) in enumerate(decodes):
            tables[i, :len(seq.blocks)] = torch.tensor(seq.blocks)
        seq_lens = torch.tensor([p + 1 for _, p in decodes])
        meta.decode_block_tables, meta.decode_seq_lens = tables, seq_lens
    hidden = model(torch.cat(ids), torch.cat(positions), caches, meta)
    return model.compute_logits(hidden)


def random_tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def blocks_for(n_tokens: int, pool: list[int]) -> list[int]:
    """Take enough blocks for n_tokens off the front of `pool` (plus one spare, unused)."""
    n = -(-n_tokens // BLOCK_SIZE) + 1
    taken, pool[:] = pool[:n], pool[n:]
    return taken


def shuffled_blocks(seed: int = 0) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"max |kvserve - HF| = {err:.3g} > {atol}"


def prefill_metadata(starts: list[int], prefills: list) -> dict:
    if not prefills:
        return {}
    return dict(
        prefill_query_starts=torch.tensor(starts),
        prefill_query_lens=torch.tensor([e - s for _, s, e in prefills]),
        prefill_context_lens=torch.tensor([s for _, s, _ in prefills]),
        prefill_block_tables=stack_block_tables([torch.tensor(seq.blocks)
                                                 for seq, _, _ in prefills]))


def check_prefill(path: str, prompt_len: int = 40) -> None:
    """(a) one whole prompt, one chunk, context 0."""
    model, cfg = load(path)
    seq = Seq(random_tokens(prompt_len, 0, cfg.vocab_size), blocks_for(prompt_len, shuffled_blocks()))
    (ref,) = hf_logits(path, [seq.tokens])
    logits = run_step(model, kv_caches(cfg, torch.float32), prefills=[(seq, 0, prompt_len)])
    assert_close(logits, ref)


def check_chunked_and_batched_decode(path: str, plan: "cw.WeightPlan | None" = None) -> None:
    """(b) chunked prefill with a cached prefix, a mixed step, then batched decodes."""
    model, cfg = load(path, plan=plan)
    prompt_lens, n_decode = [13, 6, 21], 4
    pool = shuffled_blocks(1)
    seqs = [Seq(random_tokens(n + n_decode, 10 + i, cfg.vocab_size), blocks_for(n + n_decode, pool))
            for i, n in enumerate(prompt_lens)]
    refs = hf_logits(path, [s.tokens for s in seqs])
    a, b, c = seqs
    la, lb, lc = prompt_lens
    caches = kv_caches(cfg, torch.float32, fill="garbage")

    # Step 1: A's first chunk and all of B, two prefills in one forward.
    out = run_step(model, caches, prefills=[(a, 0, 7), (b, 0, lb)])
    assert_close(out[:7], refs[0][:7])
    assert_close(out[7:], refs[1][:lb])
    # Step 2: B decodes while A's second chunk (context 7) and all of C prefill.
    out = run_step(model, caches, decodes=[(b, lb)], prefills=[(a, 7, la), (c, 0, lc)])
    assert_close(out[0], refs[1][lb])
    assert_close(out[1:1 + la - 7], refs[0][7:la])
    assert_close(out[1 + la - 7:], refs[2][:lc])
    # Steps 3..: three decodes of different lengths in one forward (teacher-forced tokens).
    pos = {0: la, 1: lb + 1, 2: lc}
    for _ in range(n_decode - 1):
        out = run_step(model, caches, decodes=[(seqs[i], pos[i]) for i in range(3)])
        assert out.shape == (3, cfg.vocab_size)
        for i in range(3):
            assert_close(out[i], refs[i][pos[i]])
            pos[i] += 1


# --------------------------------------------------------------------------------------------
# Architectures against transformers

CHECKPOINTS: dict[str, Callable[[Callable[..., str]], str]] = {
    "llama": lambda make: make("llama"),
    "mistral": lambda make: make("mistral"),
    "qwen2": lambda make: make("qwen2"),
    "qwen3": lambda make: make("qwen3", head_dim=32),
    "llama-tied": lambda make: make("llama", tie_word_embeddings=True),
    "llama-bias": lambda make: make("llama", attention_bias=True, mlp_bias=True),
    "llama-rope-llama3": lambda make: make(
        "llama", rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-sharded": lambda make: make("llama", max_shard_size="100KB"),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_prefill_matches_hf(name: str, make_checkpoint: Callable[..., str]) -> None:
    # The llama3 rope case runs past original_max_position_embeddings (64) so every
    # frequency band, scaled and unscaled, takes part.
    check_prefill(CHECKPOINTS[name](make_checkpoint),
                  prompt_len=150 if "rope" in name else 40)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "llama-tied",
                                  "llama-rope-llama3"])
def test_chunked_prefill_and_batched_decode_match_hf(name: str,
                                                     make_checkpoint: Callable[..., str]) -> None:
    check_chunked_and_batched_decode(CHECKPOINTS[name](make_checkpoint))


def test_checkpoint_variants_are_what_they_claim(make_checkpoint: Callable[..., str]) -> None:
    sharded = make_checkpoint("llama", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    model, _ = load(make_checkpoint("llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if pack_weight(torch.zeros(8, 8)) is not None:
        # CPU: linear layers keep oneDNN's prepacked weight, and the plain one only for the
        # small-batch kernel (prepacked+copy); the tied LM head's object is the embedding's,
        # and a prepacked-only one leaves the embedding's weight in place.
        qkv = model.model.layers[0].self_attn.qkv_proj.linear_weight
        assert qkv.variant in (cw.PREPACKED, cw.PREPACKED_WITH_COPY) and qkv.packed is not None
        assert (qkv.streamed() is not None) == (qkv.variant == cw.PREPACKED_WITH_COPY)
        assert model.lm_head.linear_weight is model.model.embed_tokens.linear_weight
        assert model.lm_head.linear_weight.packed is not None
        assert model.model.embed_tokens.weight.numel() > 0
    model, _ = load(make_checkpoint("qwen3", head_dim=32))
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)


@pytest.mark.parametrize("variant", [cw.PREPACKED, cw.PREPACKED_WITH_COPY])
@pytest.mark.parametrize("name", ["llama-tied", "llama-bias"])
def test_small_batch_copies_match_hf(variant: str, name: str,
                                     make_checkpoint: Callable[..., str]) -> None:
    """Prepacked weights with and without the plain copies for small batches (the policy
    keeps them for float32 on the vector tiers): both match transformers through prefills
    (packed) and batched decodes (the small-batch kernel)."""
    path = CHECKPOINTS[name](make_checkpoint)
    model, _ = load(path, plan=cw.WeightPlan(variant))
    linears = [model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.down_proj]
    if pack_weight(torch.zeros(8, 8)) is not None:
        assert all(m.linear_weight.variant == variant for m in [*linears, model.lm_head])
        assert all((m.weight.numel() > 0) == (variant == cw.PREPACKED_WITH_COPY)
                   for m in linears)
    check_chunked_and_batched_decode(path, plan=cw.WeightPlan(variant))


def test_bfloat16_close_to_float32(tiny_llama: str) -> None:
    m32, cfg = load(tiny_llama, "float32")
    m16, _ = load(tiny_llama, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    seq = Seq(random_tokens(30, 3, cfg.vocab_size), blocks_for(30, shuffled_blocks()))
    ref = run_step(m32, kv_caches(cfg, torch.float32), prefills=[(seq, 0, 30)])
    out = run_step(m16, kv_caches(cfg, torch.bfloat16), prefills=[(seq, 0, 30)])
    assert out.dtype == torch.float32
    err = (out - ref).abs().max().item()
    assert err < 0.1 * ref.abs().max().item(), err
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_kv_cache_shape_helpers(tiny_llama: str, tiny_qwen3: str) -> None:
    cfg = model_config(tiny_llama)                       # 2 KV heads, head_dim 16
    assert get_kv_cache_shape(cfg, 10, 16, 1) == (2, 10, 16, 2, 16)
    assert num_kv_heads_per_rank(cfg, 2) == 1
    assert num_kv_heads_per_rank(cfg, 4) == 1            # replicated
    assert get_kv_cache_shape(model_config(tiny_qwen3), 3, 8, 2) == (2, 3, 8, 1, 32)


# --------------------------------------------------------------------------------------------
# The demo model


def test_random_demo_model_builds_once_and_matches_hf(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    paths: list[str] = []
    # Two concurrent first uses: both get the same complete directory, no temp dirs remain.
    threads = [threading.Thread(
        target=lambda: paths.append(demo.resolve_model_path(demo.DEMO_RANDOM))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 2 and paths[0] == paths[1]
    path = paths[0]
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    assert f"demo-v{demo.DEMO_VERSION}-" in os.path.basename(path)
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert demo.resolve_model_path("demo-random") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size()
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (256, 4, 8, 4, 688)
    assert config["vocab_size"] == vocab and config["torch_dtype"] == "float32"
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == demo.EOS_ID
    check_prefill(path, prompt_len=24)


def test_build_random_checkpoint_is_deterministic_and_loads_in_hf(tmp_path) -> None:
    kw = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
              seed=5, extra_config={"head_dim": 16, "attention_bias": True})
    p1 = demo.build_random_checkpoint(str(tmp_path / "a"), "qwen3", **kw)
    p2 = demo.build_random_checkpoint(str(tmp_path / "b"), "qwen3", **kw)
    t1, t2 = (load_file(os.path.join(p, "model.safetensors")) for p in (p1, p2))
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)
    assert "model.layers.0.self_attn.o_proj.bias" in t1
    assert "model.layers.0.self_attn.k_norm.weight" in t1
    check_prefill(p1, prompt_len=12)
    for arch in ("mistral", "qwen2"):
        check_prefill(demo.build_random_checkpoint(
            str(tmp_path / arch), arch, hidden_size=32, num_layers=1, num_heads=4,
            num_kv_heads=1, intermediate_size=64, tie_word_embeddings=True), prompt_len=12)


# --------------------------------------------------------------------------------------------
# Errors


def copy_checkpoint(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(path: str, edit: Callable[[dict], None]) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture(tiny_llama: str, tmp_path) -> None:
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["FancyNewForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as exc:
        load(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(exc.value)
        assert get_model_class(name).__name__ == name


def test_missing_weights_files(tiny_llama: str, tiny_llama_sharded: str, tmp_path) -> None:
    path = copy_checkpoint(tiny_llama, tmp_path / "single")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(path)
    path = copy_checkpoint(tiny_llama_sharded, tmp_path / "sharded")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
     "model.layers.0.self_attn.extra.weight' matches no parameter"),
    (lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"),
     "no weights for 1 parameter.*model.layers.1.self_attn.qkv_proj.weight"),
    (lambda t: t.pop("model.norm.weight"), "no weights for 1 parameter.*model.norm.weight"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64)}),
     "up_proj.weight.*shape"),
])
def test_checkpoint_not_matching_the_model(tiny_llama: str, tmp_path, edit, message) -> None:
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=message):
        load(path)


def test_unsupported_model_paths_and_rope(tmp_path, tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="cannot download models"):
        demo.resolve_model_path("meta-llama/Llama-3.2-1B")
    assert demo.resolve_model_path(os.path.relpath(tiny_llama)) == os.path.abspath(tiny_llama)
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        load(path)


# --------------------------------------------------------------------------------------------
# Tensor parallelism: the same logits from 2 ranks (gloo, one process per rank) as from one.


def tp_scenario(path: str, tp_size: int) -> dict[str, torch.Tensor]:
    """Two prefills, then a decode next to a second chunk; returns both steps' logits."""
    model, cfg = load(path)
    caches = kv_caches(cfg, torch.float32, tp_size=tp_size)
    assert caches[0].shape[3] == num_kv_heads_per_rank(cfg, tp_size)
    a = Seq(random_tokens(11, 20, cfg.vocab_size), [5, 2, 9])
    b = Seq(random_tokens(11, 21, cfg.vocab_size), [0, 7, 3])
    return {"first": run_step(model, caches, prefills=[(a, 0, 10), (b, 0, 6)]),
            "second": run_step(model, caches, decodes=[(a, 10)], prefills=[(b, 6, 11)])}


def _tp_worker(rank: int, world_size: int, init_file: str, path: str, out_file: str) -> None:
    from kvserve.distributed import parallel_state as ps

    torch.set_num_threads(1)
    ps.init_distributed(rank, world_size, f"file://{init_file}", "gloo")
    try:
        assert (ps.get_tp_rank(), ps.get_tp_world_size()) == (rank, world_size)
        logits = tp_scenario(path, world_size)
        if rank == 0:       # every rank holds the full logits; one writes them
            torch.save(logits, out_file)
    finally:
        ps.destroy_distributed()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size, arch, overrides", [
    (2, "qwen2", dict(vocab_size=1001, tie_word_embeddings=True)),   # padded vocab shard, qkv bias
    (2, "llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),  # KV replicated
])
def test_tensor_parallel_matches_single_rank(world_size: int, arch: str, overrides: dict,
                                             tmp_path, make_checkpoint: Callable[..., str]) -> None:
    import torch.multiprocessing as mp

    path = make_checkpoint(arch, **overrides)
    out_file = str(tmp_path / "tp.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_worker,
                         args=(rank, world_size, str(tmp_path / "rendezvous"), path, out_file))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=150)
        assert [p.exitcode for p in procs] == [0] * world_size
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    got = torch.load(out_file)
    expected = tp_scenario(path, 1)
    for key, ref in expected.items():
        assert_close(got[key], ref, atol=2e-5)
