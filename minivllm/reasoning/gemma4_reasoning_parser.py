"""`gemma4` (vLLM's name): Gemma 4's thinking, `<|channel>thought\n...<channel|>` at the
start of the reply (with `enable_thinking`), is the reasoning, its `thought` label left out;
the rest is the answer. A reply without the channel is all answer. The markers are in the
text: the tokenizer renders them (tokenizer.render_message_markers), as llama.cpp does."""

from __future__ import annotations

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser, prompt_opens_think


@ReasoningParserManager.register_module("gemma4")
class Gemma4ReasoningParser(BaseThinkingReasoningParser):
    start_token = "<|channel>thought\n"
    end_token = "<channel|>"

    def implicit_reasoning(self, prompt: str | None) -> bool:
        return prompt_opens_think(prompt, "<|channel>", self.end_token)
