"""LLMEngine: the synchronous frontend — inputs in, engine core steps, RequestOutputs out."""
from __future__ import annotations

import time
from typing import Any, Optional

from kvserve.config import KVServeConfig
from kvserve.core.messages import EngineCoreRequest
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.output_processor import OutputProcessor, ParentRequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: KVServeConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model_config.tokenizer)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer,
                                              config.structured_outputs_config,
                                              config.kv_transfer_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=not config.disable_log_stats)
        self.engine_core = EngineCoreClient.make_client(config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    # ------------------------------------------------------------------ requests
    def process_inputs(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival_time: Optional[float] = None, priority: int = 0,
                       cache_salt: Optional[str] = None) -> tuple[EngineCoreRequest, Optional[str]]:
        return self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time=arrival_time or time.time(),
            priority=priority, cache_salt=cache_salt)

    def add_processed_request(self, request: EngineCoreRequest, prompt_text: Optional[str],
                              params: SamplingParams) -> None:
        if params.n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request.request_id, params)
        for idx in range(params.n):
            child = parent.make_child_request(request, idx)
            self.output_processor.add_request(child, prompt_text, parent, idx)
            self.engine_core.add_request(child)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0) -> None:
        request, text = self.process_inputs(request_id, prompt, params, arrival_time, priority)
        self.add_processed_request(request, text, params)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(self.output_processor.last_aborted_child_ids)
        return outputs

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:   # stop strings: the core must free them now
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
