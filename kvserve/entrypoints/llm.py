"""LLM: offline batch generation, vLLM's `LLM` class."""
from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Sequence, Union

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.request import LoRARequest
from kvserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
import msgspec

from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams

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
                 priority: Optional[list[int]] = None,
                 lora_request: Union["LoRARequest", Sequence["LoRARequest"], None] = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: one LoRARequest for every prompt, or a list with one per prompt
        (None entries: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        # Offline generation only needs the final result: skip building per-step outputs.
        params_list = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                       for p in params_list]
        priorities = _broadcast(priority if priority is not None else 0, len(prompt_list), "priority")
        loras = _broadcast(lora_request, len(prompt_list), "lora_request")
        return self._run_engine(self._add_requests(prompt_list, params_list, priorities, loras),
                                use_tqdm)

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               *, use_tqdm: bool = True, pooling_task: Optional[str] = None
               ) -> list[PoolingRequestOutput]:
        """Pooled hidden states of each prompt (vLLM's LLM.encode); needs --runner pooling."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(pooling_params or PoolingParams(), len(prompt_list),
                                 "pooling_params")
        if pooling_task is not None:
            params_list = [msgspec.structs.replace(p, task=pooling_task) for p in params_list]
        ids = self._add_requests(prompt_list, params_list, [0] * len(prompt_list))
        return self._run_engine(ids, use_tqdm)   # type: ignore[return-value]

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], *, use_tqdm: bool = True,
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's LLM.embed): `.outputs.embedding` is a list of
        floats, pooled and normalised as the model's pooler config says."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def _add_requests(self, prompts: list[PromptType], params: list[Any], priorities: list[int],
                      loras: Optional[list[Any]] = None) -> list[str]:
        # Validate everything before anything is scheduled: one bad prompt rejects the batch
        # and leaves the engine as it was.
        ids = [str(next(self._request_counter)) for _ in prompts]
        loras = loras or [None] * len(prompts)
        prepared = [self.llm_engine.process_inputs(rid, p, sp, priority=pr, lora_request=lr)
                    for rid, p, sp, pr, lr in zip(ids, prompts, params, priorities, loras)]
        for (request, prompt_text), sp in zip(prepared, params):
            self.llm_engine.add_processed_request(request, prompt_text, sp)
        return ids

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             lora_request: Union["LoRARequest", Sequence["LoRARequest"], None] = None,
             ) -> list[RequestOutput]:
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def add_lora(self, lora_request: "LoRARequest") -> bool:
        """Load an adapter now (its first request then waits for nothing)."""
        self.llm_engine.input_processor.lora_checker.check(lora_request)
        return self.llm_engine.engine_core.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        self.llm_engine.input_processor.lora_checker.forget(lora_int_id)
        return self.llm_engine.engine_core.call_utility("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        return self.llm_engine.engine_core.call_utility("list_loras")

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
                        if isinstance(out, RequestOutput):
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
