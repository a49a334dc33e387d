"""Random JSON schemas of the kinds clients send: nested objects, arrays, enums, bounded
numbers, required and optional fields. Bounded everywhere, so that every output is short."""

from __future__ import annotations

import random

NAMES = ["id", "name", "city", "age", "score", "tags", "owner", "items", "kind", "active"]
WORDS = ["red", "green", "blue", "small", "large", "cat", "dog", "yes", "no"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 3 if depth else 4))
    properties = {name: _random_value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _random_value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["array", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": _random_value(rng, depth + 1),
            "minItems": 1,
            "maxItems": rng.randint(1, 3),
        }
    return random_schema(rng, depth + 1)


def random_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


# Held-out style: schemas as clients write them for the openai client's `parse` (pydantic
# models): integers and numbers with no bounds (an id, a price), strings with or without a
# maxLength, arrays with a maxItems.
HELD_OUT_NAMES = NAMES + ["price", "count", "title", "email", "ratio", "year", "notes"]


def held_out_style_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(HELD_OUT_NAMES, rng.randint(1, 3 if depth else 5))
    properties = {name: _held_out_value(rng, depth) for name in names}
    schema = {"type": "object", "properties": properties, "required": names}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    if rng.random() < 0.3:
        schema["title"] = rng.choice(["Item", "Person", "Order", "Answer"])
    return schema


def _held_out_value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "integer", "number", "number", "boolean", "enum"]
    if depth < 1:
        kinds += ["array", "object"]
    kind = rng.choice(kinds)
    if kind == "string" and rng.random() < 0.5:
        return {"type": "string", "maxLength": rng.randint(8, 40)}
    if kind in ("integer", "number", "string", "boolean"):
        return {"type": kind}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        items = rng.choice([{"type": "string", "maxLength": 20}, {"type": "integer"}])
        items = rng.choice([items, {"type": "number"}])
        return {"type": "array", "items": items, "maxItems": rng.randint(2, 5)}
    return held_out_style_schema(rng, depth + 1)


def held_out_style_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [held_out_style_schema(rng) for _ in range(count)]
