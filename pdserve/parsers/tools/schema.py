"""Schema-aware typing of XML tool-call parameter values (qwen3_coder).

The XML format carries every value as text. Clients expect JSON arguments
typed like the tool's JSON schema, so ``"5"`` becomes ``5`` for an integer
property. A value that does not fit any declared type stays a string (the
model's text is never lost), and without a schema every value is a string.

Numbers follow vLLM's qwen3_coder: schema type ``"float"`` (not JSON Schema,
but common in hand-written tool specs) means ``"number"``, and a number with a
whole value is reported as an integer (``5.0`` -> ``5``), so clients that
compare arguments by type see the same JSON as from vLLM.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from pdserve.protocol.openai import ChatCompletionToolsParam

_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}

# Non-JSON-Schema type names that models' tool specs use, mapped to the JSON type they mean.
_TYPE_ALIASES = {"float": "number"}

STRING_ONLY = frozenset({"string"})


def tool_properties(tools: list[ChatCompletionToolsParam]) -> dict[str, Mapping[str, Any]]:
    """Function name -> its parameters' ``properties`` (first definition wins)."""
    found: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        params = tool.function.parameters or {}
        props = params.get("properties")
        if isinstance(props, Mapping):
            found.setdefault(tool.function.name, props)
    return found


def schema_types(schema: Any) -> frozenset[str]:
    """JSON types a property schema allows; empty when it says nothing about types."""
    if not isinstance(schema, Mapping):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({_TYPE_ALIASES.get(declared, declared)})
    if isinstance(declared, list):
        return frozenset(_TYPE_ALIASES.get(t, t) for t in declared if isinstance(t, str))
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= schema_types(option)
    for value in schema.get("enum") or ():
        types.add(_JSON_TYPES.get(type(value), "object" if isinstance(value, dict) else "array"))
    if "const" in schema:
        types.add(_JSON_TYPES.get(type(schema["const"]), "string"))
    return frozenset(types)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def coerce(value: str, types: frozenset[str]) -> Any:
    """``value`` typed per the first allowed type it fits (null, boolean, integer, number, object/array)."""
    text = value.strip()
    if "null" in types and text == "null":
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"integer", "number"} and _INTEGER.fullmatch(text):
        return int(text)
    if "number" in types and _NUMBER.fullmatch(text):
        number = float(text)
        if math.isfinite(number):
            return int(number) if number.is_integer() else number
    if types & {"object", "array"}:
        try:
            parsed = json.loads(text, parse_constant=_reject_constant)
        except ValueError:
            return value
        if (isinstance(parsed, dict) and "object" in types) or (isinstance(parsed, list) and "array" in types):
            return parsed
    return value
