"""`POST /tokenize` (a prompt, or messages through the chat template) and `POST /detokenize`."""
from __future__ import annotations

from typing import Any, Optional

from kvserve.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                 TokenizeChatRequest, TokenizeRequest,
                                                 TokenizeResponse)
from kvserve.entrypoints.openai.serving_chat import normalize_messages, render_chat
from kvserve.entrypoints.openai.serving_engine import LoadTracker, OpenAIServing, large_messages
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, engine_client: Any, models: OpenAIServingModels, load: LoadTracker,
                 chat_template: Optional[str] = None) -> None:
        super().__init__(engine_client, models, load)
        self.chat_template = chat_template

    async def create_tokenize(self, request: TokenizeRequest, raw_request: Any = None) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            self.check_request_chat_template(request.chat_template)
            messages = normalize_messages(request.messages)
            text = await self.run_maybe_in_thread(
                large_messages(messages), render_chat, self.tokenizer, messages,
                chat_template=request.chat_template or self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tools=request.tools,
                chat_template_kwargs=request.chat_template_kwargs)
        else:
            text = request.prompt
        ids = await self.encode(text, request.add_special_tokens)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None)

    async def create_detokenize(self, request: DetokenizeRequest, raw_request: Any = None) -> DetokenizeResponse:
        self.check_model(request.model)
        if request.tokens:
            self.check_token_ids(request.tokens, "tokens")
        # Special tokens are kept, so that tokenize -> detokenize gives the text back.
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
