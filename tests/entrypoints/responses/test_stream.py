"""The Responses event stream ends with the same output items as the whole answer built from
the same chat reply (issue 51, acceptance 3), an empty reply included."""

from __future__ import annotations

import asyncio
import json

import pytest

from minivllm.entrypoints.responses.stream import ResponseEventStream
from minivllm.entrypoints.responses.translate import output_items, response_object


def streamed(chunks: list[dict]) -> tuple[list[dict], dict]:
    """The events (as JSON) and the final response of a stream over these chat chunks."""

    def make(output, usage, status, finish):
        return response_object({"model": "m"}, "resp_1", output, usage, status, finish)

    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        stream = ResponseEventStream(make)
        events = [event async for event in stream.events(source())]
        return events, stream.final

    raw, final = asyncio.run(collect())
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw]
    return events, final


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


END = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
CALL = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize(
    "chunks, text, calls",
    [
        ([delta(content="Hel"), delta(content="lo"), END], "Hello", []),
        ([delta(tool_calls=[CALL]), END], None, [{"id": "call_1", "name": "f",
                                                  "arguments": '{"a": 1}'}]),
        ([END], "", []),  # nothing said: one empty message, as the whole answer has
    ],
)  # fmt: skip
def test_a_stream_ends_with_the_whole_answers_items(chunks, text, calls):
    events, final = streamed(chunks)
    assert without_ids(final["output"]) == without_ids(output_items(None, text, calls))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == len(final["output"])
    assert kinds.count("response.output_item.done") == len(final["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
