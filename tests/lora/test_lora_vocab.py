"""LoRA on the token embedding and the LM head (PEFT's `embed_tokens` / `lm_head` targets):
in one mixed batch of an adapter on embed_tokens + lm_head + attention, one on lm_head only
(rsLoRA), one without either, and base requests, every request's greedy tokens and logprobs
equal the PEFT model's; prompt logprobs go through the LM head's LoRA too; a tied-embedding
model works the same way (PEFT keeps separate LoRA weights for the tied embedding and head).

The base checkpoint's LM head is scaled (peaked distributions), so greedy picks are clear."""
from __future__ import annotations


import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import check_against_peft, make_peft_adapter, peft_greedy
from tests.utils import peaked_copy, random_prompts

LOGPROB_ATOL = 1e-4
MAX_TOKENS = 6
ENGINE_ARGS = dict(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
                   block_size=8, max_num_batched_tokens=48, max_model_len=96,
                   multiprocessing=False)
# name -> (rank, alpha, rslora, target modules, seed)
VOCAB_ADAPTERS = {
    "embed_head_qv": (8, 16, False, ["embed_tokens", "lm_head", "q_proj", "v_proj"], 11),
    "head_rs": (16, 8, True, ["lm_head"], 12),
    "attn_only": (4, 8, False, ["k_proj", "o_proj"], 13),
}


@pytest.fixture(scope="module")
def peaked(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return peaked_copy(tiny_llama, str(tmp_path_factory.mktemp("lora_peaked")))


@pytest.fixture(scope="module")
def adapters(peaked: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_vocab_adapters")
    return {name: make_peft_adapter(peaked, str(root / name), *spec)
            for name, spec in VOCAB_ADAPTERS.items()}


def _peft_prompt_logprobs(base: str, adapter: str, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i+1] | prompt[:i+1]) from the PEFT model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def _check(base: str, outs, prompts, lora_list) -> None:
    check_against_peft(base, outs, prompts, lora_list, MAX_TOKENS, LOGPROB_ATOL)


@pytest.fixture(scope="module")
def mixed_run(peaked: str, adapters: dict[str, str]):
    """One engine, one mixed batch: (prompts, per-request LoRA, outputs, prompt-logprob output)."""
    loras = [LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(VOCAB_ADAPTERS)]
    prompts = random_prompts(6, 12, 60, 1000, seed=21)
    # Two requests of the embedding + head adapter (one chunked), the others once, base twice.
    lora_list = [loras[0], None, loras[1], loras[2], loras[0], None]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(peaked, **ENGINE_ARGS) as llm:
        outs = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        plp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        scored = llm.generate([prompts[2], prompts[1]], plp, lora_request=[loras[0], None],
                              use_tqdm=False)[0]
    return prompts, lora_list, outs, scored


def test_embedding_and_lm_head_lora_match_peft(peaked: str, adapters: dict[str, str],
                                               mixed_run) -> None:
    prompts, lora_list, outs, scored = mixed_run
    _check(peaked, outs, prompts, lora_list)
    # The vocab adapters change the answers (their B is not zero).
    base_ref = peft_greedy(peaked, None, [prompts[0], prompts[2]], MAX_TOKENS)
    assert outs[0].outputs[0].token_ids != base_ref[0][0]
    assert outs[2].outputs[0].token_ids != base_ref[1][0]
    ref = _peft_prompt_logprobs(peaked, adapters["embed_head_qv"], prompts[2])
    got = torch.tensor([d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], prompts[2][1:])])
    assert (got - ref).abs().max() < LOGPROB_ATOL


def test_tied_embeddings(make_checkpoint, tmp_path) -> None:
    """Tied embedding and LM head: the base weight is shared, each LoRA is its own."""
    tied = make_checkpoint("llama", tie_word_embeddings=True)
    path = make_peft_adapter(tied, str(tmp_path / "tied"), 8, 16, False,
                             ["embed_tokens", "lm_head", "up_proj"], 14)
    prompts = random_prompts(3, 10, 30, 1000, seed=22)
    lora = LoRARequest("tied", 1, path)
    lora_list = [lora, None, lora]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(tied, **{**ENGINE_ARGS, "max_loras": 1}) as llm:
        outs = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
    _check(tied, outs, prompts, lora_list)


def test_async_scheduling_equals_sync(peaked: str, mixed_run) -> None:
    """--async-scheduling with a mixed LoRA batch (no logprobs: the async sampling path):
    the synchronous engine's tokens."""
    prompts, lora_list, outs, _ = mixed_run
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(peaked, **ENGINE_ARGS, async_scheduling=True) as llm:
        again = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
    for i, (a, b) in enumerate(zip(again, outs)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
