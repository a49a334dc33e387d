"""tool_choice "required" and a named function: the JSON schema that structured outputs
enforce (vLLM's), and the parsers of the output it produces.

- a named function: the output is the function's arguments (its `parameters` schema);
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`, one item
  schema per declared function, at least one item (exactly one without parallel calls).
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.protocol import ChatCompletionToolsParam
from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import CallReader, ToolParser
from minivllm.entrypoints.openai.tool_parsers.json_call_scanner import JsonCallScanner

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_WS = " \t\r\n"


def _parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def named_tool_schema(tools: list[ChatCompletionToolsParam], name: str) -> dict[str, Any]:
    return next(_parameters(t) for t in tools if t.function.name == name)


def required_tools_schema(
    tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool = True
) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required" (the functions' $defs lifted to the top)."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for def_name, definition in parameters.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != definition:
                raise ValueError(
                    f"Tool definition '{def_name}' has conflicting definitions in `tools`."
                )
            defs[def_name] = definition
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class _WholeTextCall:
    """A named function's call: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.args_text = ""

    def is_valid(self) -> bool:
        return True


class NamedCallReader(CallReader):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.calls.append(_WholeTextCall(name))

    def feed(self, text: str) -> str:
        self.calls[0].args_text += text
        return ""


class NamedToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None, *, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def make_reader(self) -> CallReader:
        return NamedCallReader(self.name)


class RequiredCallReader(CallReader):
    """`[{"name": ..., "parameters": ...}, ...]`; nothing is content."""

    def __init__(self) -> None:
        super().__init__()
        self._phase = "start"  # start, items, call, end

    def feed(self, text: str) -> str:
        while text:
            if self._phase == "call":
                scanner = self.calls[-1]
                text = text[scanner.feed(text) :]
                if scanner.error:
                    self._phase = "end"
                elif scanner.done:
                    self._phase = "items"
                continue
            if self._phase == "end":
                break
            ch, text = text[0], text[1:]
            if ch in _WS:
                continue
            if self._phase == "start":
                self._phase = "items" if ch == "[" else "end"
            elif ch == "{":
                self.calls.append(JsonCallScanner("name", ("parameters",)))
                self.calls[-1].feed(ch)
                self._phase = "call"
            elif ch != ",":
                self._phase = "end"
        return ""


class RequiredToolParser(ToolParser):
    def make_reader(self) -> CallReader:
        return RequiredCallReader()
