"""The structured-output schema suite bench/grammar_engines.py measures engines on: what
OpenAI structured outputs use, each with a valid instance and invalid ones (one per keyword
an engine might ignore), and a realistic document for the mask-time walk."""
from __future__ import annotations

OBJ = {"type": "object"}


def obj(properties: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


# name → (schema, valid instance, [invalid instances]); each invalid breaks the named feature.
SCHEMAS: dict[str, tuple[dict, object, list]] = {
    "nested objects": (
        obj({"user": obj({"name": {"type": "string"}, "address": obj({"city": {"type": "string"}, "zip": {"type": "string"}})})}),
        {"user": {"name": "Ada", "address": {"city": "London", "zip": "NW1"}}},
        [{"user": {"name": "Ada", "address": {"city": "London"}}}],
    ),
    "array min/maxItems": (
        obj({"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}),
        {"tags": ["red", "fast"]},
        [{"tags": []}, {"tags": ["a", "b", "c", "d"]}],
    ),
    "enum": (
        obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
        {"color": "green"},
        [{"color": "purple"}],
    ),
    "const": (
        obj({"version": {"const": "v1"}, "kind": {"type": "string"}}),
        {"version": "v1", "kind": "report"},
        [{"version": "v2", "kind": "report"}],
    ),
    "anyOf": (
        obj({"value": {"anyOf": [{"type": "integer"}, obj({"text": {"type": "string"}})]}}),
        {"value": {"text": "seven"}},
        [{"value": "seven"}],
    ),
    "$ref/$defs": (
        {"$defs": {"point": obj({"x": {"type": "number"}, "y": {"type": "number"}})},
         **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
        {"start": {"x": 0, "y": 1.5}, "end": {"x": -2, "y": 3}},
        [{"start": {"x": 0}, "end": {"x": -2, "y": 3}}],
    ),
    "recursive $ref": (
        {"$defs": {"node": obj({"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
         "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}, {"value": 4, "children": []}]},
        [{"value": 1, "children": [{"value": "two", "children": []}]}],
    ),
    "required/optional": (
        obj({"id": {"type": "integer"}, "nickname": {"type": "string"}, "age": {"type": "integer"}}, required=["id"]),
        {"id": 7, "age": 30},
        [{"nickname": "x"}],
    ),
    "additionalProperties false": (
        obj({"id": {"type": "integer"}}),
        {"id": 1},
        [{"id": 1, "extra": 2}],
    ),
    "string pattern": (
        obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
        {"sku": "ABC-1234"},
        [{"sku": "abc-12"}],
    ),
    "format date/email": (
        obj({"day": {"type": "string", "format": "date"}, "email": {"type": "string", "format": "email"}}),
        {"day": "2024-05-17", "email": "ada@example.com"},
        [{"day": "yesterday", "email": "ada@example.com"}, {"day": "2024-05-17", "email": "not an email"}],
    ),
    "minLength/maxLength": (
        obj({"code": {"type": "string", "minLength": 2, "maxLength": 5}}),
        {"code": "abc"},
        [{"code": "a"}, {"code": "abcdefg"}],
    ),
    "number/integer bounds": (
        obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}, "score": {"type": "number", "minimum": 0, "maximum": 1}}),
        {"age": 42, "score": 0.75},
        [{"age": 130, "score": 0.5}, {"age": 1.5, "score": 0.5}, {"age": 4, "score": 2.5}],
    ),
    "null types": (
        obj({"note": {"type": ["string", "null"]}, "parent": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}),
        {"note": None, "parent": None},
        [{"note": 5, "parent": None}],
    ),
}

# Keywords no engine here enforces: an engine should refuse them rather than ignore them
# (an ignored keyword yields output that fails the caller's validation).
UNSUPPORTED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
}

# The timing walk: an OpenAI-strict-style structured output of ~150 tokens.
REALISTIC_SCHEMA = {
    "$defs": {"item": obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "unit_price": {"type": "number", "minimum": 0},
    })},
    **obj({
        "order_id": {"type": "string"},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
        "placed_on": {"type": "string", "format": "date"},
        "customer": obj({"name": {"type": "string"}, "email": {"type": "string", "format": "email"},
                         "vip": {"type": "boolean"}}),
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 10},
        "note": {"type": ["string", "null"]},
    }),
}
REALISTIC_INSTANCE = {
    "order_id": "A-2024-000917",
    "status": "shipped",
    "placed_on": "2024-11-03",
    "customer": {"name": "Grace Hopper", "email": "grace@navy.example.org", "vip": True},
    "items": [
        {"sku": "KBD-0042", "quantity": 2, "unit_price": 49.5},
        {"sku": "MOU-1001", "quantity": 1, "unit_price": 19.99},
        {"sku": "CBL-7730", "quantity": 12, "unit_price": 3.25},
    ],
    "note": "Leave the parcel with the concierge, please; the office is closed on Fridays.",
}
