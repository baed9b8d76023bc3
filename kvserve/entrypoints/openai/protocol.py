"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extras.

Field names and defaults are OpenAI's; the extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `min_tokens`, `ignore_eos`, ...) are vLLM's, so a
request written for `vllm serve` works here unchanged. Unknown fields are accepted and
ignored (logged), as OpenAI clients send fields a server may not know.

`to_sampling_params()` maps a request to `SamplingParams`. Sampling fields a request leaves
out fall back to the model's `generation_config.json` defaults (temperature, top_p, ...), then
to OpenAI's defaults, as vLLM does. `max_tokens` left out means "until the context is full".
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from kvserve.entrypoints.openai.tool_calls import tool_choice_schema
from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# The generation_config.json keys that become default sampling values (vLLM's list).
DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                    "repetition_penalty": 1.0}


# Bounds on what one request may list (each entry is checked against the output every step).
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 4096
MAX_BAD_WORDS = 256
# Integers travel to the engine as 64-bit (msgpack): larger ones are a 400, not a 500.
_INT64 = dict(ge=-(2**63), le=2**63 - 1)


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (and reported by `ignored_fields`), never a 400: clients send
    # fields of newer API versions.
    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# ---------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- models
class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------- shared pieces
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    # OpenAI's shape: {"name": ..., "schema": {...}, "strict": ...}
    json_schema: Optional[dict[str, Any]] = None

    def to_structured_outputs(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema.")
            return StructuredOutputsParams(json=schema)
        return None


class _SamplingRequest(OpenAIBaseModel):
    """The sampling fields completions and chat share (OpenAI's and vLLM's extras)."""

    # NaN / Infinity (which Python's JSON parser accepts) are not sampling values.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Optional[str] = None
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    seed: Optional[int] = Field(default=None, **_INT64)
    stop: Optional[Union[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)],
                         Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                                   Field(max_length=MAX_STOP_STRINGS)]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[Annotated[list[str], Field(max_length=MAX_BAD_WORDS)]] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    priority: int = Field(default=0, **_INT64)
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    return_token_ids: Optional[bool] = None
    # vLLM's extra body field: {json | regex | choice | grammar | json_object | structural_tag}
    structured_outputs: Optional[dict[str, Any]] = None
    # Disaggregated prefill/decode (vLLM's field): do_remote_decode / do_remote_prefill, ...
    kv_transfer_params: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string.")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 (or -1 for max_model_len).")
        return self

    def _sampling_kwargs(self, default_sampling_params: Optional[dict[str, Any]]) -> dict[str, Any]:
        defaults = dict(_OPENAI_DEFAULTS)
        defaults.update(default_sampling_params or {})
        picked = {k: (getattr(self, k) if getattr(self, k) is not None else defaults[k])
                  for k in DEFAULT_SAMPLING_KEYS}
        return dict(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            # Streams get only what is new; a whole response needs only the end.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
            extra_args=({"kv_transfer_params": self.kv_transfer_params}
                        if self.kv_transfer_params is not None else None),
            **picked,
        )

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """`response_format` (json_schema / json_object) or `structured_outputs`; one only."""
        from_format = self.response_format.to_structured_outputs() if self.response_format else None
        if self.structured_outputs is not None:
            if from_format is not None:
                raise ValueError("Set either response_format or structured_outputs, not both.")
            if not isinstance(self.structured_outputs, dict):
                raise ValueError("structured_outputs must be an object.")
            known = set(StructuredOutputsParams.__struct_fields__)
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(f"Unknown structured_outputs field(s) {unknown}; known: "
                                 f"{sorted(known)}.")
            return StructuredOutputsParams(**self.structured_outputs)
        return from_format


def _logit_bias_keys_are_ids(logit_bias: Optional[dict[str, float]]) -> None:
    for key in logit_bias or {}:
        try:
            int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), "
                             f"got {key!r}.") from None


# ---------------------------------------------------------------------- completions
# Non-empty prompts, as constraints in the schema too (clients and fuzzers read them there);
# the "before" validators give the clear message first.
_TokenIds = Annotated[list[int], Field(min_length=1)]
_PromptText = Annotated[str, Field(min_length=1)]
Prompt = Union[_TokenIds, Annotated[list[_TokenIds], Field(min_length=1)], _PromptText,
               Annotated[list[_PromptText], Field(min_length=1)]]
