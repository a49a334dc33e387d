"""A fuzzer against the server's own schemas (issues 20 and 51): bodies generated from each
POST route's request schema (hypothesis strategies built from the JSON schema, with values
outside each field's bounds and of the wrong type mixed in), and arbitrary JSON, never get
a 5xx or hang, each error is in its API's own shape (OpenAI's, Anthropic's, Ollama's), the
engine stays healthy after each, and the server answers a good request afterwards. The
OpenAI routes' schemas come from the server's OpenAPI document; the Messages, Responses and
Ollama routes read their bodies themselves (to answer in their own shape), so theirs come
from their pydantic models. Bounded in examples and time."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.entrypoints.anthropic.protocol import ERROR_TYPES as ANTHROPIC_ERROR_TYPES
from minivllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from minivllm.entrypoints.ollama import protocol as ollama
from minivllm.entrypoints.responses.protocol import ResponsesRequest
from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import RemoteServer, post_json, request

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


EMBED_NAME = "tiny-embed"


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, smollm2_tokenizer):
    """A tiny random embedding model (test_embeddings' way), for /api/embed."""
    folder = str(tmp_path_factory.mktemp("tiny-embed"))
    checkpoint = write_tiny_checkpoint("qwen3", folder, smollm2_tokenizer)
    remote = RemoteServer(
        [checkpoint, "--runner", "pooling", "--served-model-name", EMBED_NAME,
         "--max-model-len", "64"]
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    status, _, data = request("GET", server.url_for("openapi.json"))
    assert status == 200
    return json.loads(data)


def body_schema(openapi: dict, route: str) -> dict:
    content = openapi["paths"][route]["post"]["requestBody"]["content"]
    return content["application/json"]["schema"]


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that mostly follow a JSON schema, sometimes not (any JSON in their place);
    defs: the schemas its $refs name (OpenAPI's components, or a pydantic schema's $defs)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return from_schema(defs[name], defs, depth)
    if depth > 4:
        return JSON
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return st.one_of([from_schema(b, defs, depth + 1) for b in branches])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, defs, depth + 1) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    typed = {
        "object": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
        "array": st.lists(from_schema(schema.get("items", {}), defs, depth + 1), max_size=4),
        "string": st.text(max_size=12),
        "integer": st.integers(min_value=-(2**70), max_value=2**70)
        | st.integers(min_value=-2, max_value=300),
        "number": st.floats() | st.floats(min_value=-3, max_value=3),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    # Mostly the declared type (bounds ignored on purpose), now and then anything.
    return st.one_of(typed.get(kind, JSON), JSON) if kind else JSON


# Where an API takes the reply's length, when not OpenAI's max_tokens; Ollama's sits in
# `options`.
LENGTH_FIELDS = {
    "/v1/responses": ("max_output_tokens",),
    "/api/chat": ("options", "num_predict"),
    "/api/generate": ("options", "num_predict"),
}


def bounded(route: str, body):
    """Keep generated generation requests short: the fuzzer tests answers, not lengths."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if route in LENGTH_FIELDS:
        *outer, key = LENGTH_FIELDS[route]
        fields = body.get(outer[0], {}) if outer else body
        if not isinstance(fields, dict):
            return body  # a 400 anyway
        fields = dict(fields)
        value = fields.get(key, 2)
        fields[key] = min(value, 4) if isinstance(value, int) else value
        if outer:
            body[outer[0]] = fields
        else:
            body = fields
        return body
    for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], cap)
    if "max_tokens" not in body and "max_completion_tokens" not in body and route != "/v1/messages":
        body["max_tokens"] = 2
    return body


def openai_error(status: int, data: bytes) -> None:
    error = json.loads(data)["error"]
    assert error["code"] == status and error["message"]


def anthropic_error(status: int, data: bytes) -> None:
    body = json.loads(data)
    assert body["type"] == "error" and body["error"]["message"]
    assert body["error"]["type"] == ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error")


def ollama_error(status: int, data: bytes) -> None:
    error = json.loads(data)["error"]
    assert isinstance(error, str) and error


def post(server, route: str, body, error_shape=openai_error) -> int:
    raw = json.dumps(bounded(route, body)).encode()
    status, _, data = request("POST", server.url_for(route.lstrip("/")), raw,
                              timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert status < 500, (route, body, data[:500])
    if status >= 400:
        error_shape(status, data)
    return status


def fuzz_route(server, route: str, strategy, error_shape=openai_error) -> None:
    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=strategy)
    def fuzz(body):
        post(server, route, body, error_shape)
        # The engine lives after every example (a dead one fails /health with a 503), so a
        # body that kills it is the one hypothesis reports.
        assert request("GET", server.url_for("health"))[0] == 200, (route, body)

    fuzz()


def model_strategy(model) -> st.SearchStrategy:
    """Bodies from a pydantic model's schema, `model` mostly the served name (so that the
    fuzzer gets past the name check to the translation), or any JSON."""
    schema = model.model_json_schema()
    bodies = from_schema(schema, schema.get("$defs", {}))
    served = st.fixed_dictionaries({"model": st.just(MODEL_NAME)})
    return st.builds(lambda body, name: {**body, **name} if isinstance(body, dict) else body,
                     bodies, served) | bodies | JSON  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
def test_schema_fuzz_never_5xx(server, openapi, route):
    schemas = openapi["components"]["schemas"]
    fuzz_route(server, route, from_schema(body_schema(openapi, route), schemas) | JSON)
    status, body = post_json(
        server.url_for("v1", "completions"),
        {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
    )
    assert status == 200, body


# The routes that read their bodies themselves: the model their bodies follow, and the shape
# of their errors.
OWN_SHAPE_ROUTES = {
    "/v1/messages": (MessagesRequest, anthropic_error),
    "/v1/messages/count_tokens": (CountTokensRequest, anthropic_error),
    "/v1/responses": (ResponsesRequest, openai_error),
    "/api/chat": (ollama.ChatRequest, ollama_error),
    "/api/generate": (ollama.GenerateRequest, ollama_error),
    "/api/show": (ollama.ShowRequest, ollama_error),
    "/api/embed": (ollama.EmbedRequest, ollama_error),  # a 400: this model embeds nothing
    "/api/embeddings": (ollama.LegacyEmbeddingRequest, ollama_error),
}


# A good body for each: the fuzzer also sends it with one field (or one field of a field)
# replaced by any JSON, which reaches the translation that a body failing early never does.
GOOD_BODIES = {
    "/v1/messages": {"model": MODEL_NAME, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL_NAME,
                                  "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2},
    "/api/chat": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                  "stream": False, "options": {"num_predict": 2}},
    "/api/generate": {"model": MODEL_NAME, "prompt": "Hi", "stream": False,
                      "options": {"num_predict": 2}},
    "/api/show": {"model": MODEL_NAME},
    "/api/embed": {"model": MODEL_NAME, "input": "Hi"},
    "/api/embeddings": {"model": MODEL_NAME, "prompt": "Hi"},
}  # fmt: skip


def field_paths(model) -> list[tuple[str, ...]]:
    """The model's fields, and the fields of those that are objects of their own."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    paths = []
    for name, field in schema["properties"].items():
        paths.append((name,))
        for branch in field.get("anyOf", [field]):
            inner = defs.get(branch.get("$ref", "").rsplit("/", 1)[-1], {})
            paths += [(name, sub) for sub in inner.get("properties", {})]
    return paths


def one_field_wrong(route: str, model) -> st.SearchStrategy:
    def replace(path: tuple[str, ...], value) -> dict:
        body = json.loads(json.dumps(GOOD_BODIES[route]))
        if len(path) == 1:
            body[path[0]] = value
        else:
            outer = body.get(path[0])
            body[path[0]] = {**(outer if isinstance(outer, dict) else {}), path[1]: value}
        return body

    return st.builds(replace, st.sampled_from(field_paths(model)), JSON)


@pytest.mark.parametrize("route", OWN_SHAPE_ROUTES)
def test_other_apis_fuzz_never_5xx_and_answer_in_their_shape(server, route):
    model, error_shape = OWN_SHAPE_ROUTES[route]
    strategy = model_strategy(model) | one_field_wrong(route, model)
    fuzz_route(server, route, strategy, error_shape)
    status, body = post_json(
        server.url_for("api", "chat"),
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
         "stream": False, "options": {"num_predict": 2}},
    )  # fmt: skip
    assert status == 200 and body["done"], body


