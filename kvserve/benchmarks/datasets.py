"""Benchmark workloads: `random`, `prefix` and ShareGPT-format JSON files.

Every dataset yields `SampleRequest`s that carry token ids, so each backend (kvserve, Hugging
Face, a server) is fed exactly the same tokens and no tokenizer round trip changes prompt
lengths. Flags and defaults follow `vllm bench` (`--dataset-name`, `--random-input-len`,
`--random-output-len`, `--random-range-ratio`, `--num-prompts`, `--dataset-path`); like vLLM,
the engine's `--seed` also seeds the prompts.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "prefix", "sharegpt")


@dataclass
class SampleRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""
    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: Optional[str] = None          # the text, where the dataset has one (ShareGPT)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def to_engine_prompt(self) -> dict[str, Any]:
        """The prompt as `LLM.generate` takes it (token ids, so nothing is re-tokenized)."""
        out: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's rule: lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}.")
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}.")
    lo = max(1, int(length * (1.0 - range_ratio)))
    hi = max(lo, int(round(length * (1.0 + range_ratio))))
    return lo, hi


def _token_range(vocab_size: int, special_ids: Sequence[int]) -> tuple[int, int]:
    """Draw prompt tokens above the special ids (BOS/EOS/...), so prompts look like text."""
    low = max(special_ids, default=-1) + 1
    if low >= vocab_size:
        low = 0
    return low, vocab_size


def sample_random_requests(num_requests: int, input_len: int, output_len: int,
                           vocab_size: int, range_ratio: float = 0.0, seed: int = 0,
                           special_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """`random`: uniform random token ids, lengths drawn around input_len / output_len."""
    rng = random.Random(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    tok_lo, tok_hi = _token_range(vocab_size, special_ids)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(in_lo, in_hi)
        ids = [rng.randrange(tok_lo, tok_hi) for _ in range(n_in)]
        requests.append(SampleRequest(ids, rng.randint(out_lo, out_hi)))
    return requests


def sample_prefix_requests(num_requests: int, prefix_len: int, num_prefixes: int,
                           suffix_len: int, output_len: int, vocab_size: int,
                           range_ratio: float = 0.0, seed: int = 0,
                           special_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """`prefix`: each prompt is one of `num_prefixes` shared prefixes of `prefix_len` tokens
    followed by its own random suffix; the prefixes are interleaved, as a server sees them.
    With prefix caching, all but the first prompt of each prefix skip the prefix's prefill."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}.")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}.")
    rng = random.Random(seed)
    tok_lo, tok_hi = _token_range(vocab_size, special_ids)
    prefixes = [[rng.randrange(tok_lo, tok_hi) for _ in range(prefix_len)]
                for _ in range(num_prefixes)]
    suffixes = sample_random_requests(num_requests, suffix_len, output_len, vocab_size,
                                      range_ratio, seed + 1, special_ids)
    order = [i % num_prefixes for i in range(num_requests)]
    rng.shuffle(order)
    return [SampleRequest(prefixes[p] + s.prompt_token_ids, s.expected_output_len)
            for p, s in zip(order, suffixes)]


def sample_sharegpt_requests(dataset_path: str, num_requests: int, tokenizer: Any,
                             output_len: Optional[int] = None, seed: int = 0,
                             max_model_len: Optional[int] = None) -> list[SampleRequest]:
    """ShareGPT format: a JSON list of {"conversations": [{"from", "value"}, ...]}.

    The first turn is the prompt (tokenized with the model's tokenizer); the second turn's
    token count is the output length unless `output_len` is given. Like vLLM, pairs with a
    prompt or output shorter than 4 tokens, a prompt over 1024 tokens or a total over 2048
    (or over max_model_len) are skipped; the sampled set is repeated if too few remain.
    """
    with open(dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{dataset_path}: expected a JSON list of conversations, got "
                         f"{type(data).__name__}.")
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)
    max_total = min(2048, max_model_len) if max_model_len else 2048
    requests: list[SampleRequest] = []
    for conv in convs:
        if len(requests) == num_requests:
            break
        prompt = conv[0]["value"]
        prompt_ids = tokenizer.encode(prompt)
        n_out = output_len if output_len is not None else len(
            tokenizer.encode(conv[1]["value"], add_special_tokens=False))
        if len(prompt_ids) < 4 or n_out < 4 or len(prompt_ids) > 1024 \
                or len(prompt_ids) + n_out > max_total:
            continue
        requests.append(SampleRequest(prompt_ids, n_out, prompt=prompt))
    if not requests:
        raise ValueError(f"{dataset_path}: no conversation has a usable prompt / reply pair "
                         f"(first two turns, 4..1024 prompt tokens, total <= {max_total}).")
    if len(requests) < num_requests:
        logger.warning("%s has only %d usable conversations; repeating them to make %d.",
                       dataset_path, len(requests), num_requests)
        requests = [requests[i % len(requests)] for i in range(num_requests)]
    return requests


