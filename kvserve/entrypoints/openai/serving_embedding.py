"""`POST /v1/embeddings`, and `/v1/score` + `/v1/rerank` for embedding models (vLLM's names).

Every input runs as its own pooling request `{id}-{i}` (they batch in the engine like any
prefills). Only an engine started with `--runner pooling` serves these; a generate-runner
engine answers 400, as a pooling engine does to completions (its input processor refuses
SamplingParams). Score and rerank are the bi-encoder kind vLLM serves for embedding models:
the cosine similarity of the two texts' embeddings (cross-encoder heads are not supported).
"""
from __future__ import annotations

import base64
from contextlib import aclosing
from http import HTTPStatus
from typing import Any, Optional, Union

import torch

from kvserve.entrypoints.openai.protocol import (EmbeddingRequest, EmbeddingResponse,
                                                 EmbeddingResponseData, RerankDocument,
                                                 RerankRequest, RerankResponse, RerankResult,
                                                 RerankUsage, ScoreRequest, ScoreResponse,
                                                 ScoreResponseData, UsageInfo)
from kvserve.entrypoints.openai.serving_engine import (OpenAIServing, RequestTracker,
                                                       ServingError, merge_async_iterators,
                                                       to_serving_error)
from kvserve.outputs import PoolingRequestOutput
from kvserve.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    request_id_prefix = "embd"

    def check_pooling_model(self, endpoint: str) -> None:
        runner = getattr(self.engine_client.model_config, "runner_type", "generate")
        if runner != "pooling":
            raise ServingError(f"The model does not support the {endpoint} API: it runs the "
                               f"{runner} runner (start the server with --runner pooling).",
                               param="model")

    async def create_embedding(self, request: EmbeddingRequest,
                               raw_request: Any = None) -> EmbeddingResponse:
        """Raises ServingError (400 / 404 / 503) before anything is scheduled."""
        self.check_model(request.model)
        self.check_engine()
        self.check_pooling_model("Embeddings")
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                                   task="embed")
        except ValueError as e:
            raise ServingError(str(e), param="dimensions") from e
        request_id = self.make_request_id(request, raw_request)
        ids = [await self._prompt_ids(p, request.add_special_tokens,
                                      request.truncate_prompt_tokens, "input")
               for p in request.inputs()]
        outs = await self._pool(request_id, ids, params, request.priority)
        data = [EmbeddingResponseData(index=i, embedding=_encode(out, request.encoding_format))
                for i, out in enumerate(outs)]
        num_tokens = sum(len(x) for x in ids)
        return EmbeddingResponse(id=request_id, model=self.models.response_model_name(request.model),
                                 data=data, usage=UsageInfo.of(num_tokens, 0))

    async def create_score(self, request: ScoreRequest, raw_request: Any = None) -> ScoreResponse:
        self.check_model(request.model)
        self.check_engine()
        self.check_pooling_model("Score")
        t1 = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        t2 = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        if len(t1) != 1 and len(t1) != len(t2):
            raise ServingError(f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one "
                               f"text_1, or as many as text_2.", param="text_1")
        scores, num_tokens = await self._cosine(self.make_request_id(request, raw_request),
                                                t1, t2, request.truncate_prompt_tokens,
                                                request.priority)
        return ScoreResponse(model=self.models.response_model_name(request.model),
                             data=[ScoreResponseData(index=i, score=s)
                                   for i, s in enumerate(scores)],
                             usage=UsageInfo.of(num_tokens, 0))

    async def create_rerank(self, request: RerankRequest, raw_request: Any = None) -> RerankResponse:
        self.check_model(request.model)
        self.check_engine()
        self.check_pooling_model("Rerank")
        scores, num_tokens = await self._cosine(self.make_request_id(request, raw_request),
                                                [request.query], list(request.documents),
                                                request.truncate_prompt_tokens, request.priority)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        return RerankResponse(
            model=self.models.response_model_name(request.model),
            usage=RerankUsage(total_tokens=num_tokens),
            results=[RerankResult(index=i, document=RerankDocument(text=request.documents[i]),
                                  relevance_score=scores[i]) for i in order])

    # ------------------------------------------------------------------ helpers
    async def _prompt_ids(self, prompt: Union[str, list[int]], add_special_tokens: bool,
                          truncate: Optional[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = await self.encode(prompt, add_special_tokens, param=param,
                                    truncating=truncate is not None)
        else:
            ids = list(prompt)
            self.check_token_ids(ids, param)
        ids = self.truncate(ids, truncate)
        if len(ids) > self.max_model_len:     # nothing is generated: the whole context is input
            raise ServingError(f"This model's maximum context length is {self.max_model_len} "
                               f"tokens. However, you requested {len(ids)} tokens in the "
                               f"input for embedding generation. Please reduce the length of "
                               f"the input.", param=param)
        return ids

    async def _pool(self, request_id: str, prompt_ids: list[list[int]], params: PoolingParams,
                    priority: int) -> list[PoolingRequestOutput]:
        engine_ids = [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        tracker = RequestTracker(self.engine_client, self.load.admit(len(prompt_ids)), engine_ids)
        final: list[Optional[PoolingRequestOutput]] = [None] * len(prompt_ids)
        try:
            generators = [self.engine_client.encode({"prompt_token_ids": ids}, params, rid,
                                                    priority=priority)
                          for ids, rid in zip(prompt_ids, engine_ids)]
            async with aclosing(merge_async_iterators(*generators)) as stream:
                async for i, res in stream:
                    final[i] = res
                    if res.finished:
                        tracker.finished(engine_ids[i])
        except Exception as e:
            raise to_serving_error(e) from e
        finally:
            tracker.close()
        for res in final:
            if res is None or res.outputs.data is None:
                raise ServingError(f"A pooling request ended without a result "
                                   f"({res.finish_reason if res else 'no output'}).",
                                   HTTPStatus.INTERNAL_SERVER_ERROR)
        return final   # type: ignore[return-value]

    async def _cosine(self, request_id: str, t1: list[str], t2: list[str],
                      truncate: Optional[int], priority: int) -> tuple[list[float], int]:
        ids = [await self._prompt_ids(t, True, truncate, "text") for t in t1 + t2]
        outs = await self._pool(request_id, ids, PoolingParams(task="embed"), priority)
        emb = torch.stack([o.outputs.data for o in outs])    # type: ignore[misc]
        a, b = emb[:len(t1)], emb[len(t1):]
        scores = torch.nn.functional.cosine_similarity(a.expand_as(b) if len(t1) == 1 else a, b)
        return scores.tolist(), sum(len(x) for x in ids)


def _encode(out: PoolingRequestOutput, encoding_format: str) -> Union[list[float], str]:
    data = out.outputs.data
    assert data is not None
    if encoding_format == "base64":
        # OpenAI's layout: the float32 values' little-endian bytes.
        return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()
