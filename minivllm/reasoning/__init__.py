"""Reasoning parsers (`--reasoning-parser`): a reply's reasoning split into `reasoning_content`."""

from minivllm.reasoning.abs_reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserManager,
)
from minivllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from minivllm.reasoning.gemma4_reasoning_parser import Gemma4ReasoningParser
from minivllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
from minivllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "Gemma4ReasoningParser",
    "GptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningParserManager",
]
