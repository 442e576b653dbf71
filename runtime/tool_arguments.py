"""A tool call's arguments, written as text, read as the types the tool's JSON schema gives them,
each the way vLLM's parser of its format reads them (`runtime.tool_calls`, `runtime.tool_call_tags`).
"""

from __future__ import annotations

import ast
import json
import math

__all__ = ["coder_value", "glm_value", "minimax_value", "schema_types", "tool_parameters"]


def tool_parameters(tools: list[dict], name: str) -> dict:
    """The JSON schema properties of tool `name`'s parameters ({} when unknown)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            parameters = function.get("parameters") or {}
            return parameters.get("properties") or {}
    return {}


def coder_value(value: str, schema) -> object:
    """A qwen3_coder parameter's text as the type its `schema` gives (the text when it does not read)."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).lower() if isinstance(schema, dict) else "string"
    try:
        if kind in ("integer", "int"):
            return int(value)
        if kind in ("number", "float"):
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind in ("boolean", "bool"):
            return value.strip().lower() == "true"
        if kind in ("object", "array", "dict", "list"):
            try:
                return json.loads(value)
            except ValueError:
                return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # (what literal_eval raises)
        return value
    return value


def glm_value(value: str, schema) -> object:
    """A glm45 argument's text: itself where its `schema` says string, else read as JSON, else as a
    Python literal, else the text (vLLM's reading)."""
    if isinstance(schema, dict) and str(schema.get("type", "")).lower() == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


_ENUM_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def schema_types(schema) -> set[str]:
    """The types a parameter's JSON `schema` allows: its ``type`` (a name or a list), the types of its
    ``enum`` values, and those of its ``anyOf`` / ``oneOf`` / ``allOf`` choices; {"string"} when it
    names none (vLLM's minimax_m2 reading)."""
    if not isinstance(schema, dict):
        return {"string"}
    kinds = schema.get("type")
    types = {kinds} if isinstance(kinds, str) else {k for k in kinds if isinstance(k, str)} if isinstance(kinds, list) else set()
    if isinstance(schema.get("enum"), list):
        types |= {next((name for cls, name in _ENUM_TYPES if isinstance(v, cls)), "string") for v in schema["enum"]}
    for choices in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choices), list):
            types = types.union(*(schema_types(choice) for choice in schema[choices]))
    return {kind.lower() for kind in types} or {"string"}


def minimax_value(value: str, schema) -> object:
    """A minimax_m2 argument's text, stripped, as the first of the types its `schema` allows that
    reads it: integer, number (an integral one as an integer), boolean (true/1/yes/on, false/0/no/off),
    object or array (JSON), then text; null/none/nil are null; none of them: JSON, else the text."""
    value = value.strip()
    if value.lower() in ("null", "none", "nil"):
        return None
    types = schema_types(schema)
    if types & {"integer", "int"}:
        try:
            return int(value)
        except ValueError:
            pass
    if types & {"number", "float"}:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return int(number) if number.is_integer() else number
    if types & {"boolean", "bool"} and value.lower() in _BOOLEANS:
        return _BOOLEANS[value.lower()]
    if types & {"object", "array"}:
        try:
            return json.loads(value)
        except ValueError:
            pass
    if types & {"string", "str", "text"}:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value

