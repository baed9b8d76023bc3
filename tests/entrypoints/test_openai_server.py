"""The OpenAI-compatible server, end to end: a real `kvserve serve` subprocess on a loopback
port, driven by the official `openai` client (and raw httpx where the client hides things).

References: `LLM.generate` / `LLM.chat` on the same checkpoint (float32, greedy) for outputs
and logprobs; the tokenizer for token counts; `/metrics` for the engine's state.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, Iterator

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.tokenizer import Tokenizer
from tests.entrypoints.conftest import MAX_MODEL_LEN, SERVER_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.timeout(150)

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello, who are you?"}]


# ---------------------------------------------------------------------- fixtures / helpers
@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> Iterator[LLM]:
    engine = LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20)
    yield engine
    engine.shutdown()


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    text = httpx.get(server.url_for("/metrics"), timeout=10).text
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    assert found, f"metric {name} {labels} not exported"
    return total


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["code"] == resp.status_code
    return err


def assert_still_serving(client: openai.OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt="still there?", max_tokens=3,
                                    temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------- basics
def test_models_health_version_load(server: RemoteServer, client: openai.OpenAI,
                                    model_name: str, tiny_llama: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama]          # served name defaults to the model
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url_for("/health")).status_code == 200
    assert httpx.get(server.url_for("/ping")).status_code == 200
    import kvserve
    assert httpx.get(server.url_for("/version")).json() == {"version": kvserve.__version__}
    load = httpx.get(server.url_for("/load")).json()
    assert load == {"server_load": 0, "num_requests_running": 0, "num_requests_waiting": 0}


def test_completion_equals_llm_generate(client: openai.OpenAI, model_name: str, llm: LLM,
                                        tokenizer: Tokenizer) -> None:
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                              logprobs=3), use_tqdm=False)[0]
    ref_out = ref.outputs[0]
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=20, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == ref_out.token_ids
    assert choice.text == ref_out.text
    assert choice.finish_reason == "length"
    # Usage: the prompt as the tokenizer encodes it, every generated token.
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt, 20, n_prompt + 20)
    # Logprobs in OpenAI's shape, equal to the engine's.
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 20
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(20)]
    for pos, (tid, got) in enumerate(zip(ref_out.token_ids, lp.token_logprobs)):
        want = ref_out.logprobs[pos][tid].logprob
        assert math.isclose(got, want, abs_tol=1e-4), (pos, got, want)
        top = lp.top_logprobs[pos]
        assert 3 <= len(top) <= 4 and lp.tokens[pos] in top
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(max(top.values()), got, abs_tol=1e-6)


def test_chat_equals_llm_chat(client: openai.OpenAI, model_name: str, llm: LLM) -> None:
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                            logprobs=2), use_tqdm=False)[0]
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                         max_completion_tokens=12, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    content = choice.logprobs.content
    assert len(content) == 12 and "".join(c.token for c in content) == choice.message.content
    for pos, c in enumerate(content):
        tid = ref.outputs[0].token_ids[pos]
        assert math.isclose(c.logprob, ref.outputs[0].logprobs[pos][tid].logprob, abs_tol=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token          # greedy
    # max_tokens (deprecated) is honoured as well.
    old = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                         max_tokens=4, extra_body={"ignore_eos": True})
    assert old.usage.completion_tokens == 4


def test_streaming_completion_concatenates(client: openai.OpenAI, model_name: str) -> None:
    kw: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    *content, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in content)


def test_streaming_chat_role_content_finish_usage(client: openai.OpenAI, model_name: str) -> None:
    kw: dict[str, Any] = dict(model=model_name, messages=MESSAGES, max_completion_tokens=16,
                              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    first, *middle, finish, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert all(c.choices[0].delta.role is None and c.choices[0].finish_reason is None
               for c in middle)
    assert "".join(c.choices[0].delta.content for c in middle) == whole.choices[0].message.content
    assert finish.choices[0].finish_reason == "length" and not finish.choices[0].delta.content
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_and_several_prompts_indices_and_usage(client: openai.OpenAI, model_name: str,
                                                 tokenizer: Tokenizer) -> None:
    prompts = ["The river", "Once upon a time"]
    out = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6,
                                    temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]   # prompt i, sample j -> i * n + j
    assert all(len(c.model_extra["token_ids"]) == 6 for c in out.choices)
    assert [c.model_extra["prompt_token_ids"] for c in out.choices] == [
        tokenizer.encode(p) for p in prompts for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 24
    # The samples of one prompt differ (seed + i per child) ...
    assert out.choices[0].model_extra["token_ids"] != out.choices[1].model_extra["token_ids"]
    # ... and streaming reports the same four choices.
    texts = {i: "" for i in range(4)}
    for chunk in client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6,
                                           temperature=1.0, seed=7, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(4)] == [c.text for c in out.choices]
    # Token-id prompts, one and several.
    ids = [[1, 100, 200, 300, 400], [1, 7, 8]]
    one = client.completions.create(model=model_name, prompt=ids[0], max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    both = client.completions.create(model=model_name, prompt=ids, max_tokens=3, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert [c.model_extra["prompt_token_ids"] for c in both.choices] == ids
    assert both.choices[0].text == one.choices[0].text and both.usage.prompt_tokens == 8
    # n > 1 on chat.
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, n=3,
                                          max_completion_tokens=5, temperature=1.0,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 15


def test_seed_reproducible(client: openai.OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a = sample(1234)
    assert sample(1234) == a
    assert sample(4321) != a


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, model_name: str) -> None:
    base: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=30, temperature=0)
    full = client.completions.create(**base, extra_body={"ignore_eos": True,
                                                         "return_token_ids": True}).choices[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:10]
    out = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert out.text == text[:text.find(stop)]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop
    # The same through a stream.
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **base, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == out.text
    # vLLM's stop_token_ids extra.
    ids = full.model_extra["token_ids"]
    out = client.completions.create(**base, extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]],
                                                        "return_token_ids": True}).choices[0]
    assert out.model_extra["token_ids"] == ids[:ids.index(ids[3]) + 1]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == ids[3]


def test_echo_and_max_tokens_default(client: openai.OpenAI, model_name: str,
                                     tokenizer: Tokenizer) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                    echo=True, logprobs=1, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    n_prompt = len(tokenizer.encode(PROMPT))
    assert len(c.logprobs.tokens) == n_prompt + 5
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in c.logprobs.token_logprobs[1:])
    # No max_tokens: generate until the context is full (ignore_eos keeps it going).
    long_prompt = [5] * (MAX_MODEL_LEN - 10)
    out = client.completions.create(model=model_name, prompt=long_prompt, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model_name, messages=[
        {"role": "user", "content": "x " * 100}], temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.total_tokens == MAX_MODEL_LEN


def test_tokenize_detokenize(server: RemoteServer, client: openai.OpenAI, model_name: str,
                             tokenizer: Tokenizer) -> None:
    r = httpx.post(server.url_for("/tokenize"), json={"prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(server.url_for("/detokenize"), json={"tokens": r["tokens"][1:]}).json()
    assert d == {"prompt": PROMPT}
    # Chat: the same token count as the chat completion's prompt.
    t = httpx.post(server.url_for("/tokenize"), json={"messages": MESSAGES}).json()
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=1)
    assert t["count"] == chat.usage.prompt_tokens
    bad = httpx.post(server.url_for("/detokenize"), json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and "out of vocabulary" in error_of(bad)["message"]


# ---------------------------------------------------------------------- concurrency
def test_64_concurrent_streams_complete(server: RemoteServer, model_name: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=model_name, prompt=f"Request number {i} says", max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, tokens = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, finish

    async def main() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=server.url_v1, api_key="EMPTY", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(tokens == 8 and finish == "length" for _, tokens, finish in results)
    # Batching does not change greedy outputs: request 5 alone gives the same text.
    alone = openai.OpenAI(base_url=server.url_v1, api_key="EMPTY", max_retries=0).completions.create(
        model=model_name, prompt="Request number 5 says", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    assert alone.choices[0].text == results[5][0]


def test_disconnected_clients_free_their_blocks(server: RemoteServer, model_name: str) -> None:
    """20 streams read a few chunks and hang up, 2 non-streaming clients give up waiting: all
    their requests are aborted in the engine and every KV block is free again."""
    gen_tokens_before = metric(server, "kvserve:generation_tokens_total")
    body = {"model": model_name, "prompt": "A long story:", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    num_streams, num_waiting = 20, 2

    async def main() -> None:
        hang_up = asyncio.Event()
        ready = []

        async def leave_mid_stream(client: httpx.AsyncClient) -> None:
            chunks = 0
            async with client.stream("POST", server.url_v1 + "/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        ready.append(1)
                        await hang_up.wait()
                        break   # leaving the block closes the connection mid-stream

        async def leave_while_waiting(client: httpx.AsyncClient) -> None:
            await client.post(server.url_v1 + "/completions", json={**body, "stream": False})

        async with httpx.AsyncClient(timeout=60) as client:
            streams = [asyncio.ensure_future(leave_mid_stream(client)) for _ in range(num_streams)]
            waiting = [asyncio.ensure_future(leave_while_waiting(client)) for _ in range(num_waiting)]
            deadline = time.monotonic() + 60
            # Hang up only once every request is in the engine and streaming.
            while (len(ready) < num_streams or (await client.get(
                    server.url_for("/load"))).json()["server_load"] < num_streams + num_waiting):
                assert time.monotonic() < deadline and not any(t.done() for t in waiting)
                await asyncio.sleep(0.05)
            for t in waiting:
                t.cancel()   # closes its connection
            hang_up.set()
            await asyncio.gather(*streams)
            await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(main())
    assert wait_until(lambda: metric(server, "kvserve:num_requests_running") == 0
                      and metric(server, "kvserve:kv_cache_usage_perc") == 0.0), \
        httpx.get(server.url_for("/metrics")).text
    assert httpx.get(server.url_for("/load")).json()["server_load"] == 0
    # They were aborted, not run to their end: far fewer than 22 x 200 tokens were generated.
    generated = metric(server, "kvserve:generation_tokens_total") - gen_tokens_before
    assert generated < (num_streams + num_waiting) * 200 / 2, generated


# ---------------------------------------------------------------------- metrics
def test_metrics_names_labels_and_counts(server: RemoteServer, client: openai.OpenAI,
                                         model_name: str, tokenizer: Tokenizer) -> None:
    labels = {"model_name": model_name, "engine": "0"}
    phases = [f"kvserve:request_{p}_time_seconds_{s}" for p in ("queue", "prefill", "decode",
                                                                  "inference")
              for s in ("count", "sum")]
    before = {n: metric(server, n, **labels) for n in (
        "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
        "kvserve:time_to_first_token_seconds_count", "kvserve:e2e_request_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_sum", *phases)}
    length_before = metric(server, "kvserve:request_success_total", finished_reason="length", **labels)
    prompt = "Counting tokens in the metrics"
    client.completions.create(model=model_name, prompt=prompt, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    n_prompt = len(tokenizer.encode(prompt))
    assert metric(server, "kvserve:prompt_tokens_total", **labels) - before[
        "kvserve:prompt_tokens_total"] == n_prompt
    assert metric(server, "kvserve:generation_tokens_total", **labels) - before[
        "kvserve:generation_tokens_total"] == 7
    assert metric(server, "kvserve:time_to_first_token_seconds_count", **labels) - before[
        "kvserve:time_to_first_token_seconds_count"] == 1
    assert metric(server, "kvserve:e2e_request_latency_seconds_count", **labels) - before[
        "kvserve:e2e_request_latency_seconds_count"] == 1
    assert metric(server, "kvserve:request_success_total", finished_reason="length",
                  **labels) == length_before + 1
    # Queue / prefill / decode / inference times, from the engine core's events: one sample
    # each, none negative, queue + inference within the end-to-end latency.
    delta = {n: metric(server, n, **labels) - before[n] for n in phases}
    for p in ("queue", "prefill", "decode", "inference"):
        assert delta[f"kvserve:request_{p}_time_seconds_count"] == 1, p
        assert delta[f"kvserve:request_{p}_time_seconds_sum"] >= 0, p
    e2e = metric(server, "kvserve:e2e_request_latency_seconds_sum", **labels) - before[
        "kvserve:e2e_request_latency_seconds_sum"]
    queue = delta["kvserve:request_queue_time_seconds_sum"]
    inference = delta["kvserve:request_inference_time_seconds_sum"]
    assert inference > 0 and queue + inference <= e2e + 1e-3, (queue, inference, e2e)
    assert abs(delta["kvserve:request_prefill_time_seconds_sum"]
               + delta["kvserve:request_decode_time_seconds_sum"] - inference) < 1e-3
    # Every vLLM metric name is exported with both labels.
    for name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
                 "kvserve:kv_cache_usage_perc", "kvserve:prefix_cache_queries_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:num_preemptions_total",
                 "kvserve:inter_token_latency_seconds_count",
                 "kvserve:request_queue_time_seconds_count",
                 "kvserve:request_prompt_tokens_count", "kvserve:request_generation_tokens_count",
                 "kvserve:iteration_tokens_total_count"):
        metric(server, name, **labels)
    # The same prompt again is a prefix cache hit.
    hits = metric(server, "kvserve:prefix_cache_hits_total", **labels)
    client.completions.create(model=model_name, prompt=prompt * 4, max_tokens=1)
    client.completions.create(model=model_name, prompt=prompt * 4, max_tokens=1)
    assert metric(server, "kvserve:prefix_cache_hits_total", **labels) > hits


# ---------------------------------------------------------------------- errors
def test_bad_parameters_are_400(server: RemoteServer, client: openai.OpenAI, model_name: str) -> None:
    cases = [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"logprobs": 1000}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ]
    for extra, word in cases:
        r = httpx.post(server.url_v1 + "/completions",
                       json={"model": model_name, "prompt": PROMPT, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = error_of(r)
        assert err["type"] == "BadRequestError" and word in err["message"], (extra, err)
    # Through the client: a chat message with an unsupported content part.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.status_code == 400 and "image_url" in e.value.message
    r = httpx.post(server.url_v1 + "/chat/completions",
                   json={"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in error_of(r)["message"]
    assert_still_serving(client, model_name)


def test_too_long_prompt_is_400_with_both_numbers(server: RemoteServer, client: openai.OpenAI,
                                                   model_name: str) -> None:
    long_prompt = [5] * 300
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=long_prompt, max_tokens=4)
    msg = e.value.message
    assert str(MAX_MODEL_LEN) in msg and "300" in msg, msg
    # Prompt + max_tokens over the context: vLLM's message with every number.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[5] * 100, max_tokens=200)
    msg = e.value.message
    assert ("maximum context length is 256 tokens" in msg and "300 tokens" in msg
            and "100 in the messages" in msg and "200 in the completion" in msg), msg
    r = httpx.post(server.url_v1 + "/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 400}], "max_completion_tokens": 2})
    assert r.status_code == 400 and "256" in error_of(r)["message"]
    assert_still_serving(client, model_name)


def test_malformed_json_and_unknown_model(server: RemoteServer, client: openai.OpenAI,
                                          model_name: str) -> None:
    r = httpx.post(server.url_v1 + "/completions", content=b'{"prompt": "x", "max_tokens": 3',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = httpx.post(server.url_v1 + "/chat/completions", content=b"not json at all",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404 and "no-such-model" in e.value.message
    r = httpx.post(server.url_v1 + "/chat/completions",
                   json={"model": "no-such-model", "messages": MESSAGES})
    assert r.status_code == 404 and error_of(r)["type"] == "NotFoundError"
    assert_still_serving(client, model_name)


def test_chat_cli_against_server(server: RemoteServer, client: openai.OpenAI,
                                 model_name: str) -> None:
    from kvserve.entrypoints.chat import run_chat
    from kvserve.entrypoints.cli import make_parser

    lines = iter(["Hello, who are you?", "", "/exit"])
    out: list[str] = []

    async def read_line(prompt: str) -> str:
        return next(lines)

    args = make_parser().parse_args(["chat", "--url", server.url_v1, "--max-tokens", "6",
                                     "--temperature", "0"])
    assert run_chat(args, read_line=read_line, write=out.append) == 0
    want = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                          max_completion_tokens=6, temperature=0)
    assert "".join(out) == want.choices[0].message.content + "\n"


def test_error_bodies_and_health_match_the_document(server: RemoteServer, model_name: str) -> None:
    """The real answers validate against the server's own /openapi.json."""
    doc = httpx.get(server.url_for("/openapi.json"), timeout=10).json()

    def check(r: httpx.Response, path: str, method: str = "post") -> None:
        spec = doc["paths"][path][method]["responses"][str(r.status_code)]
        assert r.headers["content-type"].split(";")[0] in spec["content"], r.headers
        if r.headers["content-type"].startswith("application/json"):
            schema = dict(spec["content"]["application/json"]["schema"],
                          components=doc["components"])
            jsonschema.validate(r.json(), schema)

    url = server.url_for("/v1/completions")
    cases = [({"model": model_name, "prompt": ""}, 400),
             ({"model": model_name, "prompt": [[]]}, 400),
             ({"model": model_name, "prompt": "x", "temperature": -1}, 400),
             ({"model": "no-such-model", "prompt": "x", "max_tokens": 1}, 404),
             ({"model": model_name, "prompt": "x", "max_tokens": 1}, 200)]
    for body, status in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        check(r, "/v1/completions")
    r = httpx.post(server.url_for("/v1/chat/completions"), json={"model": model_name,
                                                                 "messages": []}, timeout=30)
    assert r.status_code == 400 and "at least one message" in r.text
    check(r, "/v1/chat/completions")
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    check(r, "/v1/completions")
    for method in ("get", "post"):
        r = httpx.request(method.upper(), server.url_for("/ping"), timeout=10)
        assert r.status_code == 200 and r.content == b""
        check(r, "/ping", method)


