"""The offline LLM API: sampling features, outputs and the error cases."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.utils import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0)


def free_blocks_ok(llm: LLM) -> bool:
    s = llm.get_stats()
    return s["num_free_blocks"] == s["num_total_blocks"] and s["num_running_reqs"] == 0


def test_text_prompts_and_outputs(llm: LLM) -> None:
    outs = llm.generate(["Hello, my name is", "The capital of France is"],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=1),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello, my name is", "The capital of France is"]
    for o in outs:
        assert o.finished and o.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
        c = o.outputs[0]
        assert 1 <= len(c.token_ids) <= 8
        assert c.finish_reason in ("stop", "length")
        assert c.text == llm.get_tokenizer().decode(c.token_ids) or c.finish_reason == "stop"
    assert free_blocks_ok(llm)


def test_seeded_sampling_reproducible_in_any_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("The river", p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(["Other prompt one", "The river", "x y z"], [others, p, others],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
    different = llm.generate("The river", SamplingParams(temperature=1.0, max_tokens=12, seed=99,
                                                         ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_stop_strings(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 10
    stop = full[5:8]
    first = full.find(stop)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=30, stop=stop,
                                                           include_stop_str_in_output=True,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == full[:first + len(stop)]
    assert free_blocks_ok(llm)


def test_stop_token_ids_and_length(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = tokens[4]
    idx = tokens.index(stop_tok)
    out = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok],
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:idx + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    capped = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert capped.token_ids == tokens[:3] and capped.finish_reason == "length"


def test_min_tokens_blocks_stop_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    out = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3,
                                             stop_token_ids=[first], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3


def contains_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    def bad_params(word: str) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[word])

    def tokenized(word: str) -> list[list[int]]:
        request, _ = llm.llm_engine.process_inputs("bw", prompt, bad_params(word))
        return request.sampling_params.bad_words_token_ids
    # A word greedy decoding produces (the random model also emits ids the small tokenizer
    # cannot decode): the first pair of output tokens whose text tokenizes back into a run of
    # the output, preferring two-token words.
    candidates = [tok.decode(base[i:i + 2]).strip() for i in range(len(base) - 1)]
    candidates += [tok.decode(base[i:i + 1]).strip() for i in range(len(base))]
    word = next(w for w in candidates if w and "\ufffd" not in w
                and any(contains_run(base, s) for s in tokenized(w)))
    bad = bad_params(word)
    sequences = tokenized(word)
    assert bad.bad_words_token_ids is None    # the caller's params stay as given
    out = llm.generate(prompt, bad, use_tqdm=False)[0].outputs[0].token_ids
    assert not any(contains_run(out, s) for s in sequences), (out, sequences)
    # Up to the first place a bad word would complete, the output is the plain one.
    first = min(i + len(s) - 1 for s in sequences for i in range(len(base))
                if base[i:i + len(s)] == s)
    assert out[:first] == base[:first] and out[first] != base[first]
    # A word that cannot be tokenized into anything is a clear error.
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(prompt, SamplingParams(max_tokens=2, bad_words=[" "]), use_tqdm=False)
    assert free_blocks_ok(llm)


def test_per_request_settings_in_a_mixed_batch(llm: LLM) -> None:
    """logit_bias, allowed_token_ids, min_tokens and logprobs apply to their own request only,
    in a batch with plain greedy neighbours, and still after a shorter request finishes
    first and the rows are condensed (InputBatch keeps per-row flags for them)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["one two", "three four", "five six", "seven eight"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    forced = 7
    allowed = [11, 12, 13]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),   # ends first
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             logit_bias={forced: 100.0}),
              greedy,
              # The last row: it moves into the first one's row when that request ends.
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=allowed, logprobs=2)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[0].token_ids == plain[0][:3]
    assert outs[1].token_ids == [forced] * 12
    assert outs[2].token_ids == plain[2] and outs[2].logprobs is None
    assert set(outs[3].token_ids) <= set(allowed) and len(outs[3].logprobs) == 12
    assert free_blocks_ok(llm)


def test_n_copies(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5,
                                               ignore_eos=True), use_tqdm=False)
    assert len(out) == 1
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in comps}) > 1
    again = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5,
                                                 ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in comps]
    assert free_blocks_ok(llm)


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0.7, max_tokens=6, logprobs=3, seed=0,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and 3 <= len(pos) <= 4
        assert all(lp.logprob <= 0 for lp in pos.values())
        ranks = sorted(lp.rank for t, lp in pos.items() if t != tok or lp.rank <= 3)
        assert ranks[0] == 1
        total += pos[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_token_id_prompts_and_chat(llm: LLM) -> None:
    ids = random_prompts(1, 5, 5, vocab=1024, seed=3)[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert chat[0].prompt_token_ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_before_scheduling(llm: LLM) -> None:
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        llm.generate(["ok", {"prompt_token_ids": [7] * 300}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    # Nothing was scheduled and the engine still serves.
    assert free_blocks_ok(llm)
    assert llm.generate("still alive", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_unknown_model_and_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="Unknown engine argument"):
        LLM("demo", not_an_arg=1)
