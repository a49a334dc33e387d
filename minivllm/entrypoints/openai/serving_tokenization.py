"""POST /tokenize and /detokenize (vLLM's endpoints): text or chat messages to token ids,
and back; GET /tokenizer_info when the server enables it."""

from __future__ import annotations

from minivllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.entrypoints.openai.tokenizer_info import tokenizer_info


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            chat = await self.render_chat(request, check_length=False)
            ids = await self.encode_chat_async(chat, request.add_special_tokens, check_length=False)
        else:
            ids = await self.encode_async(
                request.prompt, request.add_special_tokens, check_length=False
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = self.tokenizer.convert_ids_to_tokens(ids)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        if request.tokens:
            self.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def get_tokenizer_info(self) -> dict:
        """GET /tokenizer_info: the tokenizer's configuration and chat template."""
        return tokenizer_info(self.tokenizer, self.chat_template)
