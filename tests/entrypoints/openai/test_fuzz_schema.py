"""A fuzzer against the server's own OpenAPI schema (issue 20): bodies generated from each
POST route's request schema (hypothesis strategies built from the JSON schema, with values
outside each field's bounds and of the wrong type mixed in), and arbitrary JSON, never get
a 5xx or hang, the engine stays healthy after each, and the server answers a good request
afterwards. Bounded in examples and time."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import post_json, request

pytestmark = pytest.mark.e2e

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
EXAMPLES_PER_ROUTE = 25
REQUEST_TIMEOUT_S = 60  # a hang fails the test

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    status, _, data = request("GET", server.url_for("openapi.json"))
    assert status == 200
    return json.loads(data)


def body_schema(openapi: dict, route: str) -> dict:
    content = openapi["paths"][route]["post"]["requestBody"]["content"]
    return content["application/json"]["schema"]


def from_schema(schema: dict, openapi: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that mostly follow a JSON schema, sometimes not (any JSON in their place)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return from_schema(openapi["components"]["schemas"][name], openapi, depth)
    if depth > 4:
        return JSON
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return st.one_of([from_schema(b, openapi, depth + 1) for b in branches])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, openapi, depth + 1) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    typed = {
        "object": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
        "array": st.lists(from_schema(schema.get("items", {}), openapi, depth + 1), max_size=4),
        "string": st.text(max_size=12),
        "integer": st.integers(min_value=-(2**70), max_value=2**70)
        | st.integers(min_value=-2, max_value=300),
        "number": st.floats() | st.floats(min_value=-3, max_value=3),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    # Mostly the declared type (bounds ignored on purpose), now and then anything.
    return st.one_of(typed.get(kind, JSON), JSON) if kind else JSON


def bounded(body):
    """Keep generated generation requests short: the fuzzer tests answers, not lengths."""
    if isinstance(body, dict):
        body = dict(body)
        for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], cap)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2
    return body


def post(server, route: str, body) -> int:
    raw = json.dumps(bounded(body)).encode()
    status, _, data = request("POST", server.url_for(route.lstrip("/")), raw,
                              timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert status < 500, (route, body, data[:500])
    if status >= 400:
        error = json.loads(data)["error"]
        assert error["code"] == status and error["message"]
    return status


@pytest.mark.parametrize("route", ROUTES)
def test_schema_fuzz_never_5xx(server, openapi, route):
    strategy = from_schema(body_schema(openapi, route), openapi) | JSON

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=strategy)
    def fuzz(body):
        post(server, route, body)
        # The engine lives after every example (a dead one fails /health with a 503), so a
        # body that kills it is the one hypothesis reports.
        assert request("GET", server.url_for("health"))[0] == 200, (route, body)

    fuzz()
    status, body = post_json(
        server.url_for("v1", "completions"),
        {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
    )
    assert status == 200, body
