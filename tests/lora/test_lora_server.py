"""Multi-LoRA through `kvserve serve` and the official openai client: the adapter is chosen
by the `model` field, /v1/models lists adapters with their base as parent, an unknown model
is a 404, and adapters load and unload at run time with KVSERVE_ALLOW_RUNTIME_LORA_UPDATING."""
from __future__ import annotations

import json
import os
from typing import Iterator

import httpx
import openai
import pytest

from tests.utils import SERVER_ENGINE_ARGS, RemoteServer
from tests.lora.conftest import peft_greedy

PROMPT = [1, 17, 240, 93, 5, 77, 310, 41, 8, 600, 12]


@pytest.fixture(scope="module")
def server(tiny_llama: str, lora_adapters: dict[str, str]) -> Iterator[RemoteServer]:
    os.environ["KVSERVE_ALLOW_RUNTIME_LORA_UPDATING"] = "1"     # read by the server process
    try:
        srv = RemoteServer(tiny_llama, [
            *SERVER_ENGINE_ARGS, "--served-model-name", "base", "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "16", "--uvicorn-log-level", "warning",
            "--lora-modules", f"all7={lora_adapters['all7']}",
            json.dumps({"name": "rs", "path": lora_adapters["qv_down_rs"],
                        "base_model_name": "base"})])
    finally:
        del os.environ["KVSERVE_ALLOW_RUNTIME_LORA_UPDATING"]
    try:
        yield srv
    finally:
        srv.close()


def _complete(client: openai.OpenAI, model: str) -> list[int]:
    res = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert res.model == model
    return res.choices[0].token_ids


def test_models_lists_adapters_with_parent(client: openai.OpenAI, lora_adapters) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "all7", "rs"}
    assert cards["all7"].parent == "base" and cards["rs"].parent == "base"
    assert cards["all7"].root == lora_adapters["all7"]


def test_model_field_selects_the_adapter(client: openai.OpenAI, tiny_llama: str,
                                         lora_adapters) -> None:
    got = {name: _complete(client, name) for name in ("base", "all7", "rs")}
    for name, path in (("base", None), ("all7", lora_adapters["all7"]),
                       ("rs", lora_adapters["qv_down_rs"])):
        assert got[name] == peft_greedy(tiny_llama, path, [PROMPT], 6)[0][0], name
    chat = client.chat.completions.create(model="rs", max_tokens=3, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "rs" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)


def test_runtime_load_and_unload(client: openai.OpenAI, server: RemoteServer,
                                 tiny_llama: str, lora_adapters, tmp_path) -> None:
    url = server.url_for
    r = httpx.post(url("/v1/load_lora_adapter"),
                   json={"lora_name": "kogu", "lora_path": lora_adapters["kogu"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert "kogu" in {m.id for m in client.models.list().data}
    assert _complete(client, "kogu") == peft_greedy(tiny_llama, lora_adapters["kogu"],
                                                    [PROMPT], 6)[0][0]
    bad = httpx.post(url("/v1/load_lora_adapter"),
                     json={"lora_name": "bad", "lora_path": str(tmp_path / "missing")}, timeout=60)
    assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
    dup = httpx.post(url("/v1/load_lora_adapter"),
                     json={"lora_name": "all7", "lora_path": lora_adapters["kogu"]}, timeout=60)
    assert dup.status_code == 400
    r = httpx.post(url("/v1/unload_lora_adapter"), json={"lora_name": "kogu"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "kogu")
    r = httpx.post(url("/v1/unload_lora_adapter"), json={"lora_name": "kogu"}, timeout=60)
    assert r.status_code == 404
