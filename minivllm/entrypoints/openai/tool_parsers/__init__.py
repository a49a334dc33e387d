"""Tool-call parsers: model output to OpenAI tool calls, whole or streamed."""

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from minivllm.entrypoints.openai.tool_parsers.gemma4_tool_parser import Gemma4ToolParser
from minivllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from minivllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from minivllm.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser

__all__ = [
    "Gemma4ToolParser",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "OpenAIToolParser",
    "ToolParser",
    "ToolParserManager",
]