def test_a_schema_with_an_integer_wider_than_64_bits_is_a_400(server):
    """Valid JSON the engine core's msgpack cannot carry (hypothesis found it through
    /api/chat's `format`, 2026-11-29: the client's encoder failed, a 500): refused as the
    request's own error on both routes that take a schema, and the engine serves on."""
    wide = {"": -(2**63) - 1}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    openai_body = {**chat, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": wide}}}  # fmt: skip
    ollama_body = {**chat, "stream": False, "options": {"num_predict": 2}, "format": wide}
    assert post(server, "/v1/chat/completions", openai_body) == 400
    assert post(server, "/api/chat", ollama_body, ollama_error) == 400
    status, body = post_json(server.url_for("api", "chat"), {**ollama_body, "format": None})
    assert status == 200 and body["done"], body


def test_stored_responses_by_any_id_are_a_404_in_openais_shape(server):
    # Any printable id but "/" (a path separator, not part of an id).
    ids = st.characters(codec="ascii", categories=["L", "N", "P"], exclude_characters="/")

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(response_id=st.text(alphabet=ids, min_size=1, max_size=40))
    def fuzz(response_id):
        quoted = urllib.parse.quote(response_id, safe="")
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
            url = server.url_for("v1", "responses", quoted) + path
            status, _, data = request(method, url, timeout=REQUEST_TIMEOUT_S)
            assert status in (404, 405), (method, response_id, data[:300])
            openai_error(status, data)

    fuzz()
    assert request("GET", server.url_for("health"))[0] == 200


def test_tokenizer_info_when_off_is_a_404_in_openais_shape(server):
    # Off by default, as vLLM (test_eval_endpoints serves it): whatever the query or method.
    for method in ("GET", "POST"):
        status, _, data = request(method, server.url_for("tokenizer_info?x=%00&y=1"), b"{}")
        assert status == 404
        openai_error(status, data)


@pytest.mark.parametrize(
    "route, model", [("/api/embed", ollama.EmbedRequest),
                     ("/api/embeddings", ollama.LegacyEmbeddingRequest)]
)  # fmt: skip
def test_ollama_embed_fuzz_on_a_pooling_model(embed_server, route, model):
    """Ollama's embedding routes where they embed: bad bodies are Ollama's 4xx, good ones
    embeddings."""
    schema = model.model_json_schema()
    served = st.fixed_dictionaries({"model": st.just(EMBED_NAME)})
    bodies = st.builds(lambda body, name: {**body, **name} if isinstance(body, dict) else body,
                       from_schema(schema, schema.get("$defs", {})), served)  # fmt: skip
    fuzz_route(embed_server, route, bodies | JSON, ollama_error)
    status, body = post_json(
        embed_server.url_for("api", "embed"), {"model": EMBED_NAME, "input": ["a b", "c"]}
    )
    assert status == 200 and len(body["embeddings"]) == 2, body
    assert body["prompt_eval_count"] > 0
