"""The built-in demo model and the tiny checkpoints the tests use.

`model="demo"` resolves to a small deterministic Llama checkpoint built once under the user's
cache directory: a byte-level BPE tokenizer trained with `tokenizers` on a fixed corpus, and
random weights from a fixed seed, saved as real safetensors + config.json. It is then loaded
by the same loader as any Hugging Face checkpoint.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but they their one all first new two been more its who after "
    "also time would other into over some only may years most world city state people "
    "school system music film part best during under high where because capital france "
    "paris hello name model language token engine cache block batch prefix decode prefill "
    "request server fast memory attention layer weight vector matrix stream queue sample "
    "river mountain ocean forest garden window kitchen morning evening summer winter story "
    "king queen castle dragon robot computer science history number letter question answer "
    "café naïve résumé über straße 東京 日本語 中文 한국어 emoji 🙂 🚀 ✓"
).split()


def _corpus(n_lines: int = 4000) -> list[str]:
    # A fixed linear congruential generator keeps the corpus identical on every machine.
    state, lines = 12345, []
    for _ in range(n_lines):
        words = []
        state = (state * 1103515245 + 12345) % (1 << 31)
        for _ in range(6 + state % 14):
            state = (state * 1103515245 + 12345) % (1 << 31)
            words.append(_WORDS[state % len(_WORDS)])
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + ".")
    return lines


def train_demo_tokenizer(out_dir: str, vocab_size: int = 1024,
                         model_max_length: int = 2048) -> None:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
