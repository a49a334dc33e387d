"""POST /classify for a sequence classifier ("...ForSequenceClassification", the pooling
runner), as vLLM's: each prompt's class probabilities and its most likely label.

Every prompt is checked before any reaches the engine; then they all run at once, and the
first that fails ends the others.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.output_streams import usage
from minivllm.entrypoints.openai.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.pooling_params import PoolingParams


class OpenAIServingClassification(OpenAIServingEmbedding):
    async def create_classify(
        self, request: ClassificationRequest, raw_request=None
    ) -> JSONResponse:
        model_name = self.models.resolve(request.model)
        self.check_engine()
        truncate = self._truncation(request.truncate_prompt_tokens)
        prompts = await self._prompts(request, truncate)
        params = PoolingParams(task="classify", use_activation=request.use_activation)
        request_id = self.request_id("classify", request, raw_request)
        pooled = await self.pool_all(prompts, params, request_id, request.priority, model_name)
        probs = [p.tolist() for p in pooled]
        labels = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, p in enumerate(probs):
            best = max(range(len(p)), key=p.__getitem__)
            label = labels.get(best, labels.get(str(best)))
            data.append(ClassificationData(index=i, label=label, probs=p, num_classes=len(p)))
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        response = ClassificationResponse(
            id=request_id, model=model_name, data=data, usage=usage(num_prompt_tokens, 0)
        )
        return JSONResponse(response.model_dump())
