"""Makes the llama.cpp-quantized fixtures next to this file (tests/model/test_gguf_llamacpp.py
reads them; CI cannot build llama.cpp, so they are committed):

    tiny-llama-256.{Q4_K_M,Q5_K_M,Q8_0}.gguf

The recipe: a random Llama written by transformers (CONFIG, torch seed SEED, biases / norms
perturbed as tests/conftest.py's build_hf_checkpoint does) with the demo's byte-level BPE
tokenizer (kvserve.model.demo.train_demo_tokenizer), converted to an F32 GGUF the way the tests
write GGUF files (tests/model/gguf_files.write_gguf: llama.cpp's tensor names and q/k row
permutation), then quantized by llama.cpp's own quantizer (llama_cpp.llama_model_quantize,
LLAMA_FTYPE_MOSTLY_<type>, no imatrix). hidden 256 lets the K-quants apply to the attention
and gate / up rows; intermediate 320 is not a multiple of 256, so llama.cpp stores ffn_down as
the K-quants' fallbacks (Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K), as it does for
SmolLM2's 576-wide rows. The files record llama.cpp's version in general.quantized_by.

    pip install llama-cpp-python    # builds llama.cpp from source
    python tests/data/make_llamacpp_fixtures.py [--out tests/data]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

SEED = 29
CONFIG = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=320, vocab_size=1024, max_position_embeddings=512,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              rms_norm_eps=1e-6)
FTYPES = ("Q4_K_M", "Q5_K_M", "Q8_0")
STEM = "tiny-llama-256"


def fixture_path(ftype: str, out_dir: str = HERE) -> str:
    return os.path.join(out_dir, f"{STEM}.{ftype}.gguf")


def build_checkpoint(out_dir: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvserve.model.demo import train_demo_tokenizer

    train_demo_tokenizer(out_dir, model_max_length=CONFIG["max_position_embeddings"])
    # The vocabulary is the tokenizer's own size (786 of the 1024 asked): llama.cpp checks that
    # token_embd has a row per listed token.
    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = max([*tok["model"]["vocab"].values(), *(a["id"] for a in tok["added_tokens"])]) + 1
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**CONFIG, "vocab_size": vocab})).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir


def quantize(src: str, out: str, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=HERE)
    p.add_argument("--ftypes", nargs="+", default=list(FTYPES))
    args = p.parse_args()
    from tests.model.gguf_files import write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(os.path.join(tmp, "ckpt"))
        f32 = write_gguf(ckpt, os.path.join(tmp, f"{STEM}.F32.gguf"), "F32")
        for ftype in args.ftypes:
            out = fixture_path(ftype, args.out)
            quantize(f32, out, ftype)
            print(f"{out}: {os.path.getsize(out) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
