"""LLM: offline batch generation, vLLM's `LLM` class."""
from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Sequence, Union

from kvserve.entrypoints.beam_search import BeamSearchOutput, run_beam_search
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
import msgspec

from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]


class LLM:
    """Generate from a batch of prompts with a Hugging Face checkpoint (or model="demo").

    Engine settings are keyword arguments with vLLM's names (dtype, max_model_len, block_size,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    enable_chunked_prefill, long_prefill_token_threshold, scheduling_policy, seed, ...).
    """

    def __init__(self, model: str = "demo", **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._request_counter = itertools.count()

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 priority: Optional[list[int]] = None) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        # Offline generation only needs the final result: skip building per-step outputs.
        params_list = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                       for p in params_list]
        priorities = _broadcast(priority if priority is not None else 0, len(prompt_list), "priority")
        # Validate everything before anything is scheduled: one bad prompt rejects the batch
        # and leaves the engine as it was.
        ids = [str(next(self._request_counter)) for _ in prompt_list]
        prepared = [self.llm_engine.process_inputs(rid, p, sp, priority=pr)
                    for rid, p, sp, pr in zip(ids, prompt_list, params_list, priorities)]
        for rid, (request, prompt_text), sp in zip(ids, prepared, params_list):
            self.llm_engine.add_processed_request(request, prompt_text, sp)
        return self._run_engine(ids, use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the best `params.beam_width` sequences of each prompt,
        best first (kvserve/entrypoints/beam_search.py: one engine call per token, all beams batched,
        shared prefixes served from the prefix cache)."""
        return run_beam_search(self, _as_prompt_list(prompts), params, use_tqdm=use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                tokenize=False, **(chat_template_kwargs or {}))
            # The template already carries the special tokens (BOS); do not add a second one.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.engine_core.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.engine_core.call_utility("get_stats")

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ loop
    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start, in_toks, out_toks = time.perf_counter(), 0, 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if not out.finished:
                        continue
                    finished[out.request_id] = out
                    if pbar is not None:
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        pbar.set_postfix_str(f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                             f"output: {out_toks / elapsed:.2f} toks/s")
                        pbar.update(1)
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]   # one prompt given as token ids
    return prompts


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return list(value)
    return [value] * n