ChatMessage = Annotated[dict[str, Any], WithJsonSchema({
    "type": "object", "required": ["role"], "additionalProperties": True,
    "properties": {"role": {"type": "string"}}})]


def _is_empty_prompt(p: Any) -> bool:
    return isinstance(p, (str, list)) and (
        len(p) == 0 or (isinstance(p, list) and any(isinstance(x, (str, list)) and len(x) == 0
                                                    for x in p)))


class CompletionRequest(_SamplingRequest):
    # https://platform.openai.com/docs/api-reference/completions/create
    prompt: Prompt
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.suffix is not None:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n).")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs}.")
        _logit_bias_keys_are_ids(self.logit_bias)
        if self.kv_transfer_params is not None and len(self.prompts()) > 1:
            raise ValueError("kv_transfer_params needs a single prompt.")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_not_empty(cls, p: Any) -> Any:
        if _is_empty_prompt(p):
            raise ValueError("prompt must not be empty.")
        return p

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens: int,
                           default_sampling_params: Optional[dict[str, Any]] = None) -> SamplingParams:
        """`max_tokens`: what the context leaves after this prompt (the server computes it);
        used when the request sets none. Raises ValueError on invalid values."""
        kw = self._sampling_kwargs(default_sampling_params)
        logprobs = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.echo and logprobs is not None and prompt_logprobs is None:
            # echo + logprobs returns the prompt's logprobs too, as OpenAI's API did.
            prompt_logprobs = logprobs
        kw.update(max_tokens=self.max_tokens if self.max_tokens is not None else max_tokens,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return SamplingParams(**kw)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed choice has the same fields as a whole one (OpenAI's two schema names)."""


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------- chat
class ChatCompletionRequest(_SamplingRequest):
    # https://platform.openai.com/docs/api-reference/chat/create
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    max_tokens: Optional[int] = Field(default=None, description="Deprecated: max_completion_tokens.")
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = "none"
    parallel_tool_calls: Optional[bool] = None
    # vLLM's extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, str]]] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_not_empty(cls, m: Any) -> Any:
        if isinstance(m, list) and not m:
            raise ValueError("messages must contain at least one message.")
        return m

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        for i, m in enumerate(self.messages):
            if "role" not in m:
                raise ValueError(f"messages[{i}] has no 'role'.")
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError(f"top_logprobs must be non-negative, got {self.top_logprobs}.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        choice = self.tool_choice
        if not isinstance(choice, dict) and choice not in (None, "none", "auto", "required"):
            raise ValueError(f"tool_choice={choice!r} is not supported; use 'none', 'auto', "
                             f"'required' or a named function.")
        if self.forced_tool_schema() is not None and (
                self.response_format is not None and self.response_format.type != "text"
                or self.structured_outputs is not None):
            raise ValueError("A forced tool_choice cannot be combined with response_format or "
                             "structured_outputs.")
        _logit_bias_keys_are_ids(self.logit_bias)
        return self

    def forced_tool_schema(self) -> Optional[dict[str, Any]]:
        """The schema a named / required tool_choice imposes (None when not forced)."""
        return tool_choice_schema(self.tools, self.tool_choice)

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        schema = self.forced_tool_schema()
        if schema is not None:
            return StructuredOutputsParams(json=schema)
        return super().structured_outputs_params()

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int,
                           default_sampling_params: Optional[dict[str, Any]] = None) -> SamplingParams:
        kw = self._sampling_kwargs(default_sampling_params)
        requested = self.requested_max_tokens()
        kw.update(max_tokens=requested if requested is not None else max_tokens,
                  logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        return SamplingParams(**kw)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------- tokenize / detokenize
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: Optional[bool] = False

    @model_validator(mode="after")
    def _check(self) -> "TokenizeChatRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        return self


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---------------------------------------------------------------------- responses
class ResponsesRequest(OpenAIBaseModel):
    # https://platform.openai.com/docs/api-reference/responses/create
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = "auto"
    parallel_tool_calls: Optional[bool] = True
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    stream: Optional[bool] = False
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    priority: Optional[int] = None
    request_id: Optional[str] = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_not_empty(cls, value: Any) -> Any:
        if isinstance(value, (str, list)) and not value:
            raise ValueError("input must not be empty.")
        return value
