"""Reasoning parsers (`--reasoning-parser`): `<think>` text split into `reasoning_content`."""

from minivllm.reasoning.abs_reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserManager,
)
from minivllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from minivllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningParserManager",
]
