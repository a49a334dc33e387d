"""LoRARequest's own checks: its fields typed as the engine core decodes them."""

from __future__ import annotations

import pathlib

import msgspec
import pytest

from minivllm.lora.request import LoRARequest


@pytest.mark.parametrize(
    "fields, message",
    [
        (("x", 0, "/a"), "lora_int_id must be > 0"),
        (("x", True, "/a"), "lora_int_id must be > 0"),
        (("x", 2**63, "/a"), "lora_int_id must be > 0"),  # wider than msgpack's integers
        ((7, 1, "/a"), "lora_name must be a string"),
        (("x", 1, ""), "lora_path must name the adapter's folder"),
        (("x", 1, 3), "lora_path must name the adapter's folder"),
        (("x", 1, "/a", 5), "base_model_name must be a string"),
    ],
)
def test_a_request_the_core_cannot_decode_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


def test_a_path_is_taken_as_its_string():
    request = LoRARequest("x", 1, pathlib.Path("/adapters/x"))
    assert request.lora_path == "/adapters/x"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=LoRARequest) == request