# ---------------------------------------------------------------------------------------------
# CLI

def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                   help="random: random token ids; prefix: prompts sharing long prefixes; "
                        "sharegpt: a ShareGPT-format JSON file (--dataset-path).")
    g.add_argument("--dataset-path", type=str, default=None,
                   help="Path of the ShareGPT-format JSON file.")
    g.add_argument("--num-prompts", type=int, default=1000, help="Number of requests.")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt length; prefix: length of the suffix after the prefix.")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="Output length for random and prefix (the mean, with a range ratio).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are drawn uniformly from [len * (1 - r), len * (1 + r)].")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="prefix: tokens in each shared prefix.")
    g.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix: number of distinct shared prefixes.")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output length for every request (default: the reply's).")


def _model_vocab_size(model_path: str) -> int:
    from kvserve.config import load_hf_config
    from kvserve.model.gguf import read_gguf_config

    cfg, _ = load_hf_config(model_path, gguf_config=read_gguf_config(model_path))
    cfg = cfg.get("text_config", cfg)
    return int(cfg["vocab_size"])


def get_samples(args: argparse.Namespace, model_path: str, tokenizer: Any,
                max_model_len: Optional[int] = None) -> list[SampleRequest]:
    """The requests chosen by the dataset flags, for the model at `model_path`."""
    seed = getattr(args, "seed", 0) or 0
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}.")
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json.")
        return sample_sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer,
                                        args.sharegpt_output_len, seed,
                                        max_model_len)
    # Random ids must be valid for the model and the tokenizer (it may be smaller).
    vocab = min(_model_vocab_size(model_path), tokenizer.vocab_size)
    special = tokenizer.all_special_ids
    if args.dataset_name == "random":
        requests = sample_random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len, vocab,
            args.random_range_ratio, seed, special)
    elif args.dataset_name == "prefix":
        requests = sample_prefix_requests(
            args.num_prompts, args.prefix_len, args.num_prefixes, args.random_input_len,
            args.random_output_len, vocab, args.random_range_ratio, seed, special)
    else:
        raise ValueError(f"Unknown dataset {args.dataset_name!r}; choose one of "
                         f"{', '.join(DATASET_NAMES)}.")
    if max_model_len is not None:
        longest = max(r.prompt_len + r.expected_output_len for r in requests)
        if longest > max_model_len:
            raise ValueError(f"The longest request needs {longest} tokens (prompt + output), "
                             f"more than max_model_len {max_model_len}: shorten the lengths.")
    return requests


def perplexity_text(paragraphs: int = 2) -> str:
    """Plain English prose (perplexity.txt) for perplexity checks of a trained model (the
    demo): the packed GGUF tests read both paragraphs, benchmarks/vs_llamacpp.py the first."""
    with open(os.path.join(os.path.dirname(__file__), "perplexity.txt")) as f:
        return " ".join(p.replace("\n", " ") for p in f.read().strip().split("\n\n")[:paragraphs])


def prompt_perplexity(llm: Any, text: str) -> tuple[float, list[int]]:
    """Perplexity of `text` under `llm` (an LLM) from its prompt logprobs, and its token ids."""
    from kvserve.sampling_params import SamplingParams
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ids, lps = list(out.prompt_token_ids), out.prompt_logprobs
    nll = [-lps[i][t].logprob for i, t in enumerate(ids) if i > 0]
    return math.exp(sum(nll) / len(nll)), ids
