"""Beam search (`LLM.beam_search`, `use_beam_search` on /v1/completions) against references.

The model is tiny_llama with its LM head scaled x5 (peaked next-token distributions, so beams
differ from greedy and candidates are well separated), and one extra EOS id: the second most
likely first token after PROMPT_B, so that EOS candidates appear and the length penalty
decides between beams that ended at different steps.

References:
- `_reference_beam_search`: the same algorithm (vLLM's) run on float64 log-probs from
  `transformers` (a full forward per step, no KV cache), each beam expanded over the whole
  vocabulary: every continuation is scored and the best beam_width kept by the same score.
- the exhaustive top-k of all continuations, where beam search defines the same thing (one
  token, and always for the best beam's score as a bound).
- greedy `generate` (beam_width 1 with ignore_eos) and HF `generate(num_beams=k)`.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Callable, Iterator

import httpx
import openai
import pytest
import torch

from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.entrypoints.beam_search import get_beam_search_score
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.utils import peaked_copy

PROMPT_A = [17, 230, 411, 95, 6, 800, 33, 12, 99, 5, 71, 300, 44, 8, 19, 21, 600, 3, 14, 15]
PROMPT_B = [5, 9, 101, 77, 8]
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0,
                 block_size=16, enable_prefix_caching=True)
TOL = 1e-4      # float32 engine vs float64 reference, on cumulative logprobs


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(make_checkpoint: Callable[..., str],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int]]:
    out = peaked_copy(make_checkpoint("llama"), str(tmp_path_factory.mktemp("beam_llama")))
    first = _logprobs(_hf_model(out), [PROMPT_B])[0]
    extra_eos = int(torch.topk(first, 2).indices[1])
    with open(os.path.join(out, "generation_config.json")) as f:
        gen = json.load(f)
    eos = sorted({int(gen["eos_token_id"]), extra_eos})
    gen["eos_token_id"] = eos
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return out, eos


@pytest.fixture(scope="module")
def hf64(ckpt: tuple[str, list[int]]) -> torch.nn.Module:
    return _hf_model(ckpt[0])


@pytest.fixture(scope="module")
def llm(ckpt: tuple[str, list[int]]) -> Iterator[LLM]:
    engine = LLM(ckpt[0], **ENGINE_KW)
    yield engine
    engine.shutdown()


# ---------------------------------------------------------------------- references
def _hf_model(path: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The reference model is tiny: one thread is as fast, and on a loaded shared machine two
    threads of many tiny ops spin-wait for each other (40x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(before)


def _logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token log-probs (float64) of equally long sequences, one full forward."""
    with _one_thread():
        logits = model(torch.tensor(seqs)).logits[:, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def _score(tokens: list[int], cum: float, eos: list[int], lp: float) -> float:
    """vLLM's score, written out here (not kvserve's function, so a bug there shows):
    cum_logprob / length ** length_penalty, prompt counted, a final EOS not."""
    length = len(tokens) - (1 if tokens[-1] in eos else 0)
    return cum / length ** lp


def _separated(values: list[float], where: int, what: str, scale: float = 1.0) -> None:
    """Ties within float32 noise would let the engine pick differently, legitimately.
    `scale`: what one unit of cumulative logprob is in these values (1 / len ** lp)."""
    if 0 < where < len(values):
        assert abs(values[where - 1] - values[where]) > 10 * TOL * scale, f"near-tie at {what}"


def _reference_beam_search(model: torch.nn.Module, prompt: list[int], k: int, steps: int,
                           eos: list[int], ignore_eos: bool, lp: float
                           ) -> list[tuple[list[int], float]]:
    """vLLM's beam search on float64 log-probs, each beam expanded over the whole vocabulary
    (every continuation scored, the best k kept; live beams have equal lengths, so the score
    orders them as the cumulative logprob does). The engine returns only each beam's 2k best
    tokens, so EOS can end a beam only when it is among them: the same rule here."""
    key = lambda b: _score(b[0], b[1], eos, lp)   # noqa: E731
    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    completed: list[tuple[list[int], float]] = []
    eos_ids = torch.tensor(eos)
    for _ in range(steps):
        if not beams:
            break
        rows = _logprobs(model, [b[0] for b in beams])
        cum = torch.tensor([c for _, c in beams], dtype=torch.float64)[:, None] + rows
        if not ignore_eos:
            ranked = torch.sort(rows, dim=-1, descending=True)
            for i, row_sorted in enumerate(ranked.values):
                _separated(row_sorted.tolist(), 2 * k, "the 2k-th candidate")
            top2k = ranked.indices[:, :2 * k]
            for i, (toks, _) in enumerate(beams):
                for t in eos:
                    if bool((top2k[i] == t).any()):
                        completed.append((toks + [t], float(cum[i, t])))
            cum[:, eos_ids] = float("-inf")
        flat = torch.sort(cum.flatten(), descending=True)
        _separated(flat.values[:k + 1].tolist(), k, "the beam cut")
        vocab = rows.shape[1]
        beams = [(beams[int(j) // vocab][0] + [int(j) % vocab], float(v))
                 for v, j in zip(flat.values[:k], flat.indices[:k]) if v > float("-inf")]
    final = sorted(completed + beams, key=key, reverse=True)
    scale = 1.0 / (len(prompt) + steps) ** max(lp, 0.0)
    for i in range(1, min(k, len(final) - 1) + 1):
        _separated([key(c) for c in final], i, "the final order", scale)
    return [(t[len(prompt):], c) for t, c in final[:k]]


def _beams(result) -> list[tuple[list[int], float]]:
    return [(s.output_token_ids, s.cum_logprob) for s in result.sequences]


def _assert_same(got: list[tuple[list[int], float]], want: list[tuple[list[int], float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, abs=TOL)


# ---------------------------------------------------------------------- offline
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beam_search_equals_reference(llm: LLM, hf64: torch.nn.Module,
                                      ckpt: tuple[str, list[int]], ignore_eos: bool) -> None:
    """Widths 1..4, three length penalties, two prompts in one call (their beams share the
    engine's steps): the same beams, order and cumulative logprobs as the float64 reference."""
    eos = ckpt[1]
    steps = 3
    ended_early = 0
    for k in (1, 2, 3, 4):
        # The length penalty matters only between beams of different lengths (EOS).
        for lp in ((1.0,) if ignore_eos else (0.0, 1.0, 2.0)):
            params = BeamSearchParams(beam_width=k, max_tokens=steps, ignore_eos=ignore_eos,
                                      length_penalty=lp)
            results = llm.beam_search([PROMPT_A, {"prompt_token_ids": PROMPT_B}], params)
            for prompt, result in zip((PROMPT_A, PROMPT_B), results):
                want = _reference_beam_search(hf64, prompt, k, steps, eos, ignore_eos, lp)
                _assert_same(_beams(result), want)
                for seq in result.sequences:
                    assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos and not ignore_eos
                                                 else "length")
                    ended_early += seq.finish_reason == "stop"
                    assert len(seq.logprobs) == len(seq.output_token_ids)
                    assert sum(step[t].logprob for step, t in
                               zip(seq.logprobs, seq.output_token_ids)) == pytest.approx(
                                   seq.cum_logprob, abs=1e-5)
    # The EOS rule and the length penalty were exercised: some best beams ended early.
    assert (ended_early > 0) != ignore_eos


def test_one_token_equals_exhaustive(llm: LLM, hf64: torch.nn.Module) -> None:
    """One token: beam search is exhaustive search, the k most likely tokens in order. Longer:
    no continuation of any length-2 sequence beats the best beam by more than beam search may
    miss, i.e. the best beam's score never exceeds the exhaustive best."""
    for k in (1, 2, 3, 4):
        result = llm.beam_search(PROMPT_A, BeamSearchParams(beam_width=k, max_tokens=1,
                                                            ignore_eos=True))[0]
        top = torch.topk(_logprobs(hf64, [PROMPT_A])[0], k)
        _assert_same(_beams(result), [([int(t)], float(v)) for v, t in zip(top.values, top.indices)])
    first = _logprobs(hf64, [PROMPT_B])[0]
    vocab = first.shape[0]
    second = _logprobs(hf64, [PROMPT_B + [t] for t in range(vocab)])      # every 2-token path
    best = float((first[:, None] + second).max())
    got = llm.beam_search(PROMPT_B, BeamSearchParams(beam_width=4, max_tokens=2,
                                                     ignore_eos=True))[0].sequences[0]
    assert got.cum_logprob <= best + TOL
    assert got.cum_logprob == pytest.approx(
        float(first[got.output_token_ids[0]] + second[got.output_token_ids[0],
                                                      got.output_token_ids[1]]), abs=TOL)


def test_width_one_is_greedy(llm: LLM) -> None:
    """beam_width=1 with ignore_eos equals greedy decoding of the same length (without
    ignore_eos it may differ: an EOS among the 2 candidates can outrank the greedy beam)."""
    for prompt in (PROMPT_A, PROMPT_B):
        greedy = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                             logprobs=0), use_tqdm=False)[0].outputs[0]
        beam = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=8,
                                                        ignore_eos=True))[0].sequences[0]
        assert beam.output_token_ids == greedy.token_ids
        assert beam.cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-5)
        assert beam.text == greedy.text


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_equals_hf_num_beams(llm: LLM, ckpt: tuple[str, list[int]], k: int) -> None:
    """HF `generate(num_beams=k, num_return_sequences=k, do_sample=False)` in float32.

    Where both define the same thing: no EOS (HF with eos_token_id=None, kvserve with
    ignore_eos), so every beam runs max_new_tokens tokens. Then early_stopping (True / False)
    has no effect, and the length penalty does not change the order (equal lengths); HF's
    sequences_scores are cum_logprob / new_tokens ** length_penalty (vLLM's score counts the
    prompt too, so the cumulative logprobs are compared). With EOS they differ by design:
    HF lets an EOS end a beam only from the k best of the 2k candidates and scores by new
    tokens; vLLM takes every EOS among each beam's 2k candidates."""
    model = _hf_model(ckpt[0], torch.float32)
    steps, lp = 4, 1.5
    kwargs = dict(length_penalty=lp, early_stopping=True) if k > 1 else {}
    for prompt in (PROMPT_A, PROMPT_B):
        with _one_thread():
            hf = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k,
                                do_sample=False, max_new_tokens=steps, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                **kwargs)
        got = llm.beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=steps,
                                                       ignore_eos=True, length_penalty=lp))[0]
        assert [t for t, _ in _beams(got)] == [seq[len(prompt):].tolist() for seq in hf.sequences]
        if k > 1:       # HF runs num_beams=1 as greedy search, without sequences_scores
            for (_, cum), score in zip(_beams(got), hf.sequences_scores):
                assert cum == pytest.approx(float(score) * steps ** lp, abs=1e-3)


