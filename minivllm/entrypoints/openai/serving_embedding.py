"""POST /v1/embeddings (a pooling model: --runner pooling): one embedding per input, as
OpenAI's Embeddings API and vLLM's (its chat form, `messages`, included).

Every prompt is checked (token ids, length against max_model_len) before any reaches the
engine; then they all run at once, and the first that fails ends the others.
"""

from __future__ import annotations

import base64
import contextlib

import torch
from fastapi.responses import JSONResponse

from minivllm.engine.processor import check_pooling_params
from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.output_streams import merge_async_iterators, usage
from minivllm.entrypoints.openai.prompt_tokenization import RenderedChat
from minivllm.entrypoints.openai.protocol import (
    EmbeddingChatRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.pooling_params import PoolingParams

# embed_dtype -> (the values' dtype, the integer dtype of the same width, its little-endian
# numpy type): the bytes of a base64 embedding are little-endian on every host, as OpenAI's.
_BASE64_DTYPES = {
    "float32": (torch.float32, torch.int32, "<i4"),
    "float16": (torch.float16, torch.int16, "<i2"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
}


def encode_embedding(
    data: torch.Tensor, encoding_format: str, embed_dtype: str = "float32"
) -> list[float] | str:
    """An embedding as the response carries it: a list of floats, or base64 text of its
    values' little-endian bytes (what OpenAI's clients ask for, and decode, by default)."""
    if encoding_format == "float":
        return data.tolist()
    dtype, same_width_int, little_endian = _BASE64_DTYPES[embed_dtype]
    raw = data.to(dtype).contiguous().view(same_width_int).numpy().astype(little_endian)
    return base64.b64encode(raw.tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(self, *args, model_config, **kwargs) -> None:
        """model_config: the engine's (what dimensions a matryoshka model may be cut to)."""
        super().__init__(*args, **kwargs)
        self.model_config = model_config

    async def create_embedding(self, request: EmbeddingRequest, raw_request=None) -> JSONResponse:
        model_name = self.models.resolve(request.model)
        self.check_engine()
        self._check_dimensions(request.dimensions)
        truncate = self._truncation(request.truncate_prompt_tokens)
        prompts = await self._prompts(request, truncate)
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        request_id = self.request_id("embd", request, raw_request)
        embeddings = await self.pool_all(prompts, params, request_id, request.priority, model_name)
        data = [
            EmbeddingResponseData(
                index=i, embedding=encode_embedding(e, request.encoding_format, request.embed_dtype)
            )
            for i, e in enumerate(embeddings)
        ]
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        response = EmbeddingResponse(
            id=request_id, model=model_name, data=data, usage=usage(num_prompt_tokens, 0)
        )
        return JSONResponse(response.model_dump())

    async def pool_all(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: PoolingParams,
        request_id: str,
        priority: int,
        model_name: str | None = None,
    ) -> list[torch.Tensor]:
        """Each (text, ids) prompt's pooled output, in order; all run at once, and the
        first that fails ends the others. model_name: the resolved name the request gave
        (a LoRA adapter's picks it)."""
        lora = self.models.lora_request(model_name) if model_name else None
        processed = [
            await self.process(
                self.engine_request_id(f"{request_id}-{i}"), ids, text, params, priority, lora
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        streams = [self.pool(p) for p in processed]
        pooled: list[torch.Tensor | None] = [None] * len(prompts)
        async with contextlib.aclosing(merge_async_iterators(*streams)) as merged:
            async for index, output in merged:
                pooled[index] = output.outputs.data
        return pooled

    # ------------------------------------------------------------------ checks

    def _check_dimensions(self, dimensions: int | None) -> None:
        """The engine's checks, before any prompt is tokenized."""
        try:
            check_pooling_params(
                PoolingParams(dimensions=dimensions), self.model_config, self.models.base_name
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), param="dimensions") from exc

    def _truncation(self, truncate: int | None) -> int | None:
        """truncate_prompt_tokens as a token count (-1: max_model_len), within the context."""
        if truncate == -1:
            return self.max_model_len
        if truncate is not None and truncate > self.max_model_len:
            raise BadRequestError(
                f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        return truncate

    # ------------------------------------------------------------------ prompts

    async def _prompts(
        self, request: EmbeddingRequest, truncate: int | None
    ) -> list[tuple[str | None, list[int]]]:
        """Each prompt's text (None for token ids) and token ids, checked."""
        if isinstance(request, EmbeddingChatRequest):
            items, param = ([await self.render_chat(request, truncate is None)], "messages")
        else:
            items, param = request.input, "input"
            if isinstance(items, str) or isinstance(items[0], int):
                items = [items]
        prompts = []
        for item in items:
            if isinstance(item, RenderedChat):
                ids = await self.encode_chat_async(item, request.add_special_tokens, truncate)
                text = item.text if truncate is None else None
            elif isinstance(item, str):
                ids = await self.encode_async(item, request.add_special_tokens, truncate, param)
                text = item if truncate is None else None
            else:
                ids, text = self.truncate(list(item), truncate), None
            self.check_token_ids(ids, param)
            prompts.append((text, ids))
        return prompts
