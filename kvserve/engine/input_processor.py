"""InputProcessor: a user's prompt + SamplingParams -> a validated EngineCoreRequest.

Everything that can be wrong with a request is caught here, before it reaches the engine
core, and raised as a ValueError that names the offending value (the server turns it into an
HTTP 400): an empty prompt, token ids outside the vocabulary, a prompt that leaves no room to
generate, sampling parameters the model cannot honour.
"""
from __future__ import annotations

import operator
import time
from typing import Any, Optional, Union

import msgspec

from kvserve.config import ModelConfig, StructuredOutputsConfig
from kvserve.core.messages import EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

# A text prompt, {"prompt": text}, {"prompt_token_ids": ids} (optionally with "prompt": the
# text they came from, kept for the output), or the token ids themselves.
PromptType = Union[str, list[int], dict[str, Any]]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Optional[Tokenizer],
                 structured_outputs_config: Optional[StructuredOutputsConfig] = None,
                 kv_transfer_config: Optional[Any] = None) -> None:
        self.model_config = model_config
        self.kv_transfer_config = kv_transfer_config
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # Model and tokenizer vocabularies can differ (padded embedding tables, tokens only one
        # of them knows); an id is out of vocabulary only if it is outside both.
        self._max_input_id = max(model_config.vocab_size,
                                 tokenizer.vocab_size if tokenizer is not None else 0) - 1
        eos: set[int] = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        # The model directory's generation_config.json (the tokenizer may live elsewhere).
        gen_eos = model_config.generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos.update(int(i) for i in gen_eos)
        if not eos and model_config.hf_config.get("eos_token_id") is not None:
            hf_eos = model_config.hf_config["eos_token_id"]
            eos.update(hf_eos if isinstance(hf_eos, list) else [hf_eos])
        self.eos_token_ids: list[int] = sorted(eos)

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: Optional[float] = None, priority: int = 0,
                       cache_salt: Optional[str] = None) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and tokenize. Returns the request for the engine core and the prompt text
        (None when the prompt was given as token ids only).

        `params` is not modified: when the request needs different values (max_tokens=None
        becomes "up to max_model_len") a copy is made.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        orig_params = params
        prompt_text, prompt_token_ids, dict_salt = self._tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        if params.max_tokens is None:
            params = msgspec.structs.replace(
                params, max_tokens=self.max_model_len - len(prompt_token_ids))
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs a tokenizer; this engine has none.")
            params = msgspec.structs.replace(params) if params is orig_params else params
            params.update_from_tokenizer(self.tokenizer)
        params.verify_against_vocab(self.model_config.vocab_size, self.model_config.max_logprobs)
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        if params.extra_args:
            from kvserve.kv_transfer.params import validate_kv_transfer_params
            validate_kv_transfer_params(params, self.kv_transfer_config)

        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=list(self.eos_token_ids),
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt if cache_salt is not None else dict_salt,
        ), prompt_text

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        """The backend's cheap checks (parse the schema / regex / grammar, no token masks): a
        bad constraint is a ValueError here, before anything is scheduled. The engine core
        compiles it later, off its busy loop."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none.")
        backend = self.structured_outputs_config.backend
        if backend == "guidance":
            raise ValueError("The 'guidance' structured outputs backend is not available in "
                             "kvserve yet; use 'xgrammar' (or 'auto').")
        from kvserve.structured_output.backend_xgrammar import validate_xgrammar_params
        assert params.structured_outputs is not None
        validate_xgrammar_params(params.structured_outputs)

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[str]]:
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(f"Unsupported prompt keys {sorted(unknown)}; a prompt dict takes "
                                 f"'prompt' or 'prompt_token_ids' (and 'cache_salt').")
            cache_salt = prompt.get("cache_salt")
            if prompt.get("prompt_token_ids") is not None:
                text = prompt.get("prompt")
                return text, self._as_token_ids(prompt["prompt_token_ids"]), cache_salt
            if "prompt" not in prompt:
                raise ValueError("A prompt dict needs 'prompt' (text) or 'prompt_token_ids'.")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt cannot be empty.")
            if self.tokenizer is None:
                raise ValueError("This engine has no tokenizer: give the prompt as token ids.")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True), cache_salt
        if isinstance(prompt, (list, tuple)):
            return None, self._as_token_ids(prompt), cache_salt
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: expected a string, a "
                         f"list of token ids, or a dict with 'prompt' / 'prompt_token_ids'.")

    @staticmethod
    def _as_token_ids(ids: Any) -> list[int]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}.")
        ids = list(ids)
        if all(type(t) is int for t in ids):
            return ids
        # numpy / torch integers are fine; floats, strings and bools are not.
        bad = next((t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__")), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids must contain only ints, got {bad!r}.")
        return [operator.index(t) for t in ids]

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("The prompt cannot be empty.")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi > self._max_input_id:
            bad = lo if lo < 0 else hi
            raise ValueError(f"Token id {bad} is out of vocabulary (vocabulary size "
                             f"{self._max_input_id + 1}).")
        n = len(ids)
        if n > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {n}) is longer than the maximum model "
                             f"length of {self.max_model_len}. Make sure that `max_model_len` is "
                             f"no smaller than the number of text tokens.")
        if n == self.max_model_len:
            raise ValueError(f"The decoder prompt (length {n}) is as long as the maximum model "
                             f"length of {self.max_model_len}, which leaves no room to generate "
                             f"tokens; shorten the prompt or raise `max_model_len`.")
