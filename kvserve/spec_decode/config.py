"""SpeculativeConfig: vLLM's `speculative_config` (JSON on the CLI, a dict for `LLM(...)`).

Validated when the engine config is built, before any process starts: an unknown method, a
non-positive `num_speculative_tokens`, bad n-gram windows, a draft checkpoint that is missing
or whose vocabulary / tokenizer differs from the target's are all `ValueError`s.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvserve.json_config import parse_json_config

SPEC_METHODS = ("ngram", "draft_model", "eagle")
# vLLM's other methods: named, so that asking for one says "not yet" rather than "unknown".
_NOT_YET = ("eagle3", "medusa", "mtp", "suffix")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # n-gram prompt lookup: the longest then shorter suffixes of the context, down to min.
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    # draft_model: a checkpoint directory sharing the target's tokenizer and vocabulary;
    # eagle: an EAGLE-Llama head checkpoint (kvserve/model/eagle.py).
    model: Optional[str] = None
    draft_tensor_parallel_size: Optional[int] = None
    # Adaptive speculation ("never slower", see kvserve/spec_decode/adaptive.py):
    # no drafts in a step with more running requests than this (vLLM's field name).
    disable_by_batch_size: Optional[int] = 4
    # A request drafts while the EMA of its acceptance rate is at least this and at least the
    # break-even rate measured from step times; 0 turns the per-request rule off (every
    # request drafts whenever it can). A request that stopped probes again (one draft token)
    # after `probe_interval` of its steps (doubling after each failed probe, up to 8x); a new
    # request starts from the acceptance of the requests before it. With the rule
    # on, num_speculative_tokens is the most a request drafts per step: fewer where verifying
    # that many costs more than they are expected to gain (measured step times).
    min_acceptance_rate: float = 0.25
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.method in _NOT_YET:
            raise ValueError(f"Speculative decoding method {self.method!r} is not supported by "
                             f"kvserve yet; supported: {', '.join(SPEC_METHODS)}.")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"Unknown speculative decoding method {self.method!r}; supported: "
                             f"{', '.join(SPEC_METHODS)}.")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an integer >= 1, got "
                             f"{self.num_speculative_tokens!r}.")
        if self.method == "ngram":
            self._init_ngram()
        else:
            self._init_draft_model()
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1 or null, got "
                             f"{self.disable_by_batch_size}.")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}.")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}.")

    def _init_ngram(self) -> None:
        # vLLM's defaults: neither given -> 5 and 5; one given -> the other equals it.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo < 1 or hi < lo:
            raise ValueError(f"prompt_lookup_min ({lo}) must be >= 1 and <= prompt_lookup_max "
                             f"({hi}).")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.model is not None:
            raise ValueError("speculative method 'ngram' takes no draft 'model'.")

    def _init_draft_model(self) -> None:
        if not self.model:
            raise ValueError(f"speculative method {self.method!r} needs 'model' (the draft "
                             "checkpoint directory).")
        path = os.path.abspath(os.path.expanduser(self.model))
        if not os.path.isfile(os.path.join(path, "config.json")):
            what = "EAGLE checkpoint" if self.method == "eagle" else "Draft model"
            raise ValueError(f"{what} {self.model!r} not found: {path} has no config.json.")
        self.model = path
        tp = self.draft_tensor_parallel_size
        if tp is not None and tp < 1:
            raise ValueError(f"draft_tensor_parallel_size must be >= 1, got {tp}.")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots allocated past each step's tokens: a draft model writes its drafts' KV
        there while proposing (n-gram writes none)."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    def verify_with_target(self, target_hf_config: dict, target_tokenizer: str,
                           tensor_parallel_size: int, max_model_len: int) -> None:
        """A draft model must share the target's vocabulary and tokenizer."""
        if self.method == "ngram":
            return
        assert self.model is not None
        with open(os.path.join(self.model, "config.json")) as f:
            draft_cfg = json.load(f)
        if self.method == "eagle":
            self._verify_eagle(draft_cfg, target_hf_config, tensor_parallel_size, max_model_len)
            return
        if int(draft_cfg.get("vocab_size", -1)) != int(target_hf_config["vocab_size"]):
            raise ValueError(f"Draft model vocab_size ({draft_cfg.get('vocab_size')}) differs "
                             f"from the target's ({target_hf_config['vocab_size']}).")
        draft_max = int(draft_cfg.get("max_position_embeddings") or 2048)
        if draft_max < max_model_len:
            raise ValueError(f"Draft model max_position_embeddings ({draft_max}) is smaller "
                             f"than max_model_len ({max_model_len}).")
        draft_tok = _tokenizer_vocab(self.model)
        target_tok = _tokenizer_vocab(target_tokenizer)
        if draft_tok is not None and target_tok is not None and draft_tok != target_tok:
            raise ValueError(f"Draft model {self.model!r} has a different tokenizer from the "
                             "target model's (speculation needs the same token ids).")
        tp = self.draft_tensor_parallel_size
        if tp is None:
            self.draft_tensor_parallel_size = tensor_parallel_size
        elif tp != tensor_parallel_size:
            raise ValueError(f"draft_tensor_parallel_size ({tp}) must equal the target's "
                             f"tensor_parallel_size ({tensor_parallel_size}): the draft runs "
                             "on the same worker ranks.")

    def _verify_eagle(self, cfg: dict, target_hf_config: dict, tensor_parallel_size: int,
                      max_model_len: int) -> None:
        """An EAGLE head reads the target's hidden states and (unless it has its own)
        embedding and LM head: the hidden size must match, and its own ones the vocabulary."""
        from kvserve.model.eagle import eagle_weight_shapes
        hidden = int(target_hf_config["hidden_size"])
        if int(cfg.get("hidden_size", -1)) != hidden:
            raise ValueError(f"EAGLE head hidden_size ({cfg.get('hidden_size')}) differs from "
                             f"the target's ({hidden}).")
        if int(cfg.get("max_position_embeddings") or 2048) < max_model_len:
            raise ValueError(f"EAGLE head max_position_embeddings "
                             f"({cfg.get('max_position_embeddings')}) is smaller than "
                             f"max_model_len ({max_model_len}).")
        try:
            shapes = eagle_weight_shapes(self.model)
        except FileNotFoundError as e:
            raise ValueError(f"EAGLE checkpoint {self.model!r}: {e}") from None
        if shapes.get("fc.weight") != (hidden, 2 * hidden):
            raise ValueError(f"EAGLE checkpoint {self.model!r} has no fc.weight of shape "
                             f"[{hidden}, {2 * hidden}] (got {shapes.get('fc.weight')}): not "
                             "an EAGLE-Llama head for this target.")
        vocab = int(target_hf_config["vocab_size"])
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in shapes and shapes[name][0] != vocab:
                raise ValueError(f"EAGLE checkpoint {name} has {shapes[name][0]} rows; the "
                                 f"target's vocab_size is {vocab}.")
        if self.draft_tensor_parallel_size not in (None, tensor_parallel_size):
            raise ValueError("draft_tensor_parallel_size must equal the target's "
                             "tensor_parallel_size for an EAGLE head.")
        self.draft_tensor_parallel_size = tensor_parallel_size

    @staticmethod
    def parse(value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_config(value, "speculative_config", SpeculativeConfig)
        return SpeculativeConfig(**value)


def _tokenizer_vocab(path: str) -> Optional[Any]:
    """The vocabulary of a tokenizer.json (None when there is none to compare)."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else None
    if file is None or not os.path.isfile(file):
        return None
    with open(file) as f:
        tok = json.load(f)
    return ((tok.get("model") or {}).get("vocab"), tok.get("added_tokens"))
