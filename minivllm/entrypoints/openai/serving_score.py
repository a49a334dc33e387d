"""POST /score and /rerank for an embedding model, as vLLM's: a pair's score is the cosine
similarity of its two texts' embeddings (vLLM's scoring with an embedding model; cross-encoder
models are not built).

Every text is checked before any reaches the engine; each distinct text is pooled once, all at
once, and the first that fails ends the others.
"""

from __future__ import annotations

import torch
from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.protocol import (
    PoolingFields,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.entrypoints.openai.serving_engine import usage
from minivllm.pooling_params import PoolingParams


class OpenAIServingScores(OpenAIServingEmbedding):
    async def create_score(self, request: ScoreRequest, raw_request=None) -> JSONResponse:
        model_name = self.models.resolve(request.model)
        texts_1 = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        texts_2 = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(texts_1) > 1 and len(texts_1) != len(texts_2):
            raise BadRequestError("Input lengths must be either 1:1, 1:N or N:N", param="text_1")
        request_id = self.request_id("score", request, raw_request)
        if len(texts_1) == 1:
            texts_1 = texts_1 * len(texts_2)
        pairs = list(zip(texts_1, texts_2))
        scores, num_tokens = await self._scores(request, pairs, request_id, ("text_1", "text_2"))
        response = ScoreResponse(
            id=request_id,
            model=model_name,
            data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
            usage=usage(num_tokens, 0),
        )
        return JSONResponse(response.model_dump())

    async def do_rerank(self, request: RerankRequest, raw_request=None) -> JSONResponse:
        model_name = self.models.resolve(request.model)
        request_id = self.request_id("rerank", request, raw_request)
        pairs = [(request.query, document) for document in request.documents]
        scores, num_tokens = await self._scores(request, pairs, request_id, ("query", "documents"))
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        top_n = request.top_n or len(order)
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=request.documents[i])
                if request.return_documents
                else None,
                relevance_score=scores[i],
            )
            for i in order[:top_n]
        ]
        response = RerankResponse(
            id=request_id,
            model=model_name,
            usage=RerankUsage(total_tokens=num_tokens),
            results=results,
        )
        return JSONResponse(response.model_dump())

    async def _scores(
        self,
        request: PoolingFields,
        pairs: list[tuple[str, str]],
        request_id: str,
        params: tuple[str, str],
    ) -> tuple[list[float], int]:
        """Each pair's cosine similarity, and the prompt tokens of all the pairs (vLLM's
        usage: a pair counts both its texts, a text shared by pairs once per pair)."""
        self.check_engine()
        self.check_priority(request.priority)
        truncate = self._truncation(request.truncate_prompt_tokens)
        # Each distinct text once: a query against N documents is pooled once.
        texts: dict[str, tuple[int, str]] = {}
        for first, second in pairs:
            texts.setdefault(first, (len(texts), params[0]))
            texts.setdefault(second, (len(texts), params[1]))
        ids = []
        for text, (_, param) in texts.items():
            text_ids = await self.encode_async(text, True, truncate, param)
            self.check_token_ids(text_ids, param)
            self._check_length(text_ids, param)
            ids.append(text_ids)
        prompts = list(zip(texts, ids))
        embeddings = await self.pool_all(prompts, PoolingParams(), request_id, request.priority)
        scores, num_tokens = [], 0
        for first, second in pairs:
            i, j = texts[first][0], texts[second][0]
            scores.append(torch.cosine_similarity(embeddings[i], embeddings[j], dim=0).item())
            num_tokens += len(ids[i]) + len(ids[j])
        return scores, num_tokens