def test_beams_share_prefix_blocks(llm: LLM) -> None:
    """Every step's requests hit the prefix cache for all full blocks of their sequence (the
    blocks their parent beams computed, generated tokens included): shared, not recomputed.
    12-token prompt, 16-token blocks, 8 steps of 3 beams: from step 5 on the first block holds
    generated tokens and is a hit too."""
    k, steps, block = 3, 8, ENGINE_KW["block_size"]
    prompt = PROMPT_A[:12]
    llm.reset_prefix_cache()
    before = llm.get_stats()
    llm.beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=steps, ignore_eos=True))
    after = llm.get_stats()
    # Step 0 computes the prompt; at step t each of the k beams (length 12 + t) may hit every
    # full block but the one holding its last token (the engine computes that token).
    full_blocks = sum(k * ((len(prompt) + t - 1) // block) * block for t in range(1, steps))
    queries = len(prompt) + sum(k * (len(prompt) + t) for t in range(1, steps))
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == queries
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= full_blocks > 0


def test_score_is_vllms() -> None:
    assert get_beam_search_score([1, 2, 3, 4], -2.0, None, 1.0) == -0.5
    assert get_beam_search_score([1, 2, 3, 4], -2.0, 4, 1.0) == pytest.approx(-2.0 / 3)
    assert get_beam_search_score([1, 2, 3, 4], -2.0, 9, 2.0) == -0.125
    assert get_beam_search_score([1, 2, 3, 4], -2.0, None, 0.0) == -2.0


def test_bad_params_offline(llm: LLM) -> None:
    for kwargs, match in (({"beam_width": 0}, "beam_width"), ({"beam_width": -2}, "beam_width"),
                          ({"max_tokens": 0}, "max_tokens"), ({"temperature": 0.7}, "temperature"),
                          ({"length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="beam_width=11 is too large"):
        llm.beam_search(PROMPT_A, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search(PROMPT_A, BeamSearchParams(beam_width=2, max_tokens=250))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPT_A, SamplingParams(max_tokens=2))
    # The engine is still fine.
    assert llm.beam_search(PROMPT_B, BeamSearchParams(beam_width=2, max_tokens=1))[0].sequences


# ---------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def client(ckpt: tuple[str, list[int]]) -> Iterator[openai.OpenAI]:
    srv = RemoteServer(ckpt[0], [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning"])
    try:
        yield openai.OpenAI(base_url=srv.url_v1, api_key="EMPTY", max_retries=0, timeout=60)
    finally:
        srv.close()


def test_server_use_beam_search(client: openai.OpenAI, hf64: torch.nn.Module,
                                ckpt: tuple[str, list[int]]) -> None:
    """/v1/completions with extra_body use_beam_search: n beams per prompt (best_of wide),
    best first, index i * n + j; equal to the float64 reference."""
    model = client.models.list().data[0].id
    k, n, steps, lp = 4, 3, 3, 1.0
    resp = client.completions.create(
        model=model, prompt=[PROMPT_A, PROMPT_B], max_tokens=steps, n=n, best_of=k, logprobs=2,
        extra_body={"use_beam_search": True, "length_penalty": lp, "return_token_ids": True})
    assert [c.index for c in resp.choices] == list(range(2 * n))
    for i, prompt in enumerate((PROMPT_A, PROMPT_B)):
        want = _reference_beam_search(hf64, prompt, k, steps, ckpt[1], False, lp)[:n]
        choices = resp.choices[i * n:(i + 1) * n]
        assert [c.token_ids for c in choices] == [t for t, _ in want]
        for c, (_, cum) in zip(choices, want):
            assert sum(c.logprobs.token_logprobs) == pytest.approx(cum, abs=TOL)
            assert all(len(top) <= 3 for top in c.logprobs.top_logprobs)
            assert c.finish_reason == ("stop" if c.token_ids[-1] in ckpt[1] else "length")
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in resp.choices)
    assert resp.usage.prompt_tokens == len(PROMPT_A) + len(PROMPT_B)


def test_server_chat_beam_search(client: openai.OpenAI) -> None:
    """Chat: the rendered prompt's beams, the same as /v1/completions on its token ids."""
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=3, n=2,
        extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.index for c in chat.choices] == [0, 1]
    plain = client.completions.create(
        model=model, prompt=chat.prompt_token_ids, max_tokens=3, n=2,
        extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.token_ids for c in chat.choices] == [c.token_ids for c in plain.choices]
    assert [c.message.content for c in chat.choices] == [c.text for c in plain.choices]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            temperature=0.5, extra_body={"use_beam_search": True})


def test_server_answers_during_beam_search(client: openai.OpenAI) -> None:
    """The beam search awaits each step: /health is answered while one runs (a beam search
    that blocked the event loop would let no other request in until it ended)."""
    model = client.models.list().data[0].id
    health = str(client.base_url).rstrip("/").removesuffix("/v1") + "/health"
    result: dict[str, object] = {}

    def run() -> None:
        result["resp"] = client.completions.create(
            model=model, prompt=PROMPT_A, max_tokens=24, n=2,
            extra_body={"use_beam_search": True, "ignore_eos": True})

    worker = threading.Thread(target=run)
    worker.start()
    answered_during = 0
    with httpx.Client(timeout=30) as http:
        while worker.is_alive():
            assert http.get(health).status_code == 200
            answered_during += worker.is_alive()
    worker.join()
    assert len(result["resp"].choices) == 2                          # type: ignore[attr-defined]
    assert all(len(c.text) > 0 for c in result["resp"].choices)      # type: ignore[attr-defined]
    assert answered_during >= 3


def test_server_bad_beam_requests(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    bad = [({"n": 11}, "too large"), ({"temperature": 0.8}, "temperature"),
           ({"stream": True}, "stream"), ({"n": 3, "best_of": 2}, "best_of"),
           ({"extra_body": {"use_beam_search": True,
                            "response_format": {"type": "json_object"}}}, "response_format"),
           ({"stop": ["x"]}, "stop")]
    for kwargs, match in bad:
        extra = kwargs.pop("extra_body", {"use_beam_search": True})
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=model, prompt=PROMPT_B, max_tokens=2,
                                      extra_body=extra, **kwargs)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT_B, max_tokens=2, n=0,
                                  extra_body={"use_beam_search": True})
    ok = client.completions.create(model=model, prompt=PROMPT_B, max_tokens=2, n=2,
                                   extra_body={"use_beam_search": True})
    assert len(ok.choices) == 2
