"""POST /score and /rerank, as vLLM's. With a cross-encoder (a sequence classifier of one
label) a pair's score is the model's activated logit over the pair as one prompt (the
tokenizer's pair encoding); with an embedding model, the cosine similarity of its two texts'
embeddings, each distinct text pooled once.

Every text is checked before any reaches the engine; then all the prompts run at once, and the
first that fails ends the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.output_streams import usage
from minivllm.entrypoints.openai.prompt_tokenization import in_tokenizer_thread
from minivllm.entrypoints.openai.protocol import (
    ClassifierFields,
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
from minivllm.pooling_params import PoolingParams


@dataclass
class ScoreJob:
    """One score or rerank request's pairs, as both ways of scoring take them."""

    request: ClassifierFields | PoolingFields
    model_name: str  # the resolved name (a LoRA adapter's picks it)
    pairs: list[tuple[str, str]]
    request_id: str
    params: tuple[str, str]  # what the request calls the two texts of a pair
    truncate: int | None

    def fields(self) -> tuple:
        return (
            self.request,
            self.model_name,
            self.pairs,
            self.request_id,
            self.params,
            self.truncate,
        )


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
        scores, num_tokens = await self._scores(
            request, model_name, pairs, request_id, ("text_1", "text_2")
        )
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
        scores, num_tokens = await self._scores(
            request, model_name, pairs, request_id, ("query", "documents")
        )
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
        request: ClassifierFields,
        model_name: str,
        pairs: list[tuple[str, str]],
        request_id: str,
        params: tuple[str, str],
    ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens of all the pairs (model_name: the resolved
        name, which may pick a LoRA adapter)."""
        self.check_engine()
        job = ScoreJob(
            request,
            model_name,
            pairs,
            request_id,
            params,
            self._truncation(request.truncate_prompt_tokens),
        )
        if self.model_config.is_cross_encoder:
            return await self._cross_encoder_scores(job)
        return await self._embedding_scores(job)

    async def _cross_encoder_scores(self, job: ScoreJob) -> tuple[list[float], int]:
        """Each pair's activated logit (the raw one with use_activation=false). A pair too
        long for the context is blamed on its second text (params: the two texts' names)."""
        request, model_name, pairs, request_id, params, truncate = job.fields()
        if self.model_config.hf_config.num_labels != 1:
            raise BadRequestError("Score API is only enabled for num_labels == 1.")
        prompts = []
        for first, second in pairs:
            self.check_text(first, params[0], check_length=False)
            self.check_text(second, params[1], check_length=False)
            if truncate is None:
                self.check_num_chars(len(first) + len(second), params[1])
            ids = await in_tokenizer_thread(self._encode_pair, first, second, truncate)
            self.check_token_ids(ids, params[1])
            prompts.append((None, ids))
        params = PoolingParams(task="score", use_activation=request.use_activation)
        pooled = await self.pool_all(prompts, params, request_id, request.priority, model_name)
        return [p.item() for p in pooled], sum(len(ids) for _, ids in prompts)

    def _encode_pair(self, first: str, second: str, truncate: int | None) -> list[int]:
        ids = self.tokenizer(text=first, text_pair=second)["input_ids"]
        return self.truncate(ids, truncate)

    async def _embedding_scores(self, job: ScoreJob) -> tuple[list[float], int]:
        """Each pair's cosine similarity, and vLLM's usage: a pair counts both its texts, a
        text shared by pairs once per pair."""
        request, model_name, pairs, request_id, params, truncate = job.fields()
        # Each distinct text once: a query against N documents is pooled once.
        texts: dict[str, tuple[int, str]] = {}
        for first, second in pairs:
            texts.setdefault(first, (len(texts), params[0]))
            texts.setdefault(second, (len(texts), params[1]))
        ids = []
        for text, (_, param) in texts.items():
            text_ids = await self.encode_async(text, True, truncate, param)
            self.check_token_ids(text_ids, param)
            ids.append(text_ids)
        prompts = list(zip(texts, ids))
        embeddings = await self.pool_all(
            prompts,
            PoolingParams(),
            request_id,
            request.priority,
            model_name,
        )
        scores, num_tokens = [], 0
        for first, second in pairs:
            i, j = texts[first][0], texts[second][0]
            scores.append(torch.cosine_similarity(embeddings[i], embeddings[j], dim=0).item())
            num_tokens += len(ids[i]) + len(ids[j])
        return scores, num_tokens