# ---------------------------------------------------------------------- a second server
CUSTOM_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def test_second_server_api_key_queue_limit_template_dead_engine(tiny_llama: str,
                                                                 tokenizer: Tokenizer) -> None:
    """--api-key, --max-num-queued-requests 0 with one sequence at a time, --chat-template as a
    string, two --served-model-name aliases; then the engine core dies (503s), and SIGTERM
    still shuts everything down. --keep-alive-on-engine-death keeps it answering 503
    after the death (the default, exiting, is in test_server_lifecycle.py)."""
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
                                    "--keep-alive-on-engine-death", "--api-key", "sesame",
                                    "--max-num-seqs", "1", "--max-num-queued-requests", "0",
                                    "--chat-template", CUSTOM_TEMPLATE,
                                    "--served-model-name", "tiny", "tiny-alias"])
    try:
        good = openai.OpenAI(base_url=srv.url_v1, api_key="sesame", max_retries=0, timeout=60)
        assert [m.id for m in good.models.list().data] == ["tiny", "tiny-alias"]
        name = "tiny"
        # Either name is accepted, and a response reports the name it was asked for.
        assert good.completions.create(model="tiny-alias", prompt="x", max_tokens=1).model == \
            "tiny-alias"
        assert good.chat.completions.create(model="tiny", messages=MESSAGES,
                                            max_tokens=1).model == "tiny"
        with pytest.raises(openai.NotFoundError):
            good.completions.create(model=tiny_llama, prompt="x", max_tokens=1)
        # 401 without the right key, on /v1/* only.
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=srv.url_v1, api_key="wrong", max_retries=0).models.list()
        assert e.value.status_code == 401
        r = httpx.post(srv.url_v1 + "/completions", json={"prompt": "x"})
        assert r.status_code == 401 and error_of(r)["type"] == "AuthenticationError"
        assert httpx.get(srv.url_for("/health")).status_code == 200
        assert httpx.get(srv.url_for("/metrics")).status_code == 200

        # 503: one request runs; with no queue allowed, the next one is refused at once.
        def refused_while_one_runs() -> bool:
            running = good.completions.create(model=name, prompt="Long", max_tokens=200,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
            try:
                next(iter(running))                           # it is running now
                try:
                    good.completions.create(model=name, prompt="Another", max_tokens=2)
                except openai.APIStatusError as err:
                    assert err.status_code == 503 and "max-num-queued-requests" in err.message
                    return True
                # A fast host can finish the 200 tokens (~0.1 s) before the second request is
                # admitted (CI once did): try again; with no limit all three tries get in.
                return False
            finally:
                running.close()                               # disconnect: aborted, slot free
        assert any(refused_while_one_runs() for _ in range(3))
        # And it keeps serving: once the slot is free, requests get in again.
        def served() -> bool:
            try:
                return good.completions.create(model=name, prompt="Again", max_tokens=2,
                                               temperature=0).usage.completion_tokens >= 1
            except openai.APIStatusError as err:
                assert err.status_code == 503
                return False
        assert wait_until(served, timeout=20)

        # --chat-template given as the template itself.
        t = httpx.post(srv.url_for("/tokenize"), json={"messages": MESSAGES}).json()
        assert t["tokens"] == tokenizer.encode(f"<user>{MESSAGES[0]['content']}\n",
                                               add_special_tokens=False)

        # The engine core dies: /health says 503, requests get 503, the server stays up
        # (--keep-alive-on-engine-death), well past the default's exit delay.
        import psutil
        core = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())]
        assert core, "no engine core process found"
        for p in core:
            p.kill()
        assert wait_until(lambda: httpx.get(srv.url_for("/health")).status_code == 503, timeout=20)
        with pytest.raises(openai.APIStatusError) as e:
            good.completions.create(model=name, prompt="Anyone?", max_tokens=2)
        assert e.value.status_code == 503
        time.sleep(2)
        assert srv.proc.poll() is None
        assert good.models.list().data[0].id == name

        # SIGTERM: the server and its engine core process exit, nothing is left.
        assert srv.terminate(timeout=30) is not None, srv.log_text()[-3000:]
        assert wait_until(lambda: not srv.session_alive(), timeout=10)
        assert "Shutting down the engine" in srv.log_text()
    finally:
        srv.close()


def test_embeddings_on_a_generate_model_is_400(client: openai.OpenAI, model_name: str) -> None:
    """A generate-runner server refuses /v1/embeddings with a 400 that names the fix."""
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=model_name, input="hello", encoding_format="float")
