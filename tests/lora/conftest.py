"""Fixtures of the LoRA tests: PEFT adapters (non-zero B) on the tiny random Llama, and the
PEFT model's greedy outputs and logprobs as the reference."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

# name -> (rank, alpha, rslora, target modules, seed)
ADAPTERS: dict[str, tuple[int, int, bool, list[str], int]] = {
    "all7": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"], 1),
    "qv_down_rs": (16, 8, True, ["q_proj", "v_proj", "down_proj"], 2),
    # Also on the embedding and the LM head: the chunked / preempted / TP runs cover them.
    "kogu": (4, 4, False, ["k_proj", "o_proj", "gate_proj", "up_proj", "embed_tokens",
                           "lm_head"], 3),
}


def make_peft_adapter(base_dir: str, out_dir: str, rank: int, alpha: int, rslora: bool,
                      targets: list[str], seed: int, b_std: float = 0.15) -> str:
    """A PEFT LoRA adapter saved by peft itself, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                     init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_adapters")
    return {name: make_peft_adapter(tiny_llama, str(root / name), *spec)
            for name, spec in ADAPTERS.items()}


def peft_greedy(base_dir: str, adapter_dir: Any, prompts: list[list[int]], max_tokens: int
                ) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) per prompt from the PEFT model (adapter_dir None: the
    base model), float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            toks = res.sequences[0, len(ids):].tolist()
            lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(res.scores, toks)]
            out.append((toks, lps))
    return out


def check_against_peft(base: str, outs, prompts: list[list[int]], lora_list: list,
                       max_tokens: int, logprob_atol: float) -> None:
    """Each request's greedy tokens equal PEFT's for its adapter (None: the base model), and
    its chosen tokens' logprobs within logprob_atol; PEFT runs once per adapter."""
    by_adapter: dict = {}
    for i, lr in enumerate(lora_list):
        by_adapter.setdefault(None if lr is None else lr.lora_path, []).append(i)
    for path, idx in by_adapter.items():
        refs = peft_greedy(base, path, [prompts[i] for i in idx], max_tokens)
        for i, (ref_toks, ref_lps) in zip(idx, refs):
            out = outs[i].outputs[0]
            name = "base" if path is None else os.path.basename(path)
            assert out.token_ids == ref_toks, f"request {i} ({name}): {out.token_ids} vs PEFT {ref_toks}"
            got = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]
            err = max(abs(a - b) for a, b in zip(got, ref_lps))
            assert err < logprob_atol, f"request {i} ({name}): logprob error {err}"
