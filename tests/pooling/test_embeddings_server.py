"""`/v1/embeddings`, `/v1/score` and `/v1/rerank` on a real `kvserve serve --runner pooling`
subprocess, driven by the official `openai` client (httpx for the routes it lacks).

The model: a tiny random Llama with a sentence-transformers config (MEAN + Normalize) written
by the test. The reference is transformers' last_hidden_state pooled the same way.
"""
from __future__ import annotations

import base64
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from kvserve.tokenizer import Tokenizer
from tests.utils import SERVER_ENGINE_ARGS, RemoteServer
from tests.pooling.conftest import hf_pooled

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors",
         "short", "a somewhat longer sentence " * 12]


@pytest.fixture(scope="module")
def model_dir(tiny_llama: str, st_checkpoint) -> str:
    return st_checkpoint(tiny_llama, "mean", True)


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[RemoteServer]:
    # A 32-token step budget: the longest text is chunk-prefilled.
    srv = RemoteServer(model_dir, [*SERVER_ENGINE_ARGS, "--runner", "pooling",
                                   "--max-num-batched-tokens", "32",
                                   "--uvicorn-log-level", "warning"])
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def reference(model_dir: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    tok = Tokenizer.from_pretrained(model_dir)
    ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    return ids, hf_pooled(model_dir, ids, "MEAN", True)


def _min_cos(got: list[list[float]], ref: list[torch.Tensor]) -> float:
    return min(torch.nn.functional.cosine_similarity(torch.tensor(g), r, dim=0).item()
               for g, r in zip(got, ref))


def test_embeddings_float_base64_and_token_ids(client: openai.OpenAI, server: RemoteServer,
                                               model_dir: str, reference) -> None:
    ids, ref = reference
    floats = client.embeddings.create(model=model_dir, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert _min_cos([d.embedding for d in floats.data], ref) >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # The client's default asks for base64 and decodes it: the same numbers, up to the float32
    # rounding of another batch (a request's texts can reach the engine in one step or two, and
    # steps of up to 16 tokens take the small-batch kernel, larger ones oneDNN: ~1.5e-7 seen).
    # A float16 or byte-order slip in the encoding is 1e-5 or more.
    decoded = client.embeddings.create(model=model_dir, input=TEXTS)
    for a, b in zip(floats.data, decoded.data):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=0, atol=1e-6)
    raw = httpx.post(server.url_for("/v1/embeddings"), timeout=60,
                     json={"model": model_dir, "input": TEXTS[0], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, floats.data[0].embedding, rtol=0, atol=1e-6)
    # Token ids: one list, and a list of lists.
    one = client.embeddings.create(model=model_dir, input=ids[1], encoding_format="float")
    assert _min_cos([one.data[0].embedding], [ref[1]]) >= 0.9999
    many = client.embeddings.create(model=model_dir, input=ids, encoding_format="float")
    assert _min_cos([d.embedding for d in many.data], ref) >= 0.9999


def test_bad_inputs_are_400(client: openai.OpenAI, server: RemoteServer, model_dir: str) -> None:
    bad = [dict(input=""), dict(input=[]), dict(input=[[5, 6], []]), dict(input=[5, 10**6]),
           dict(input=TEXTS[0], dimensions=16),          # not a Matryoshka model
           dict(input=TEXTS[0], dimensions=0),
           dict(input=list(range(5, 5 + 300)))]          # longer than max_model_len 256
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model=model_dir, encoding_format="float", **kw)
    r = httpx.post(server.url_for("/v1/embeddings"), timeout=30,
                   json={"model": model_dir, "input": "x", "encoding_format": "int8"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    # Generation on a pooling model: a clear 400, not a hang or a crash.
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model=model_dir, prompt="Hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.chat.completions.create(model=model_dir, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(server.url_for("/health"), timeout=10).status_code == 200
    ok = client.embeddings.create(model=model_dir, input="still serving", encoding_format="float")
    assert len(ok.data[0].embedding) == 64


def test_score_and_rerank_are_embedding_cosines(client: openai.OpenAI, server: RemoteServer,
                                                model_dir: str) -> None:
    emb = client.embeddings.create(model=model_dir, input=TEXTS, encoding_format="float")
    vecs = torch.tensor([d.embedding for d in emb.data])
    want = torch.nn.functional.cosine_similarity(vecs[:1].expand(3, -1), vecs[1:]).tolist()
    score = httpx.post(server.url_for("/v1/score"), timeout=60,
                       json={"model": model_dir, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    rerank = httpx.post(server.url_for("/rerank"), timeout=60,
                        json={"model": model_dir, "query": TEXTS[0], "documents": TEXTS[1:],
                              "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]],
                               [want[i] for i in order], atol=1e-5)
    r = httpx.post(server.url_for("/v1/score"), timeout=30,
                   json={"model": model_dir, "text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert r.status_code == 400
