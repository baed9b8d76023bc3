"""Beam search over the engine, as vLLM V1 does it: one engine step per output token.

Each step every live beam of every prompt becomes one engine request for ONE token with
`logprobs = 2 * beam_width`; all of them go to the engine together (one `generate` call
offline, one `asyncio.gather` on the server), so the scheduler batches them in one forward.
A beam's request is its whole sequence (prompt + tokens so far): with prefix caching the full
KV blocks of that sequence are prefix-cache hits on the blocks its parent computed (shared
blocks, not copies); only the tokens after the last full block are computed again.

    step t:  live beams b_1..b_k ──► k requests (max_tokens=1, logprobs=2k) ──► engine
             each answer: the 2k most likely next tokens of b_i with their logprobs
             candidates b_i + [tok], cum_logprob(b_i) + logprob(tok)
                 EOS candidates ─► completed (unless ignore_eos)
                 the others     ─► sorted by score, best k stay live
    end:     completed + live, sorted by score, best beam_width returned

The score is vLLM's `get_beam_search_score`: cum_logprob / len(tokens) ** length_penalty,
tokens counted with the prompt (as vLLM does) and without a final EOS. Within a step every
live beam has the same length, so the choice of live beams is by cum_logprob; the length
penalty decides between beams that ended (EOS) at different steps.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Iterable, Optional, Sequence, Union

from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class BeamSearchSequence:
    """One beam. `tokens` include the prompt (vLLM's layout); `logprobs` has one dict per
    generated token: that step's candidates (the top 2 * beam_width) and their logprobs."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None            # "stop" (EOS) | "length"
    stop_reason: Union[int, str, None] = None      # the EOS id that ended it
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width of them)."""
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float,
                          eos_token_id: Optional[int], length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob divided by the length (prompt included, a final
    EOS not counted) to the power `length_penalty`."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def make_sort_key(eos_token_ids: Iterable[int],
                  length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    eos = frozenset(eos_token_ids)

    def key(beam: BeamSearchSequence) -> float:
        last = beam.tokens[-1] if beam.tokens else None
        return get_beam_search_score(beam.tokens, beam.cum_logprob,
                                     last if last in eos else None, length_penalty)
    return key


@dataclass
class _Instance:
    """The search state of one prompt."""
    prompt_token_ids: list[int]
    cache_salt: Optional[str]
    lora_request: Any
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The algorithm, apart from the engine: `live_beams()` says what to ask the engine this
    step, `advance(answers)` takes each beam's next-token logprobs, `outputs()` ranks."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                 eos_token_ids: Iterable[int],
                 cache_salts: Optional[Sequence[Optional[str]]] = None,
                 lora_requests: Optional[Sequence[Any]] = None) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sort_key = make_sort_key(self.eos_token_ids, params.length_penalty)
        salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
        loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
        self.instances = [
            _Instance(list(p), salt, lora, beams=[BeamSearchSequence(list(p), [], 0.0,
                                                                     num_prompt_tokens=len(p))])
            for p, salt, lora in zip(prompts, salts, loras)]
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not any(
            inst.beams for inst in self.instances)

    def step_params(self) -> SamplingParams:
        # Raw logprobs of the 2k most likely tokens: the top k of all beams' candidates are
        # among them (at most k per beam), and up to k of them may be EOS.
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width,
                              ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def live_beams(self) -> list[tuple[BeamSearchSequence, Optional[str], Any]]:
        """Every live beam of every prompt, in a fixed order, with its prompt's cache salt and
        LoRA adapter."""
        return [(beam, inst.cache_salt, inst.lora_request)
                for inst in self.instances for beam in inst.beams]

    def advance(self, answers: Sequence[Optional[dict[int, Logprob]]]) -> None:
        """`answers[i]`: the next-token logprobs of live beam i (as `live_beams()` ordered
        them); None drops the beam (its request ended without a token)."""
        it = iter(answers)
        for inst in self.instances:
            candidates: list[BeamSearchSequence] = []
            for beam in inst.beams:
                step = next(it)
                if step is None:
                    continue
                for token_id, lp in step.items():
                    child = BeamSearchSequence(
                        tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [step],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                        num_prompt_tokens=beam.num_prompt_tokens)
                    if token_id in self.eos_token_ids and not self.params.ignore_eos:
                        child.finish_reason, child.stop_reason = "stop", token_id
                        inst.completed.append(child)
                    else:
                        candidates.append(child)
            candidates.sort(key=self.sort_key, reverse=True)
            inst.beams = candidates[:self.params.beam_width]
        self.num_steps += 1

    def outputs(self, decode: Optional[Callable[[list[int]], str]] = None
                ) -> list[BeamSearchOutput]:
        """The best beam_width finished or live beams of each prompt, best first. `decode`
        fills `text` (the generated tokens only; a final EOS only with
        include_stop_str_in_output)."""
        result = []
        for inst in self.instances:
            for beam in inst.beams:
                beam.finish_reason = "length"
            ranked = sorted(inst.completed + inst.beams, key=self.sort_key, reverse=True)
            best = ranked[:self.params.beam_width]
            if decode is not None:
                for beam in best:
                    ids = beam.output_token_ids
                    if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                        ids = ids[:-1]
                    beam.text = decode(ids)
            result.append(BeamSearchOutput(sequences=best))
        return result


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """The engine returns at most max_logprobs logprobs; beam search asks for 2 * beam_width."""
    limit = max(max_logprobs // 2, 1)
    if params.beam_width > limit:
        raise ValueError(f"beam_width={params.beam_width} is too large: at most {limit} "
                         f"(beam search asks for 2 * beam_width logprobs per step, and "
                         f"max_logprobs={max_logprobs}; raise --max-logprobs for wider beams).")


def check_length(num_prompt_tokens: int, params: BeamSearchParams, max_model_len: int) -> None:
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, beam search asks for {num_prompt_tokens + params.max_tokens} "
                         f"({num_prompt_tokens} in the prompt, {params.max_tokens} in the "
                         f"completion).")


def _step_answer(out: RequestOutput) -> Optional[dict[int, Logprob]]:
    completion = out.outputs[0] if out.outputs else None
    if completion is None or completion.finish_reason in ("abort", "error"):
        if completion is not None and completion.finish_reason == "error":
            raise RuntimeError(f"beam search step failed: {completion.stop_reason}")
        return None
    return completion.logprobs[0] if completion.logprobs else None


def _step_prompt(beam: BeamSearchSequence, salt: Optional[str]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": beam.tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


# ---------------------------------------------------------------------- offline (LLM)
def run_beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams,
                    lora_requests: Optional[Sequence[Any]] = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: validates every prompt first (tokenizes text prompts), then one
    `llm.generate` call per output token with all live beams of all prompts."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}.")
    engine = llm.llm_engine
    model_config = engine.config.model_config
    check_beam_width(params, model_config.max_logprobs)
    if not engine.config.cache_config.enable_prefix_caching:
        logger.warning("Beam search without prefix caching recomputes every beam's whole "
                       "sequence at every step; enable_prefix_caching=True shares it.")
    processor = engine.input_processor
    loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
    token_ids, salts = [], []
    for prompt, lora in zip(prompts, loras):
        request, _ = engine.process_inputs("beam-search-check", prompt,
                                           SamplingParams(max_tokens=1), lora_request=lora)
        check_length(len(request.prompt_token_ids), params, model_config.max_model_len)
        token_ids.append(request.prompt_token_ids)
        salts.append(request.cache_salt)
    search = BeamSearch(token_ids, params, processor.eos_token_ids, salts, loras)
    step_params = search.step_params()
    steps = range(params.max_tokens)
    if use_tqdm:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc="Beam search", unit="token")
    for _ in steps:
        if search.done:
            break
        live = search.live_beams()
        outs = llm.generate([_step_prompt(b, s) for b, s, _ in live], step_params,
                            use_tqdm=False, lora_request=[lora for _, _, lora in live])
        search.advance([_step_answer(o) for o in outs])
    tokenizer = engine.tokenizer
    return search.outputs(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


# ---------------------------------------------------------------------- server (AsyncLLM)
_beam_request_counter = itertools.count()


async def beam_search_async(engine: Any, prompts: Sequence[list[int]], params: BeamSearchParams,
                            request_id: str, cache_salt: Optional[str] = None,
                            priority: int = 0, lora_request: Any = None
                            ) -> list[BeamSearchOutput]:
    """Beam search over an AsyncLLM (`prompts`: token ids, validated by the caller). Each step
    awaits all beams' one-token requests together; the event loop keeps serving meanwhile.
    Cancelling this coroutine cancels the step's requests (AsyncLLM aborts each)."""
    search = BeamSearch(prompts, params, engine.input_processor.eos_token_ids,
                        [cache_salt] * len(prompts), [lora_request] * len(prompts))
    step_params = search.step_params()
    tag = next(_beam_request_counter)

    async def one(beam: BeamSearchSequence, salt: Optional[str], lora: Any,
                  rid: str) -> RequestOutput:
        final: Optional[RequestOutput] = None
        async for out in engine.generate(_step_prompt(beam, salt), step_params, rid,
                                         priority=priority, lora_request=lora):
            final = out
        assert final is not None
        return final

    while not search.done:
        live = search.live_beams()
        tasks = [asyncio.ensure_future(
            one(b, s, lora, f"{request_id}-beam{tag}-{search.num_steps}-{i}"))
            for i, (b, s, lora) in enumerate(live)]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:
            # One failed or we were cancelled: the step's other requests are aborted too.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance([_step_answer(o) for o in outs])
    tokenizer = engine.tokenizer
    return search.outputs(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def to_request_output(request_id: str, prompt_token_ids: list[int], output: BeamSearchOutput,
                      n: int) -> RequestOutput:
    """The best n beams as one finished RequestOutput (choice j = the j-th best beam), for the
    handlers that format RequestOutputs."""
    outs = [CompletionOutput(index=j, text=b.text or "", token_ids=b.output_token_ids,
                             cumulative_logprob=b.cum_logprob, logprobs=b.logprobs,
                             finish_reason=b.finish_reason, stop_reason=b.stop_reason)
            for j, b in enumerate(output.sequences[:n])]
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_token_ids,
                         prompt_logprobs=None, outputs=outs, finished=True)


async def beam_search_stream(engine: Any, prompt_token_ids: list[int], params: BeamSearchParams,
                             request_id: str, n: int, cache_salt: Optional[str] = None,
                             priority: int = 0, lora_request: Any = None
                             ) -> AsyncGenerator[RequestOutput, None]:
    """One prompt's beam search shaped like `AsyncLLM.generate`: one final RequestOutput."""
    outputs = await beam_search_async(engine, [prompt_token_ids], params, request_id,
                                      cache_salt=cache_salt, priority=priority,
                                      lora_request=lora_request)
    yield to_request_output(request_id, prompt_token_ids, outputs[0], n)
