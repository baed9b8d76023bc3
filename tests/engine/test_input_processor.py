"""InputProcessor: prompts of every accepted shape, and a clear ValueError for each bad input."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.engine.input_processor import InputProcessor
from kvserve.model.demo import BOS_ID, EOS_ID, IM_END_ID
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

MAX_MODEL_LEN = 32
MODEL_VOCAB = 1024          # the model's (padded) vocabulary is larger than the tokenizer's


def _model_config(path: str, max_model_len: int = MAX_MODEL_LEN, generation_config=None,
                  max_logprobs: int = 5) -> ModelConfig:
    return ModelConfig(model=path, tokenizer=path, served_model_name="tiny",
                       hf_config={"vocab_size": MODEL_VOCAB, "eos_token_id": EOS_ID},
                       dtype=torch.float32, max_model_len=max_model_len,
                       max_logprobs=max_logprobs, generation_config=generation_config or {})


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def proc(demo_tokenizer_dir: str, tok: Tokenizer) -> InputProcessor:
    return InputProcessor(_model_config(demo_tokenizer_dir), tok)


# ---------------------------------------------------------------------- accepted prompts
def test_text_prompt(proc, tok):
    before = time.time()
    req, text = proc.process_inputs("r1", "Hello world", SamplingParams(max_tokens=4))
    assert text == "Hello world"
    assert req.request_id == "r1"
    assert req.prompt_token_ids == tok.encode("Hello world") and req.prompt_token_ids[0] == BOS_ID
    assert req.eos_token_ids == [EOS_ID]
    assert req.sampling_params.max_tokens == 4
    assert before <= req.arrival_time <= time.time()
    assert req.priority == 0 and req.cache_salt is None


def test_dict_and_token_prompts(proc, tok):
    ids = tok.encode("Hello world")
    params = SamplingParams()
    by_text, t1 = proc.process_inputs("a", {"prompt": "Hello world"}, params)
    by_ids, t2 = proc.process_inputs("b", {"prompt_token_ids": ids}, params)
    by_list, t3 = proc.process_inputs("c", ids, params)
    both, t4 = proc.process_inputs("d", {"prompt": "chat text", "prompt_token_ids": ids}, params)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == by_list.prompt_token_ids == ids
    assert both.prompt_token_ids == ids
    assert (t1, t2, t3, t4) == ("Hello world", None, None, "chat text")
    # Token ids as numpy integers (e.g. from a dataset) become plain ints.
    np_req, _ = proc.process_inputs("e", {"prompt_token_ids": np.array(ids)}, params)
    assert np_req.prompt_token_ids == ids and all(type(t) is int for t in np_req.prompt_token_ids)
    # Token ids known to the model but not to the tokenizer are accepted.
    big, _ = proc.process_inputs("f", [BOS_ID, MODEL_VOCAB - 1], params)
    assert big.prompt_token_ids == [BOS_ID, MODEL_VOCAB - 1]


def test_request_fields_pass_through(proc):
    req, _ = proc.process_inputs("r", [1, 5, 6], SamplingParams(), arrival_time=123.0,
                                 priority=-3, cache_salt="salt")
    assert (req.arrival_time, req.priority, req.cache_salt) == (123.0, -3, "salt")
    req, _ = proc.process_inputs("r", {"prompt_token_ids": [1, 5], "cache_salt": "s2"},
                                 SamplingParams())
    assert req.cache_salt == "s2"


def test_max_tokens_none_means_until_max_model_len(proc):
    params = SamplingParams(max_tokens=None)
    req, _ = proc.process_inputs("r", [1, 5, 6, 7, 8], params)
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - 5
    assert params.max_tokens is None          # the caller's object is not modified
    req, _ = proc.process_inputs("r", [1] * (MAX_MODEL_LEN - 1), params)
    assert req.sampling_params.max_tokens == 1


def test_eos_ids_from_tokenizer_and_generation_configs(demo_tokenizer_dir, tmp_path, tok):
    # generation_config.json next to the tokenizer ...
    path = str(tmp_path / "tok")
    shutil.copytree(demo_tokenizer_dir, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS_ID, IM_END_ID]}, f)
    p = InputProcessor(_model_config(path), Tokenizer.from_pretrained(path))
    assert p.process_inputs("r", [1, 5], SamplingParams())[0].eos_token_ids == [EOS_ID, IM_END_ID]
    # ... or in the model directory (ModelConfig.generation_config).
    config = _model_config(demo_tokenizer_dir, generation_config={"eos_token_id": 7})
    p = InputProcessor(config, tok)
    assert p.process_inputs("r", [1, 5], SamplingParams())[0].eos_token_ids == [EOS_ID, 7]


# ---------------------------------------------------------------------- rejected prompts
@pytest.mark.parametrize("prompt", ["", [], {"prompt": ""}, {"prompt_token_ids": []}])
def test_empty_prompt(proc, prompt):
    with pytest.raises(ValueError, match="The prompt cannot be empty"):
        proc.process_inputs("r", prompt, SamplingParams())


@pytest.mark.parametrize("bad_id", [MODEL_VOCAB, MODEL_VOCAB + 100, -1])
def test_out_of_vocab_token_ids(proc, bad_id):
    with pytest.raises(ValueError, match=f"Token id {bad_id} is out of vocabulary"):
        proc.process_inputs("r", [1, 5, bad_id, 6], SamplingParams())


@pytest.mark.parametrize("ids", [[1, 2.0, 3], [1, "2"], [1, True], "not a list of ids"])
def test_non_integer_token_ids(proc, ids):
    with pytest.raises(ValueError):
        proc.process_inputs("r", {"prompt_token_ids": ids}, SamplingParams())


def test_prompt_longer_than_max_model_len(proc, tok):
    n = MAX_MODEL_LEN + 3
    with pytest.raises(ValueError) as e:
        proc.process_inputs("r", [1] * n, SamplingParams())
    assert str(e.value).startswith(f"The decoder prompt (length {n}) is longer than the maximum "
                                   f"model length of {MAX_MODEL_LEN}.")
    long_text = " river" * 40
    n_text = len(tok.encode(long_text))
    with pytest.raises(ValueError, match=rf"\(length {n_text}\) is longer than"):
        proc.process_inputs("r", long_text, SamplingParams())


def test_prompt_of_exactly_max_model_len_leaves_no_room(proc):
    with pytest.raises(ValueError, match=rf"length {MAX_MODEL_LEN}\).*no room to generate"):
        proc.process_inputs("r", [1] * MAX_MODEL_LEN, SamplingParams(max_tokens=None))


def test_sampling_params_checked_against_the_model(proc):
    with pytest.raises(ValueError, match="stop_token_ids contains out-of-vocab token id 5000"):
        proc.process_inputs("r", [1, 5], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="logprobs of 6, which is greater than max_logprobs=5"):
        proc.process_inputs("r", [1, 5], SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        proc.process_inputs("r", [1, 5], SamplingParams(allowed_token_ids=[MODEL_VOCAB]))


def test_unsupported_prompt_shapes(proc):
    with pytest.raises(ValueError, match="multi_modal_data"):
        proc.process_inputs("r", {"prompt": "hi", "multi_modal_data": {}}, SamplingParams())
    with pytest.raises(ValueError, match="'prompt' .*'prompt_token_ids'"):
        proc.process_inputs("r", {"cache_salt": "x"}, SamplingParams())
    with pytest.raises(ValueError, match="Unsupported prompt type int"):
        proc.process_inputs("r", 42, SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        proc.process_inputs("r", "hi", {"max_tokens": 3})


def test_no_tokenizer_accepts_token_ids_only(demo_tokenizer_dir):
    p = InputProcessor(_model_config(demo_tokenizer_dir), None)
    req, _ = p.process_inputs("r", [1, 5], SamplingParams())
    assert req.eos_token_ids == [EOS_ID]     # from config.json when nothing else says
    with pytest.raises(ValueError, match="token ids"):
        p.process_inputs("r", "text", SamplingParams())
