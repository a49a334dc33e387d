"""`deepseek_r1`: the output is reasoning up to `</think>` (the template opens the block, so
the model may not write `<think>`), then the answer; without `</think>`, all reasoning."""

from __future__ import annotations

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    def implicit_reasoning(self, prompt: str | None) -> bool:
        return True
