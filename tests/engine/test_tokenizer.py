"""Tokenizer: the same ids, text and chat prompts as transformers' fast tokenizer."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from kvserve.model.demo import BOS_ID, EOS_ID, IM_END_ID, UNK_ID
from kvserve.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "café naïve résumé über straße",
    "東京 日本語 中文 한국어",
    "emoji 🙂🚀 ✓ mixed with text",
    "line one\nline two\ttabbed",
    "<s> special tokens </s> in <|im_start|>text<|im_end|>",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? 🙂"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 東京?"},
]


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_tokenizer_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def _copy_dir(src: str, dst: str, config_update: dict | None = None,
              drop: tuple[str, ...] = ()) -> str:
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in drop:
        cfg.pop(key, None)
    cfg.update(config_update or {})
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


# ---------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok, hf_tok, text, add_special_tokens):
    assert tok.encode(text, add_special_tokens) == hf_tok.encode(
        text, add_special_tokens=add_special_tokens)


def test_encode_adds_one_bos(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf_tok, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(TEXTS[5], add_special_tokens=False)) == TEXTS[5]


def test_special_tokens_and_vocab_match_transformers(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == BOS_ID
    assert tok.eos_token_id == hf_tok.eos_token_id == EOS_ID
    assert tok.unk_token_id == hf_tok.unk_token_id == UNK_ID
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.vocab_size == len(hf_tok)
    assert tok.all_special_ids == hf_tok.all_special_ids
    assert tok.eos_token_ids == {EOS_ID}      # no generation_config.json in this directory
    ids = tok.encode("café 🙂 東京 <|im_end|>")
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[1]) == hf_tok.convert_ids_to_tokens(ids[1])
    assert tok.get_vocab() == hf_tok.get_vocab()


def test_decode_tokens_is_per_token_decode(tok):
    ids = tok.encode("café 🙂 </s>", add_special_tokens=False) + [EOS_ID, BOS_ID, EOS_ID]
    expected = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert tok.decode_tokens(ids) == expected
    assert tok.decode_tokens(ids) == expected          # from the cache
    assert tok.decode_tokens([BOS_ID, EOS_ID]) == ["<s>", "</s>"]


def test_added_token_dicts_and_generation_config(demo_tokenizer_dir, tmp_path):
    path = _copy_dir(demo_tokenizer_dir, str(tmp_path / "t"), {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"content": "</s>", "special": True},
        "additional_special_tokens": ["<|im_start|>", {"content": "<|im_end|>"}],
    })
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS_ID, IM_END_ID]}, f)
    tok = Tokenizer.from_pretrained(path)
    assert tok.bos_token_id == BOS_ID and tok.eos_token_id == EOS_ID
    assert tok.eos_token_ids == {EOS_ID, IM_END_ID}
    assert tok.all_special_ids == [BOS_ID, EOS_ID, UNK_ID, 3, IM_END_ID]

    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": IM_END_ID}, f)
    assert Tokenizer.from_pretrained(path).eos_token_ids == {EOS_ID, IM_END_ID}


def test_missing_tokenizer_json_names_the_file(demo_tokenizer_dir, tmp_path):
    path = tmp_path / "no_tok"
    path.mkdir()
    shutil.copy(os.path.join(demo_tokenizer_dir, "tokenizer_config.json"), path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(path))
    with pytest.raises(ValueError, match="not a directory"):
        Tokenizer.from_pretrained(str(tmp_path / "does_not_exist"))


def test_llama_class_flags_rebuild_post_processor(demo_tokenizer_dir, tmp_path):
    """For Llama-class tokenizers add_bos_token / add_eos_token decide (as transformers'
    LlamaTokenizerFast does); other classes keep tokenizer.json's post-processor."""
    no_bos = Tokenizer.from_pretrained(_copy_dir(demo_tokenizer_dir, str(tmp_path / "a"), {
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": False, "add_eos_token": True}))
    plain = Tokenizer.from_pretrained(demo_tokenizer_dir).encode("Hello world", False)
    assert no_bos.encode("Hello world") == plain + [EOS_ID]
    generic = Tokenizer.from_pretrained(_copy_dir(demo_tokenizer_dir, str(tmp_path / "b"), {
        "add_bos_token": False}))
    assert generic.encode("Hello world") == [BOS_ID] + plain


# ---------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, add_generation_prompt):
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert text == hf_tok.apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text.startswith("<s><|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_tokenize_has_a_single_bos(tok, hf_tok):
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True)
    text = tok.apply_chat_template(CONVERSATION)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    hf_ids = hf_tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)
    # The mistake the docs warn about: encoding with special tokens doubles the BOS.
    assert tok.encode(text)[:2] == [BOS_ID, BOS_ID]


HF_STYLE_TEMPLATE = """
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- '[SYS] ' + message['content'] }}
    {%- elif (loop.index0 % 2 == 0) != (message['role'] == 'user') %}
        {{- raise_exception('Conversation roles must alternate user/assistant/...') }}
    {%- else %}
        {% if message['role'] == 'user' %}
        [{{ message['role'] | upper }}] {{ message['content'] }}
        {% else %}
        [BOT] {{ message['content'] }}
        {% endif %}
    {%- endif %}
    {%- if loop.index > 10 %}{% break %}{% endif %}
{%- endfor %}
{{- tools | tojson }}
{%- if add_generation_prompt %}[BOT]{% endif %}
"""


def test_template_environment_matches_transformers(tok, hf_tok):
    """trim_blocks / lstrip_blocks, loop controls and tojson (non-ASCII kept) render the same."""
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
    tools = [{"name": "lookup", "description": "Cherche «ville» 東京", "n": 1}]
    ours = tok.apply_chat_template(messages, chat_template=HF_STYLE_TEMPLATE, tools=tools)
    theirs = hf_tok.apply_chat_template(messages, chat_template=HF_STYLE_TEMPLATE, tools=tools,
                                        tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "東京" in ours and "\\u" not in ours


def test_raise_exception_is_a_value_error(tok):
    bad = [{"role": "user", "content": "u"}, {"role": "user", "content": "u again"}]
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        tok.apply_chat_template(bad, chat_template=HF_STYLE_TEMPLATE)


def test_strftime_now_and_template_kwargs(tok):
    text = tok.apply_chat_template(
        [], chat_template="{{ strftime_now('%Y') }}|{{ custom }}|{{ eos_token }}", custom="x")
    import datetime
    assert text == f"{datetime.datetime.now().year}|x|</s>"


def test_template_sandbox_blocks_attribute_escape(tok):
    with pytest.raises(ValueError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="syntax"):
        tok.apply_chat_template([], chat_template="{% for %}")


def test_named_templates_and_template_file(demo_tokenizer_dir, tmp_path):
    path = _copy_dir(demo_tokenizer_dir, str(tmp_path / "named"), {"chat_template": [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]})
    tok = Tokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    assert tok.apply_chat_template(msgs, chat_template="X{{ 1 + 1 }}") == "X2"
    # A chat_template.jinja file (newer transformers) takes precedence.
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("J{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained(path).apply_chat_template(msgs) == "Jhi"


def test_no_chat_template_is_a_clear_error(demo_tokenizer_dir, tmp_path):
    tok = Tokenizer.from_pretrained(
        _copy_dir(demo_tokenizer_dir, str(tmp_path / "plain"), drop=("chat_template",)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   chat_template="{{ messages[0].content }}") == "hi"


def test_continue_final_message(tok, hf_tok):
    msgs = [{"role": "user", "content": "Name a city."},
            {"role": "assistant", "content": "The city is"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe city is")
    assert text == hf_tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        tok.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)
