"""`qwen3`: `<think>...</think>` at the start of the output is the reasoning, the rest the
answer. An output without `<think>` is all answer (`enable_thinking=False`), unless the
prompt left a `<think>` open (Qwen3 thinking-2507 templates), as for deepseek_r1."""

from __future__ import annotations

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser, prompt_opens_think


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    def implicit_reasoning(self, prompt: str | None) -> bool:
        return prompt_opens_think(prompt, self.start_token, self.end_token)
