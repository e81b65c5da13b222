"""Static limits on a request's JSON schema, checked before any grammar compiler sees it.

The grammar engine (llguidance) compiles a schema recursively, so a schema nested deep enough
(directly or through a chain of `$ref`s) overflows the compiling thread's stack, and some
shapes pass compilation only to exceed the engine's parser or lexer limits a few tokens into
generation (many optional properties, large regex repetition counts). These checks are cheap
(one iterative walk, no recursion in Python either) and refuse such schemas with a message
naming the limit; the grammar checker (grammar_sandbox.py) is the safety net behind them.

Also refused here: `minProperties` that only extra keys (`patternProperties` /
`additionalProperties`) can satisfy. The engine counts those keys as text and cannot keep
them distinct, so `{"x": 1, "x": 5, "x": 7}` would satisfy `minProperties: 3` as text but
not once parsed.

Values are generous for real schemas (OpenAI's own structured-output limits are lower).
`parameters_problem` is OpenAI's rule for tools: a function's parameters are an object schema.
"""
from __future__ import annotations

import json
import re
from urllib.parse import unquote

MAX_SCHEMA_BYTES = 262_144  # serialized JSON of all the schemas one request's grammar holds
MAX_SCHEMA_DEPTH = 100  # nested JSON objects/arrays, counted through local $refs (recursion excepted)
MAX_DEFINITIONS = 1_000  # entries in $defs / definitions
MAX_REFS = 2_000  # $ref keywords
MAX_OPTIONAL_PROPERTIES = 256  # properties of one object not listed in its `required`
MAX_PATTERN_CHARS = 1_000  # one `pattern` or `patternProperties` key
MAX_REGEX_REPEAT = 10_000  # a pattern's {n} / {n,m} bound, multiplied through nested groups

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_SCHEMA_VALUED = {"items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                  "not", "if", "then", "else", "contains", "propertyNames", "contentSchema"}
_SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems", "items"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def schema_problem(schema, what: str = "the schema") -> str | None:
    """The first limit `schema` exceeds, as a sentence naming it and `what`, or None."""
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return (f"{what} nests deeper than the grammar limit MAX_SCHEMA_DEPTH = {MAX_SCHEMA_DEPTH} "
                "(JSON objects and arrays, counted through $ref)")
    try:
        size = len(json.dumps(schema, ensure_ascii=False))  # safe now: the depth is bounded
    except (TypeError, ValueError) as exc:
        return f"{what} is not JSON: {exc}"
    if size > MAX_SCHEMA_BYTES:
        return f"{what} is {size} bytes of JSON; the grammar limit is MAX_SCHEMA_BYTES = {MAX_SCHEMA_BYTES}"
    definitions = refs = 0
    for node in _subschemas(schema):
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                definitions += len(node[key])
        refs += isinstance(node.get("$ref"), str)
        problem = _object_problem(node) or _pattern_problem(node) or _ref_cycle_problem(node, schema)
        if problem:
            return f"{what} has {problem}"
    if definitions > MAX_DEFINITIONS:
        return f"{what} has {definitions} definitions; the grammar limit is MAX_DEFINITIONS = {MAX_DEFINITIONS}"
    if refs > MAX_REFS:
        return f"{what} has {refs} $ref keywords; the grammar limit is MAX_REFS = {MAX_REFS}"
    return None


def total_size_problem(schemas: list, what: str) -> str | None:
    """MAX_SCHEMA_BYTES over several schemas (a request's tools), each already checked alone."""
    size = sum(len(json.dumps(s, ensure_ascii=False)) for s in schemas)
    if size > MAX_SCHEMA_BYTES:
        return f"{what} are {size} bytes of JSON together; the grammar limit is MAX_SCHEMA_BYTES = {MAX_SCHEMA_BYTES}"
    return None


def parameters_problem(name: str, parameters) -> str | None:
    """Why a function's `parameters` cannot be its arguments' schema (OpenAI requires a JSON
    Schema of type "object": the arguments are a JSON object), or None."""
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        return f"parameters of function {name!r} must be a JSON Schema object"
    kind = parameters.get("type", "object")
    if kind != "object":
        return (f"parameters of function {name!r} must be a JSON Schema of type \"object\" (the arguments "
                f"are a JSON object), got type {json.dumps(kind)}")
    return None


def _object_problem(node: dict) -> str | None:
    properties = node.get("properties")
    required = {name for name in node.get("required", ()) if isinstance(name, str)} \
        if isinstance(node.get("required"), list) else set()
    if isinstance(properties, dict):
        optional = sum(1 for name in properties if name not in required)
        if optional > MAX_OPTIONAL_PROPERTIES:
            return (f"an object with {optional} optional properties; the grammar limit is "
                    f"MAX_OPTIONAL_PROPERTIES = {MAX_OPTIONAL_PROPERTIES} (list more of them in `required`)")
    minimum = node.get("minProperties")
    extra_keys = bool(node.get("patternProperties")) or node.get("additionalProperties", True) is not False
    if isinstance(minimum, int) and not isinstance(minimum, bool) and extra_keys and minimum - len(required) >= 2:
        return (f"minProperties {minimum} with {len(required)} required properties: the other "
                f"{minimum - len(required)} would be keys from patternProperties/additionalProperties, which "
                "constrained decoding cannot keep distinct (a repeated key counts twice as text, once parsed); "
                "list the properties in `required`, or allow at most one key beyond them")
    return None


# Keys that do not constrain a value: a schema with only these and a $ref is its target.
_ANNOTATIONS = {"$ref", "$defs", "definitions", "$id", "$schema", "$anchor", "$comment", "title", "description",
                "default", "examples", "deprecated", "readOnly", "writeOnly"}


def _ref_cycle_problem(node: dict, root) -> str | None:
    """A $ref that reaches itself through $refs alone admits no value (the engine finds that
    out only when generation gets there)."""
    seen = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node.keys() <= _ANNOTATIONS:
        if id(node) in seen:
            return f"a $ref that only refers to itself ({node['$ref']!r}), which admits no value"
        seen.add(id(node))
        node = _resolve(node["$ref"], root)
    return None


def _pattern_problem(node: dict) -> str | None:
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_CHARS:
            return (f"a pattern of {len(pattern)} characters; the grammar limit is "
                    f"MAX_PATTERN_CHARS = {MAX_PATTERN_CHARS}")
        repeat = regex_repeat(pattern)
        if repeat > MAX_REGEX_REPEAT:
            return (f"pattern {_shown(pattern)}, which repeats up to {repeat} times; the grammar limit is "
                    f"MAX_REGEX_REPEAT = {MAX_REGEX_REPEAT} (counted repetitions, multiplied through nested groups)")
    return None


def regex_repeat(pattern: str) -> int:
    """The largest repetition count in `pattern`, nested counted repetitions multiplied:
    `(a{100}){100}` is 10000 (the engine's lexer unrolls them)."""
    groups = [1]  # per open group: the largest repetition inside it so far
    last_group = 1  # what a quantifier right after `)` multiplies
    largest, i, after_group = 1, 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i, after_group = i + 2, False
            continue
        if char == "[":  # a class: no groups or quantifiers inside
            end = i + 1 + (pattern[i + 1:i + 2] == "]")
            while end < len(pattern) and pattern[end] != "]":
                end += 1 + (pattern[end] == "\\")
            i, after_group = end + 1, False
            continue
        quantifier = _QUANTIFIER.match(pattern, i) if char == "{" else None
        if char == "(":
            groups.append(1)
        elif char == ")" and len(groups) > 1:
            last_group = groups.pop()
            groups[-1] = max(groups[-1], last_group)
            i, after_group = i + 1, True
            continue
        elif quantifier:
            low, high = quantifier.group(1), quantifier.group(2)
            count = max(int(low), int(high) if high else 0)
            count *= last_group if after_group else 1
            groups[-1] = max(groups[-1], count)
            largest = max(largest, count)
            i, after_group = quantifier.end(), False
            continue
        i, after_group = i + 1, False
    return max(largest, *groups)


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


def _subschemas(schema):
    """Every dict that is a (sub)schema of `schema`, by keyword (values of `enum`, `const`,
    `default` and the like are data, not schemas)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in _SCHEMA_VALUED:
                stack.append(value)


def _depth(root) -> int:
    """Containers on the longest path from `root`, a local $ref being an edge to its target.

    A path that comes back to a container it passed (a recursive schema) stops there: the
    engine compiles recursion lazily, with no deeper stack. Iterative, memoized, and stops
    early past MAX_SCHEMA_DEPTH.
    """
    if not isinstance(root, (dict, list)):
        return 0
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    work = [[root, iter(_children(root, root)), 0]]
    on_path.add(id(root))
    while work:
        frame = work[-1]
        for child in frame[1]:
            if id(child) in heights:
                frame[2] = max(frame[2], heights[id(child)])
            elif id(child) not in on_path:
                on_path.add(id(child))
                work.append([child, iter(_children(child, root)), 0])
                if len(work) > MAX_SCHEMA_DEPTH:
                    return len(work)
                break
        else:
            work.pop()
            on_path.discard(id(frame[0]))
            heights[id(frame[0])] = frame[2] + 1
            if frame[2] + 1 > MAX_SCHEMA_DEPTH:
                return frame[2] + 1
            if work:
                work[-1][2] = max(work[-1][2], frame[2] + 1)
    return heights[id(root)]


def _children(node, root):
    values = node.values() if isinstance(node, dict) else node
    for value in values:
        if isinstance(value, (dict, list)):
            yield value
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(node["$ref"], root)
        if isinstance(target, (dict, list)):
            yield target


def _resolve(ref: str, root):
    """A local JSON pointer ("#", "#/$defs/a") in `root`, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
